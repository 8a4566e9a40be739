#!/usr/bin/env bash
# Runs the tests that start processes, use ports or depend on timing N times in a row and
# stops at the first failure (ctest --repeat until-fail:N): the CLI tests (label `process`:
# attnkit-train's faults, its signals and claim on --save, and its two-rank data-parallel
# runs) and the unit tests of the process group, the launcher and the checkpoints.
# Usage: scripts/stress.sh [N, default 20] [--asan | --libtorch2] [-R REGEX]
#   -R REGEX   only the tests whose names match (e.g. -R signals: tests/signals_test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
shift || true
leg=()
if [ $# -gt 0 ] && [ "$1" != "-R" ]; then
  leg=("$1")
  shift
fi
if [ $# -gt 0 ]; then
  [ "$1" = "-R" ] && [ $# -eq 2 ] || { echo "usage: scripts/stress.sh [N] [--asan | --libtorch2] [-R REGEX]" >&2; exit 2; }
  scripts/test.sh "${leg[@]}" -R "$2" --repeat "until-fail:$runs"
  echo "stress: $runs runs in a row of the tests matching '$2' passed${leg:+ (${leg[*]})}"
  exit 0
fi
scripts/test.sh "${leg[@]}" -L process --repeat "until-fail:$runs"
scripts/test.sh "${leg[@]}" -R 'DataParallel|GradientSync|Checkpoint|Resume' \
  --repeat "until-fail:$runs"
echo "stress: $runs runs in a row of every process, port and timing test passed${leg:+ (${leg[*]})}"
