#!/usr/bin/env bash
# attnkit-bench and the same implementations in Python PyTorch (scripts/bench_reference.py,
# Debian's python3-torch: the same LibTorch), one after the other in one run, then the
# side-by-side ratios. Arguments (shape, --repeats, --threads, ...) go to both.
# Usage: scripts/bench_vs_python.sh [--batch 8 --tokens 1024 --d-model 768 --heads 12 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
scripts/build.sh --target attnkit-bench >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build/apps/attnkit-bench "$@" --json "$work/cpp.json"
echo "-- Python --"
"$python" scripts/bench_reference.py "$@" --json "$work/py.json"
echo "-- side by side --"
"$python" scripts/bench_reference.py --compare "$work/cpp.json" "$work/py.json"
