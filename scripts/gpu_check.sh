#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds attnkit there against that machine's
# PyTorch, runs the whole unit suite on CUDA, scripts/bench_gpu.sh, the GPU section of
# tests/distributed_test.sh and attnkit-decode-bench on CUDA, and prints one summary: counts,
# failures and the benchmark table. Meant for a GPU lent for a quarter of an hour: it ends
# within 9 minutes of wall time on 16 cores, each step under its own time limit.
#
# Usage:
#   scripts/gpu_check.sh --prepare   on the machine without the GPU (Debian): copies the
#                                    headers and static libraries that the GPU machine lacks
#                                    (GoogleTest, cxxopts, stb, Gloo's headers, nlohmann-json,
#                                    ICU) into .gpu-deps/ (git-ignored, 44 MB), to carry with
#                                    the tree
#   scripts/gpu_check.sh [--python PY] [--log-dir DIR]
#                                    on the GPU machine: build, run, summarise. Without a GPU it
#                                    says so and stops (exit 3) before building anything.
#
# What it expects of the GPU machine: a PyTorch with CUDA (python3, or --python) whose CUDA
# matches the machine's nvcc (PyTorch 2.11 with CUDA 13.0 and nvcc 13.0 were checked), g++ 11
# or later, CMake 3.21+, ninja. Binaries built on another machine are not carried: they would
# need that machine's LibTorch (2.15 here, 2.11 there; LibTorch has no stable C++ ABI across
# releases). Build folder: build-gpu/.
#
# Where the minutes go: each step's limit, and what it took on the first run (one H100, 16 cores,
# PyTorch 2.11; docs/building.md). The limits add up to 9 minutes with the GPU check.
#   check the GPU                  a few seconds
#   configure and build            2 min limit (79 s: ninja on all cores, the precompiled header first)
#   unit suite on CUDA             3 min 5 s limit (166 s: 16 shards of attnkit_tests at once)
#   scripts/bench_gpu.sh           2 min 5 s limit (about 2 min: 4 repeats; flex_attention
#                                  compiles once per case)
#   distributed GPU section        75 s limit (67 s)
#   attnkit-decode-bench --device cuda   25 s limit (4 s)
# A step that runs out of time is reported as such, and the later steps still run.
set -uo pipefail
cd "$(dirname "$0")/.."

deps=$PWD/.gpu-deps
python=python3
logs=build-gpu/gpu_check
mode=run
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare) mode=prepare; shift ;;
    --python) python=${2:?--python needs a path}; shift 2 ;;
    --log-dir) logs=${2:?--log-dir needs a folder}; shift 2 ;;
    -h|--help) sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if [[ $mode == prepare ]]; then
  scripts/setup.sh
  rm -rf "$deps"
  mkdir -p "$deps/usr/include" "$deps/usr/lib/x86_64-linux-gnu/cmake"
  # GoogleTest's package keeps its prefix relative to its CMake files: copy the same layout.
  cp -r /usr/include/gtest /usr/include/gmock /usr/include/cxxopts.hpp /usr/include/stb \
    /usr/include/gloo /usr/include/nlohmann /usr/include/unicode "$deps/usr/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a \
    "$deps/usr/lib/x86_64-linux-gnu/"
  # ICU for apps/sentence_encoder's tokenizer: its shared libraries (the binaries built there
  # find them through the build tree's RPATH).
  cp -P /usr/lib/x86_64-linux-gnu/libicu{uc,data}.so* "$deps/usr/lib/x86_64-linux-gnu/"
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$deps/usr/lib/x86_64-linux-gnu/cmake/"
  mkdir -p "$deps/usr/share/cmake" "$deps/usr/lib/cmake"
  cp -r /usr/share/cmake/nlohmann_json "$deps/usr/share/cmake/"
  cp -r /usr/lib/cmake/cxxopts "$deps/usr/lib/cmake/"
  echo "gpu_check: .gpu-deps/ ready ($(du -sh "$deps" | cut -f1)); carry it to the GPU machine"
  exit 0
fi

# ---- a GPU, or stop ----------------------------------------------------------------------
gpu=$("$python" -c 'import torch
if not torch.cuda.is_available(): raise SystemExit(1)
p = torch.cuda.get_device_properties(0)
print("%s, %d MiB, torch %s, CUDA %s" % (p.name, p.total_memory >> 20, torch.__version__, torch.version.cuda))' 2>/dev/null)
if [[ -z $gpu ]]; then
  echo "gpu_check: no GPU: '$python' has no PyTorch that sees a CUDA device" \
       "($(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -1 || echo 'no nvidia-smi'))." \
       "Nothing was built or run; run this on a machine with an NVIDIA GPU."
  exit 3
fi
[[ -d $deps/usr/include/gtest ]] ||
  { echo "gpu_check: no .gpu-deps/: run scripts/gpu_check.sh --prepare first, and carry it" >&2; exit 2; }

mkdir -p "$logs"
start=$SECONDS
summary=()
failed=0
note() { summary+=("$*"); echo "gpu_check: $*"; }
# step NAME LIMIT_S COMMAND...: runs COMMAND into $logs/NAME.log under a time limit.
step() {
  local name=$1 limit=$2 t0=$SECONDS code
  shift 2
  # A new bash runs it, so that the steps written as functions (exported) run under timeout too.
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$logs/$name.log" 2>&1
  code=$?
  if [[ $code -eq 124 || $code -eq 137 ]]; then
    note "$name: OUT OF TIME after ${limit} s (log: $logs/$name.log)"
    failed=$((failed + 1))
  elif [[ $code -ne 0 ]]; then
    note "$name: FAILED, exit $code, in $((SECONDS - t0)) s (log: $logs/$name.log)"
    failed=$((failed + 1))
  else
    note "$name: passed in $((SECONDS - t0)) s"
  fi
  return "$code"
}
note "GPU: $gpu; $(nproc) cores; nvcc $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'missing')"

# ---- build ------------------------------------------------------------------------------
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
export CPATH=$deps/usr/include${CPATH:+:$CPATH}  # cxxopts and stb are included directly
export ATTNKIT_PYTHON=$python                    # the Python side of the cross-language tests
# The torch folder first: TorchConfig would otherwise take any system LibTorch's libraries.
build() {
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix/../..;$torch_prefix;$deps/usr" \
    -DTORCH_CUDA_ARCH_LIST="$("$python" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" &&
    cmake --build build-gpu -j "$(nproc)" \
      --target attnkit_tests attnkit-train attnkit-bench attnkit-decode-bench sentence_encoder
}
export -f build
export torch_prefix deps python
if ! step build 120 build; then
  tail -n 30 "$logs/build.log"
  echo "gpu_check: the build failed; nothing else ran ($((SECONDS - start)) s)"
  exit 1
fi

# ---- the unit suite on CUDA, in shards ---------------------------------------------------
shards=16
suite() {
  local pids=() i code=0
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      build-gpu/tests/attnkit_tests --gtest_brief=1 >"$logs/suite.$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || code=1; done
  return $code
}
export -f suite
export shards logs
step suite 185 suite
# --gtest_brief prints only failures; the counts come from each shard's closing lines.
shard_total() { cat "$logs"/suite.*.log | awk -v tag="$1" '$0 ~ tag { n += $4 } END { print n + 0 }'; }
passed=$(shard_total '^\\[  PASSED  \\]')
skipped=$(shard_total '^\\[  SKIPPED \\] [0-9]+ tests?, listed below')
failures=$(cat "$logs"/suite.*.log | grep '^\[  FAILED  \] [A-Za-z]' | grep -v 'listed below' | sort -u)
note "unit suite on CUDA: ${passed:-0} passed, $(grep -c . <<<"$failures") failed, ${skipped:-0} skipped"
[[ -n $failures ]] && summary+=("$failures")

# ---- benchmarks and the distributed GPU section ------------------------------------------
step bench_gpu 125 scripts/bench_gpu.sh --bench build-gpu/apps/attnkit-bench --python "$python" \
  --repeats 4
step distributed_gpu 75 bash tests/distributed_test.sh build-gpu/apps/attnkit-train . --gpu-only
step decode_bench 25 build-gpu/apps/attnkit-decode-bench --device cuda --new-tokens 100 \
  --repeats 3 --threads 0

# ---- one summary -------------------------------------------------------------------------
echo
echo "==== gpu_check summary ($((SECONDS - start)) s) ===="
printf '%s\n' "${summary[@]}"
echo "-- scripts/bench_gpu.sh (bfloat16, d 768, h 12; medians):"
cat "$logs/bench_gpu.log" 2>/dev/null
echo "-- distributed GPU section:"
grep -E '^(ok|FAIL|skip)' "$logs/distributed_gpu.log" 2>/dev/null || true
echo "-- attnkit-decode-bench --device cuda:"
cat "$logs/decode_bench.log" 2>/dev/null
echo "gpu_check: $failed step(s) failed"
[[ $failed -eq 0 ]]
