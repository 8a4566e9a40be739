#!/usr/bin/env bash
# Runs the tests that start processes, use ports or depend on timing N times in a row and
# stops at the first failure (ctest --repeat until-fail:N): the CLI tests (label `process`:
# attnkit-train's faults and its two-rank data-parallel runs) and the unit tests of the
# process group, the launcher and the checkpoints.
# Usage: scripts/stress.sh [N, default 20] [--asan | --libtorch2]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
shift || true
leg=()
[ $# -gt 0 ] && leg=("$1")
scripts/test.sh "${leg[@]}" -L process --repeat "until-fail:$runs"
scripts/test.sh "${leg[@]}" -R 'DataParallel|GradientSync|Checkpoint|Resume' \
  --repeat "until-fail:$runs"
echo "stress: $runs runs in a row of every process, port and timing test passed${leg:+ (${leg[*]})}"
