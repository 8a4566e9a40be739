#!/usr/bin/env bash
# Training throughput, C++ (attnkit-train) against the same model and loop in Python
# PyTorch (scripts/train_reference.py) on the same LibTorch, side by side in one run; C++
# with its default fused backend and with --backend math (the book's path, as in Python).
#   copy  the default copy configuration: batch 64, 8 tokens + separator + copy, d_model 64,
#         4 heads, 1 layer (64 x 16 tokens per step)
#   text  the default text configuration: batch 64, 64-byte windows, d_model 64, 4 heads,
#         2 layers (64 x 64 tokens per step)
# Usage: scripts/bench_train_vs_python.sh [--task copy|text] [--libtorch2] [STEPS] [THREADS]
#   defaults: copy, 300 steps, 1 thread
#   --libtorch2  also Debian 13's LibTorch 2.6 and PyTorch 2.6 (scripts/debian13.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
task=copy
libtorch2=false
positional=()
while (($#)); do
  case "$1" in
    --task) task=${2:?--task needs copy or text}; shift 2 ;;
    --libtorch2) libtorch2=true; shift ;;
    -*) echo "unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
    *) positional+=("$1"); shift ;;
  esac
done
steps=${positional[0]:-300}
threads=${positional[1]:-1}
case "$task" in
  copy) tokens_per_step=$((64 * 16)) ;;
  text) tokens_per_step=$((64 * 64)) ;;
  *) echo "--task: expected copy or text, got '$task'" >&2; exit 2 ;;
esac
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
scripts/build.sh --target attnkit-train >/dev/null
legs=(1.13)
if $libtorch2; then
  scripts/debian13.sh bash -c 'cmake --preset libtorch2 >/dev/null && cmake --build --preset libtorch2 --target attnkit-train >/dev/null'
  legs+=(2.6)
fi
mkdir -p build  # inside the repository, so that the Debian 13 root sees it too
metrics=$(mktemp "$PWD/build/bench-train-vs-python.XXXXXX")
trap 'rm -f "$metrics"' EXIT

# Runs "$@" on the leg's LibTorch: this machine's, or the Debian 13 root's.
on_leg() {
  local leg=$1
  shift
  if [ "$leg" = 2.6 ]; then scripts/debian13.sh "$@"; else "$@"; fi
}

# Training steps/s of attnkit-train on a leg with the given extra flags: the final metrics
# line's tokens/s (evaluation excluded) over the tokens of one step.
cpp_steps_per_s() {
  local leg=$1
  shift
  local program=build/apps/attnkit-train
  [ "$leg" = 2.6 ] && program=build-libtorch2/apps/attnkit-train
  on_leg "$leg" "$program" --task "$task" --module mha --steps "$steps" --eval-every "$steps" \
    --threads "$threads" --quiet --metrics "$metrics" "$@" >/dev/null
  tail -1 "$metrics" | sed 's/.*"tokens_per_s": \([0-9.e+]*\).*/\1/' |
    awk -v t="$tokens_per_step" '{printf "%.1f", $1 / t}'
}

python_steps_per_s() {
  local leg=$1 interpreter=$python
  [ "$leg" = 2.6 ] && interpreter=python3
  on_leg "$leg" "$interpreter" scripts/train_reference.py --task "$task" --steps "$steps" \
    --threads "$threads" | sed 's/python: \([0-9.]*\) steps.*/\1/'
}

ratio() { awk -v c="$1" -v p="$2" 'BEGIN {printf "%.2f", c / p}'; }

echo "task $task, $steps steps, $threads thread(s); training steps/s"
# Interleaved, so that drifts of this machine's speed hit every column alike.
for round in 1 2 3; do
  for leg in "${legs[@]}"; do
    fused=$(cpp_steps_per_s "$leg")  # the default: --backend fused
    math=$(cpp_steps_per_s "$leg" --backend math)
    py=$(python_steps_per_s "$leg")
    echo "round $round, LibTorch $leg: C++ $fused steps/s (fused), $math (math), Python $py;" \
         "ratio $(ratio "$fused" "$py")x (fused), $(ratio "$math" "$py")x (math)"
  done
done
