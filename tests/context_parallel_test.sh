#!/usr/bin/env bash
# Context-parallel attention on 2 and 4 ranks over loopback (tests/context_parallel_check.cpp),
# then a rank that dies during a call: the other must stop within the group's timeout, naming it.
# Each run also trains attnkit-train's model context-parallel against one process (the text
# task on DATA).
# Usage: tests/context_parallel_test.sh PATH/TO/attnkit-context-parallel-check DATA
set -u
check=$1
data=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

for ranks in 2 4; do
  if "$check" --ranks "$ranks" --data "$data" >"$work/out" 2>&1; then
    echo "ok: $ranks ranks: $(grep -c '^ok:' "$work/out") checks passed"
  else
    echo "FAIL: $ranks ranks:"
    failures=$((failures + 1))
  fi
  cat "$work/out"
done

start=$(date +%s)
"$check" --ranks 2 --fault die --timeout 10 >"$work/out" 2>&1
status=$?
elapsed=$(($(date +%s) - start))
if [ "$status" -ne 0 ] && grep -q "rank 0: lost rank 1" "$work/out" && [ "$elapsed" -le 60 ]; then
  echo "ok: a rank that dies: the other stops in ${elapsed} s naming it (status $status)"
else
  echo "FAIL: a rank that dies (status $status, ${elapsed} s):"
  failures=$((failures + 1))
fi
cat "$work/out"
exit $((failures > 0))
