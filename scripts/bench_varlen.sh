#!/usr/bin/env bash
# The variable-length route (kernel sdpa_varlen, LibTorch 2.x) on the CPU, against the
# chunked kernel on the same mask and against SDPA with the mask made dense (sdpa_masked), in
# one run on LibTorch 2.6 (the Debian 13 root): attnkit-bench's core implementations (x viewed
# as (b, 12 heads, n, 64)), forward and forward+backward medians, --turns alternating turns.
#   documents: b 1, n --tokens as 16 causal documents;
#   padded: b 8, n 1,024, key padding with lengths uniform in 128..1,024, causal and not.
# fused-core demands kFused, which runs sdpa_varlen on a mask of segments and sdpa_masked on
# the same mask given as a bool tensor (KIND-dense).
# Usage: scripts/bench_varlen.sh [--tokens 4096] [--threads 2] [--turns 3]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
tokens=4096
threads=2
turns=3
while (($#)); do
  case "$1" in
    --tokens) tokens=${2:?--tokens needs a number}; shift 2 ;;
    --threads) threads=${2:?--threads needs a number}; shift 2 ;;
    --turns) turns=${2:?--turns needs a number}; shift 2 ;;
    *) echo "bench_varlen: unknown argument $1" >&2; exit 2 ;;
  esac
done
bench_setup true bench-varlen
bench() {
  scripts/debian13.sh build-libtorch2/apps/attnkit-bench --threads "$threads" --repeats 3 \
    --d-model 768 --heads 12 "$@" | grep -E "^(chunked|fused)-core"
}
for turn in $(seq "$turns"); do
  echo "== turn $turn: documents, b 1, n $tokens as 16 documents (sdpa_varlen, chunked; sdpa_masked) =="
  bench --only fused-core,chunked-core --batch 1 --tokens "$tokens" --mask documents:16
  bench --only fused-core --batch 1 --tokens "$tokens" --mask documents:16-dense
  for causal in true false; do
    echo "== turn $turn: padded, b 8, n 1,024, causal $causal (sdpa_varlen, chunked; sdpa_masked) =="
    bench --only fused-core,chunked-core --batch 8 --tokens 1024 --causal="$causal" --mask padded
    bench --only fused-core --batch 8 --tokens 1024 --causal="$causal" --mask padded-dense
  done
done
