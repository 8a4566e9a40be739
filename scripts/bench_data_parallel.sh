#!/usr/bin/env bash
# Data-parallel attnkit-train against one process: tokens/s of 1 rank x 1 thread, 2 ranks x 1
# thread (--nproc 2) and 1 rank x 2 threads, in interleaved rounds so that a slow minute on a
# shared machine lands on every configuration, and the gradient allreduce's share of the
# 2-rank steps. Other arguments go to every run (default: the text task with mha and --ffn).
# With --bucket-mb A,B,...: only 2 ranks x 1 thread, once per --bucket-mb value in each round
# (0 = one allreduce after backward; else buckets started during backward), and the share of
# the step spent waiting for the allreduce that backward did not hide.
# Usage: scripts/bench_data_parallel.sh [--rounds 2] [--bucket-mb 0,0.1] [attnkit-train flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=2
buckets=""
args=()
while (($#)); do
  case "$1" in
    --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
    --bucket-mb) buckets=${2:?--bucket-mb needs a comma-separated list}; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -gt 0 ] || args=(--task text --module mha --ffn)
scripts/build.sh --target attnkit-train >/dev/null
train=build/apps/attnkit-train

# The final report's "N tokens/s" (and the allreduce share where there is one).
run() { "$train" "${args[@]}" --quiet "$@" | grep "^done after step"; }
tokens_per_s() { sed -E 's/.* ([0-9]+) tokens\/s.*/\1/'; }

share_of() { sed -E 's/.*gradient allreduce ([0-9.]+%).*/\1/'; }

if [ -n "$buckets" ]; then
  printf '%-7s %-26s %12s %s\n' round "2 ranks x 1 thread" tokens/s "allreduce wait share"
  for round in $(seq "$rounds"); do
    for mb in ${buckets//,/ }; do
      report=$(run --threads 1 --nproc 2 --bucket-mb "$mb")
      printf '%-7s %-26s %12s %s\n' "$round" "--bucket-mb $mb" "$(tokens_per_s <<<"$report")" \
        "$(share_of <<<"$report")"
    done
  done
  exit 0
fi

printf '%-7s %-26s %12s %s\n' round configuration tokens/s "allreduce share"
for round in $(seq "$rounds"); do
  one=$(run --threads 1 | tokens_per_s)
  report=$(run --threads 1 --nproc 2)
  two_ranks=$(tokens_per_s <<<"$report")
  share=$(share_of <<<"$report")
  two_threads=$(run --threads 2 | tokens_per_s)
  printf '%-7s %-26s %12s\n' "$round" "1 rank x 1 thread" "$one"
  printf '%-7s %-26s %12s %s\n' "$round" "2 ranks x 1 thread" "$two_ranks" "$share"
  printf '%-7s %-26s %12s\n' "$round" "1 rank x 2 threads" "$two_threads"
  awk -v a="$one" -v b="$two_ranks" -v c="$two_threads" 'BEGIN {
    printf "        2 ranks / 1 rank x 1 thread: %.2fx; / 1 rank x 2 threads: %.2fx\n", b / a, b / c }'
done
