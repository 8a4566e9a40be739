#!/usr/bin/env bash
# The block-mask issue's targets (docs/benchmarks.md, "Block masks"), side by side in one run,
# forward+backward medians of attnkit-bench's chunked core (x (b, n, 768) viewed as 12 heads):
#   mask_mod overhead  Mask::from_function(kv <= q) against Mask::causal(), forward and
#                      forward+backward, n 1,024 (b 8) at every thread count, and --long-tokens
#                      (b 1; the issue's 16,384 by default) at the last one, one timed run each
#                      (one forward+backward there takes about a minute on this machine)
#   reuse              a stack of 12 attention calls (n 4,096, documents of 512) with one block
#                      mask made per step; the mask work is the median of one create_block_mask
#                      of that mask (timed alone, the same inputs) over the median step
#   no regression      with --baseline REV: REV's attnkit-bench and attnkit-decode-bench, built
#                      in build-baseline/ from a git worktree, against this tree's, run in
#                      turns (--turns, 7 by default), medians of the turns: the chunked core
#                      (b 8, n 1,024, causal), toy decode (the text model) and GPT-2 small decode
# Usage: scripts/bench_block_mask.sh [--libtorch2 | --only-libtorch2] [--threads 1,2]
#                                    [--repeats 3] [--long-tokens 16384] [--baseline REV]
#                                    [--turns 7] [--only-regression]
#   --libtorch2  the same on LibTorch 2.6 too (build-libtorch2/, in the Debian 13 root); the
#                baseline is then built there as well (build-baseline-libtorch2/)
#   --only-libtorch2   LibTorch 2.6 alone
#   --only-regression  with --baseline: the no-regression turns alone
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
thread_counts=1,2
libtorch2=false
repeats=3
long_tokens=16384
baseline=""
turns=7
only_libtorch2=false
only_regression=false
while (($#)); do
  case "$1" in
    --threads) thread_counts=${2:?--threads needs a list, e.g. 1,2}; shift 2 ;;
    --libtorch2) libtorch2=true; shift ;;
    --only-libtorch2) libtorch2=true only_libtorch2=true; shift ;;
    --only-regression) only_regression=true; shift ;;
    --repeats) repeats=${2:?--repeats needs a number}; shift 2 ;;
    --long-tokens) long_tokens=${2:?--long-tokens needs a number}; shift 2 ;;
    --baseline) baseline=${2:?--baseline needs a git revision}; shift 2 ;;
    --turns) turns=${2:?--turns needs a number}; shift 2 ;;
    *) echo "bench_block_mask: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
if $only_regression && [ -z "$baseline" ]; then
  echo "bench_block_mask: --only-regression needs --baseline REV" >&2
  exit 2
fi
bench_setup "$libtorch2" bench-block-mask
scripts/build.sh --target attnkit-decode-bench >/dev/null
$libtorch2 && scripts/debian13.sh bash -c \
  'cmake --build --preset libtorch2 --target attnkit-decode-bench >/dev/null'

declare -A run_in=([1.13]="" [2.6]="scripts/debian13.sh")
declare -A build_of=([1.13]=build [2.6]=build-libtorch2)
legs=(1.13)
$libtorch2 && legs+=(2.6)
$only_libtorch2 && legs=(2.6)

# REV's programs, built once per leg in build-baseline[-libtorch2]/ from a worktree.
if [ -n "$baseline" ]; then
  rev=$(git rev-parse --verify "$baseline^{commit}")
  source_dir=$PWD/build/baseline-src
  [ -d "$source_dir" ] && git worktree remove --force "$source_dir"
  git worktree add --detach --force "$source_dir" "$rev" >/dev/null
  trap 'rm -rf "$work"; git worktree remove --force "$source_dir"' EXIT
  for leg in "${legs[@]}"; do
    out=$PWD/build-baseline
    [ "$leg" = 2.6 ] && out+=-libtorch2
    build_of[base-$leg]=$out
    echo "bench_block_mask: building $baseline ($rev) for LibTorch $leg in $out" >&2
    ${run_in[$leg]} bash -c "cmake -S '$source_dir' -B '$out' -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DATTNKIT_BUILD_TESTS=OFF >/dev/null && cmake --build '$out' -j $(nproc) \
      --target attnkit-bench attnkit-decode-bench >/dev/null"
  done
fi

# attnkit-bench's chunked core: PROGRAM_DIR LEG THREADS NAME ARGS... (--repeats among them
# overrides the default), its JSON left in $work/NAME.json; `median NAME PASS` reads one
# median (ms) from it, PASS forward or forward+backward.
bench() {
  local dir=$1 leg=$2 threads=$3 name=$4
  shift 4
  ${run_in[$leg]} "$dir/apps/attnkit-bench" --threads "$threads" --repeats "$repeats" \
    --d-model 768 --heads 12 --only chunked-core "$@" --json "$work/$name.json" >/dev/null
}
median_of() {
  "$python" -c 'import json, sys
r = [x for x in json.load(open(sys.argv[1]))["results"] if x["pass"] == sys.argv[2]]
print("%.1f" % r[0]["median_ms"])' "$work/$1.json" "$2"
}
ratio() { "$python" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.3f}x')" "$1" "$2"; }
median() { "$python" -c "import statistics, sys; print('%.2f' % statistics.median(map(float, sys.argv[1:])))" "$@"; }

last_threads=${thread_counts##*,}
$only_regression && legs_of_targets=() || legs_of_targets=("${legs[@]}")
for leg in ${legs_of_targets[@]+"${legs_of_targets[@]}"}; do
  dir=${build_of[$leg]}
  for threads in ${thread_counts//,/ }; do
    echo "== LibTorch $leg, $threads thread(s); medians in ms of $repeats (the long case: 1) =="
    shapes=("8 1024 $repeats")
    [ "$threads" = "$last_threads" ] && shapes+=("1 $long_tokens 1")
    for shape in "${shapes[@]}"; do
      read -r b n runs <<<"$shape"
      bench "$dir" "$leg" "$threads" "causal-$b-$n" --batch "$b" --tokens "$n" --mask module --repeats "$runs"
      bench "$dir" "$leg" "$threads" "mod-$b-$n" --batch "$b" --tokens "$n" --mask causal-mod --repeats "$runs"
      for pass in forward forward+backward; do
        causal=$(median_of "causal-$b-$n" "$pass") mod=$(median_of "mod-$b-$n" "$pass")
        echo "mask_mod overhead, b $b n $n, $pass: Mask::causal() $causal, causal mask_mod $mod -> $(ratio "$mod" "$causal") (target <= 1.05x)"
      done
    done
    bench "$dir" "$leg" "$threads" reuse --batch 1 --tokens 4096 --mask documents:8 --layers 12 \
      --block-mask per-step
    step=$(median_of reuse forward+backward)
    build_ms=$("$python" -c 'import json, sys; print("%.2f" % json.load(open(sys.argv[1]))["block_mask_build_ms"])' "$work/reuse.json")
    bench "$dir" "$leg" "$threads" reuse-per-call --batch 1 --tokens 4096 --mask documents:8 \
      --layers 12 --block-mask per-call
    per_call=$(median_of reuse-per-call forward+backward)
    echo "reuse, 12 layers, n 4096, documents of 512, forward+backward: one block mask per step $step (create_block_mask $build_ms = $("$python" -c "import sys; print(f'{100 * float(sys.argv[1]) / float(sys.argv[2]):.2f}%')" "$build_ms" "$step") of the step; target <= 2%); each call judging the mask itself $per_call"
  done
done

if [ -n "$baseline" ]; then
  # Turns: baseline, then this tree, --turns times; each turn's median of --repeats.
  decode() {  # DIR LEG FLAGS... -> cached tokens/s
    local dir=$1 leg=$2
    shift 2
    ${run_in[$leg]} "$dir/apps/attnkit-decode-bench" "$@" --threads 1 --json "$work/decode.json" >/dev/null
    "$python" -c 'import json, sys; print("%.1f" % json.load(open(sys.argv[1]))["cached_tokens_per_s"])' "$work/decode.json"
  }
  toy=(--vocab 256 --context 64 --d-model 64 --heads 4 --layers 2 --prompt 4 --new-tokens 60 --repeats 5 --no-uncached)
  gpt2=(--prompt 4 --new-tokens 50 --repeats 1 --no-uncached)
  for leg in "${legs[@]}"; do
    for what in chunked toy gpt2; do
      old=() new=()
      for ((turn = 0; turn < turns; turn++)); do
        for side in base new; do
          dir=${build_of[$leg]}
          [ "$side" = base ] && dir=${build_of[base-$leg]}
          case "$what" in
            chunked) bench "$dir" "$leg" 2 "regress-$side" --batch 8 --tokens 1024 --mask module
                     value=$(median_of "regress-$side" forward+backward) ;;
            toy) value=$(decode "$dir" "$leg" "${toy[@]}") ;;
            gpt2) value=$(decode "$dir" "$leg" "${gpt2[@]}") ;;
          esac
          if [ "$side" = base ]; then old+=("$value"); else new+=("$value"); fi
        done
      done
      unit="tokens/s"
      [ "$what" = chunked ] && unit="ms (2 threads)"
      echo "no regression, LibTorch $leg, $what: $baseline $(median "${old[@]}") $unit, this tree $(median "${new[@]}") $unit -> $(ratio "$(median "${new[@]}")" "$(median "${old[@]}")") (target: within 3%; $turns turns: ${old[*]} / ${new[*]})"
    done
  done
fi
