#!/usr/bin/env bash
# Training throughput, C++ (attnkit-train) against the same model and loop in Python
# PyTorch (scripts/train_reference.py) on the same LibTorch, side by side in one run; C++
# with its default fused backend and with --backend math (the book's path, as in Python).
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

# Training steps/s of attnkit-train with the given extra flags: the final metrics line's
# tokens/s (evaluation excluded) over 64 x 16 tokens per step.
cpp_steps_per_s() {
  build/apps/attnkit-train --task copy --module mha --steps "$steps" --eval-every "$steps" \
    --threads "$threads" --quiet --metrics "$metrics" "$@" >/dev/null
  tail -1 "$metrics" | sed 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/' |
    awk '{printf "%.1f", $1 / (64 * 16)}'
}

ratio() { awk -v c="$1" -v p="$2" 'BEGIN {printf "%.2f", c / p}'; }

# Interleaved, so that drifts of this machine's speed hit all three alike.
for round in 1 2 3; do
  fused=$(cpp_steps_per_s)  # the default: --backend fused
  math=$(cpp_steps_per_s --backend math)
  py=$("$python" scripts/train_reference.py --steps "$steps" --threads "$threads" |
       sed 's/python: \([0-9.]*\) steps.*/\1/')
  echo "round $round: C++ $fused steps/s (fused), $math (math), Python $py;" \
       "ratio $(ratio "$fused" "$py")x (fused), $(ratio "$math" "$py")x (math)"
done
