#!/usr/bin/env bash
# attnkit-bench and the same implementations in Python PyTorch (scripts/bench_reference.py,
# Debian's python3-torch: the same LibTorch), then the side-by-side table and ratios. The
# sides alternate implementation by implementation, so a slow minute on a shared machine hits
# every side of a ratio rather than one. Arguments (shape, --repeats, --threads, ...) go to all.
# Usage: scripts/bench_vs_python.sh [--libtorch2] [--only a,b] [--batch 8 --tokens 1024 ...]
#   --libtorch2  also attnkit built on Debian 13's LibTorch 2.6 and Python PyTorch 2.6 (with
#                `sdpa`: one QKV Linear, F.scaled_dot_product_attention, out_proj), run in the
#                Debian 13 root of scripts/debian13.sh (build-libtorch2/ is built there first).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
only=wrapper,mha,combined,einsum,fused,chunked,torch-mha,torch-mha-noweights,sdpa,math-core,chunked-core
cpp_has=" wrapper mha combined einsum fused chunked torch-mha torch-mha-noweights math-core chunked-core fused-core "
python_has=" wrapper mha combined einsum torch-mha torch-mha-noweights sdpa "
libtorch2=false
args=()
while (($#)); do
  case "$1" in
    --only) only=${2:?--only needs a comma-separated list}; shift 2 ;;
    --only=*) only=${1#--only=}; shift ;;
    --libtorch2) libtorch2=true; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
bench_setup "$libtorch2" bench-vs-python
files=()
for name in ${only//,/ }; do
  if [[ $cpp_has == *" $name "* ]]; then
    echo "-- C++, LibTorch 1.13: $name --"
    build/apps/attnkit-bench "${args[@]}" --only "$name" --json "$work/cpp1-$name.json"
    files+=("$work/cpp1-$name.json")
    if $libtorch2; then
      echo "-- C++, LibTorch 2.6: $name --"
      scripts/debian13.sh build-libtorch2/apps/attnkit-bench "${args[@]}" --only "$name" \
        --json "$work/cpp2-$name.json"
      files+=("$work/cpp2-$name.json")
    fi
  fi
  if [[ $python_has == *" $name "* ]]; then
    if [ "$name" != sdpa ]; then  # sdpa needs PyTorch >= 2.0
      echo "-- Python, PyTorch 1.13: $name --"
      "$python" scripts/bench_reference.py "${args[@]}" --only "$name" --json "$work/py1-$name.json"
      files+=("$work/py1-$name.json")
    fi
    if $libtorch2; then
      echo "-- Python, PyTorch 2.6: $name --"
      scripts/debian13.sh python3 scripts/bench_reference.py "${args[@]}" --only "$name" \
        --json "$work/py2-$name.json"
      files+=("$work/py2-$name.json")
    fi
  fi
done
echo "-- side by side --"
"$python" scripts/bench_reference.py --compare "${files[@]}"
