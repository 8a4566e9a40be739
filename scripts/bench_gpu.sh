#!/usr/bin/env bash
# attnkit's attention core on CUDA against PyTorch's compiled flex_attention (same block mask)
# and its SDPA with the dense mask, side by side in one run: issue 44's GPU targets.
#
#   scripts/bench_gpu.sh [--bench PATH] [--python PYTHON] [--repeats N] [--cases LIST]
#
# attnkit: attnkit-bench --device cuda --dtype bfloat16 --only fused-core (functional::attention
# with the fused backend demanded; the kernel the planner ran is printed) and, where listed,
# chunked-core and math-core. PyTorch: scripts/bench_gpu.py (flex_attention through torch.compile, its
# BlockMask made once; SDPA with the dense bool mask, or the dense float bias for ALiBi).
# Shapes: d 768, h 12 (head size 64), bfloat16. Medians of --repeats runs after 3 warm-ups.
# Cases (--cases, comma-separated; default all): documents (n 16,384 as 16 causal documents),
# padding (b 8, n 1,024, key lengths uniform in 128..1,024, not causal), padding-causal,
# alibi (b 2, n 1,024, causal), softcap (b 8, n 1,024, causal), window (n 16,384, causal,
# window 1,024), causal (b 8, n 1,024). Needs a CUDA build of attnkit and a Python whose torch
# has CUDA (2.5 or later for flex_attention).
set -euo pipefail
cd "$(dirname "$0")/.."

bench=build/apps/attnkit-bench
python=python3
repeats=10
cases=documents,padding,padding-causal,alibi,softcap,window,causal
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bench) bench=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --cases) cases=$2; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x $bench ]] || { echo "bench_gpu.sh: --bench: no program at '$bench'" >&2; exit 2; }
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
  echo "bench_gpu.sh: --python: '$python' has no torch that sees a CUDA device" >&2
  exit 2
fi

# case -> "shape flags|attnkit implementations|PyTorch implementations"
declare -A spec=(
  [documents]="--mask documents:16 --batch 1 --tokens 16384|fused-core,chunked-core|flex,sdpa"
  [padding]="--mask padded --causal=false --batch 8 --tokens 1024|fused-core,chunked-core|flex,sdpa"
  [padding-causal]="--mask padded --batch 8 --tokens 1024|fused-core|sdpa"
  [alibi]="--score alibi --batch 2 --tokens 1024|fused-core,chunked-core,math-core|flex,sdpa"
  [softcap]="--score softcap --batch 8 --tokens 1024|chunked-core,math-core|flex"
  [window]="--window 1024 --batch 1 --tokens 16384|fused-core,chunked-core|sdpa"
  [causal]="--batch 8 --tokens 1024|fused-core|sdpa"
)
common=(--d-model 768 --heads 12 --dtype bfloat16 --repeats "$repeats" --warmup 3)

json=$(mktemp)
trap 'rm -f "$json"' EXIT
# "name pass median_ms=... kernels=..." lines from attnkit-bench's JSON (its table rounds to
# 0.1 ms).
attnkit_rows() {
  "$python" -c 'import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print("%s %s median_ms=%.3f kernels=%s" % (r["name"], r["pass"], r["median_ms"], r["kernels"]))' "$json"
}

IFS=, read -r -a wanted <<<"$cases"
for case_name in "${wanted[@]}"; do
  [[ -n ${spec[$case_name]:-} ]] || { echo "bench_gpu.sh: unknown case '$case_name'" >&2; exit 2; }
  IFS='|' read -r shape ours theirs <<<"${spec[$case_name]}"
  read -r -a shape_flags <<<"$shape"
  echo "== $case_name: $shape"
  "$bench" --device cuda --only "$ours" "${shape_flags[@]}" "${common[@]}" --json "$json" \
    >/dev/null || { echo "bench_gpu.sh: attnkit-bench failed on case $case_name" >&2; exit 1; }
  attnkit_rows
  # bench_gpu.py takes the same mask flags (--mask module, --window, --score, --causal).
  py_flags=()
  for flag in "${shape_flags[@]}"; do py_flags+=("$flag"); done
  if [[ " ${shape_flags[*]} " != *" --mask "* ]]; then py_flags+=(--mask module); fi
  "$python" scripts/bench_gpu.py --only "$theirs" "${py_flags[@]}" --d-model 768 --heads 12 \
    --dtype bfloat16 --repeats "$repeats" --warmup 3 | sed 's/ min_ms=.*//'
done
