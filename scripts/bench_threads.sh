#!/usr/bin/env bash
# How each implementation scales with threads: attnkit-bench at each thread count (LibTorch's
# and the BLAS's threads both; see attnkit/threads.h), then the table of medians and speed-ups
# over the fewest threads. The thread counts alternate implementation by implementation, so a
# slow minute on a shared machine hits both sides of a ratio. Other arguments (shape,
# --repeats, ...) go to attnkit-bench.
# Usage: scripts/bench_threads.sh [--libtorch2] [--threads 1,2] [--only a,b] [--batch 8 ...]
#        scripts/bench_threads.sh --train [--libtorch2] [--threads 1,2,0] [--only text-mha ...]
#   --libtorch2  also attnkit built on Debian 13's LibTorch 2.6, in the Debian 13 root of
#                scripts/debian13.sh (build-libtorch2/ is built there first).
#   --train      attnkit-train instead: training tokens/s and CPU cores used for each task and
#                module at each thread count (scripts/bench_train_threads.py; other arguments,
#                such as --steps, go to it), on each LibTorch version.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
only_default=wrapper,mha,combined,einsum,fused,chunked,torch-mha,torch-mha-noweights,math-core,chunked-core
only=$only_default
thread_counts=1,2
train_threads=
libtorch2=false
train=false
args=()
while (($#)); do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --threads) thread_counts=${2:?--threads needs a comma-separated list, e.g. 1,2}; train_threads=$2; shift 2 ;;
    --libtorch2) libtorch2=true; shift ;;
    --train) train=true; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if $train; then
  only_args=()
  [ "$only" = "${only_default:-}" ] || only_args=(--only "$only")
  scripts/build.sh --target attnkit-train >/dev/null
  "$python" scripts/bench_train_threads.py --program build/apps/attnkit-train \
    --threads "${train_threads:-1,2,0}" --label "LibTorch 1.13" "${only_args[@]}" "${args[@]}"
  if $libtorch2; then
    scripts/debian13.sh bash -c 'cmake --preset libtorch2 >/dev/null && cmake --build --preset libtorch2 --target attnkit-train >/dev/null'
    scripts/debian13.sh python3 scripts/bench_train_threads.py \
      --program build-libtorch2/apps/attnkit-train --threads "${train_threads:-1,2,0}" \
      --label "LibTorch 2.6" "${only_args[@]}" "${args[@]}"
  fi
  exit 0
fi
bench_setup "$libtorch2" bench-threads
files=()
for name in ${only//,/ }; do
  for threads in ${thread_counts//,/ }; do
    echo "-- LibTorch 1.13: $name, $threads thread(s) --"
    build/apps/attnkit-bench "${args[@]}" --only "$name" --threads "$threads" \
      --json "$work/cpp1-$name-$threads.json"
    files+=("$work/cpp1-$name-$threads.json")
    if $libtorch2; then
      echo "-- LibTorch 2.6: $name, $threads thread(s) --"
      scripts/debian13.sh build-libtorch2/apps/attnkit-bench "${args[@]}" --only "$name" \
        --threads "$threads" --json "$work/cpp2-$name-$threads.json"
      files+=("$work/cpp2-$name-$threads.json")
    fi
  done
done
echo "-- scaling --"
"$python" scripts/bench_reference.py --scaling "${files[@]}"
