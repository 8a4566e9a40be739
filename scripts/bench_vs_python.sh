#!/usr/bin/env bash
# attnkit-bench and the same implementations in Python PyTorch (scripts/bench_reference.py,
# Debian's python3-torch: the same LibTorch), then the side-by-side ratios. The two sides
# alternate implementation by implementation, so a slow minute on a shared machine hits
# both sides of a ratio rather than one. Arguments (shape, --repeats, --threads, --only,
# ...) go to both.
# Usage: scripts/bench_vs_python.sh [--batch 8 --tokens 1024 --d-model 768 --heads 12 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
only=wrapper,mha,combined,einsum,fused,chunked,torch-mha,torch-mha-noweights,math-core,chunked-core
python_has=" wrapper mha combined einsum torch-mha torch-mha-noweights "
args=()
while (($#)); do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
scripts/build.sh --target attnkit-bench >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpp_files=() py_files=()
for name in ${only//,/ }; do
  build/apps/attnkit-bench "${args[@]}" --only "$name" --json "$work/cpp-$name.json"
  cpp_files+=("$work/cpp-$name.json")
  if [[ $python_has == *" $name "* ]]; then
    echo "-- Python: $name --"
    "$python" scripts/bench_reference.py "${args[@]}" --only "$name" --json "$work/py-$name.json"
    py_files+=("$work/py-$name.json")
  fi
done
echo "-- side by side --"
join() { local IFS=,; echo "$*"; }
"$python" scripts/bench_reference.py --compare "$(join "${cpp_files[@]}")" "$(join "${py_files[@]}")"
