#!/usr/bin/env bash
# Training throughput, C++ (attnkit-train) against the same model and loop in Python
# PyTorch (scripts/train_reference.py) on the same LibTorch, side by side in one run.
# Default copy configuration: batch 64, 8 tokens + separator + copy, d_model 64, 4 heads.
# Usage: scripts/bench_train_vs_python.sh [STEPS] [THREADS]   (defaults 300, 1)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-300}
threads=${2:-1}
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
scripts/build.sh --target attnkit-train >/dev/null
metrics=$(mktemp --suffix=.jsonl)
trap 'rm -f "$metrics"' EXIT

for round in 1 2 3; do
  build/apps/attnkit-train --task copy --module mha --steps "$steps" --eval-every "$steps" \
    --threads "$threads" --quiet --metrics "$metrics" >/dev/null
  # Training tokens/s of the final line (evaluation excluded) -> steps/s at 64 x 16 tokens.
  cpp=$(tail -1 "$metrics" | sed 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/' |
        awk '{printf "%.1f", $1 / (64 * 16)}')
  py=$("$python" scripts/train_reference.py --steps "$steps" --threads "$threads" |
       sed 's/python: \([0-9.]*\) steps.*/\1/')
  echo "round $round: C++ $cpp steps/s, Python $py steps/s, ratio $(awk -v c="$cpp" -v p="$py" 'BEGIN {printf "%.2f", c / p}')x"
done
