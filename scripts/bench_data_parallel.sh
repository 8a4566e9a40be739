#!/usr/bin/env bash
# Data-parallel attnkit-train against one process: tokens/s of 1 rank x 1 thread, 2 ranks x 1
# thread (--nproc 2) and 1 rank x 2 threads, in interleaved rounds so that a slow minute on a
# shared machine lands on every configuration, and the gradient allreduce's share of the
# 2-rank steps. Other arguments go to every run (default: the text task with mha and --ffn).
# Usage: scripts/bench_data_parallel.sh [--rounds 2] [attnkit-train flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2
args=()
while (($#)); do
  case "$1" in
    --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -gt 0 ] || args=(--task text --module mha --ffn)
scripts/build.sh --target attnkit-train >/dev/null
train=build/apps/attnkit-train

# The final report's "N tokens/s" (and the allreduce share where there is one).
run() { "$train" "${args[@]}" --quiet "$@" | grep "^done after step"; }
tokens_per_s() { sed -E 's/.* ([0-9]+) tokens\/s.*/\1/'; }

printf '%-7s %-26s %12s %s\n' round configuration tokens/s "allreduce share"
for round in $(seq "$rounds"); do
  one=$(run --threads 1 | tokens_per_s)
  report=$(run --threads 1 --nproc 2)
  two_ranks=$(tokens_per_s <<<"$report")
  share=$(sed -E 's/.*gradient allreduce ([0-9.]+%).*/\1/' <<<"$report")
  two_threads=$(run --threads 2 | tokens_per_s)
  printf '%-7s %-26s %12s\n' "$round" "1 rank x 1 thread" "$one"
  printf '%-7s %-26s %12s %s\n' "$round" "2 ranks x 1 thread" "$two_ranks" "$share"
  printf '%-7s %-26s %12s\n' "$round" "1 rank x 2 threads" "$two_threads"
  awk -v a="$one" -v b="$two_ranks" -v c="$two_threads" 'BEGIN {
    printf "        2 ranks / 1 rank x 1 thread: %.2fx; / 1 rank x 2 threads: %.2fx\n", b / a, b / c }'
done
