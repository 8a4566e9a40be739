#!/usr/bin/env bash
# Batched generation of prompts of different lengths (issue 27's throughput targets): 8
# prompts of 4..64 tokens, 200 new tokens each, greedy, one thread, untrained weights (seed
# 123), generated in one batch and one after another by attnkit-decode-bench --batch-prompts,
# which also checks that each row's tokens are the same both ways. Two shapes:
#   text  attnkit-train's text model: vocab 256, context 64, d 64, 4 heads, 2 layers (its
#         rows run past the 64-token context, so each refills its caches every 32 tokens)
#   gpt2  vocab 50257, context 1024, d 768, 12 heads, 12 layers
# Then the cost of RoPE: GQA decoding (4 key/value groups) at the GPT-2-small shape, 100 new
# tokens after a 4-token prompt, with and without --rope (cached tokens/s, median of 3).
# Usage: scripts/bench_ragged.sh [--libtorch2] [--shape text|gpt2] [--repeats N]
#   --libtorch2  the same on Debian 13's LibTorch 2.6 (scripts/debian13.sh, build-libtorch2/)
set -euo pipefail
cd "$(dirname "$0")/.."
shapes="text gpt2"
libtorch2=false
repeats=""
while (($#)); do
  case "$1" in
    --libtorch2) libtorch2=true; shift ;;
    --shape) shapes=${2:?--shape needs text or gpt2}; shift 2 ;;
    --repeats) repeats=${2:?--repeats needs a number}; shift 2 ;;
    *) echo "unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
flags_of() {
  case "$1" in
    text) echo "--vocab 256 --context 64 --d-model 64 --heads 4 --layers 2 --repeats ${repeats:-5}" ;;
    gpt2) echo "--repeats ${repeats:-1}" ;;
    *) echo "unknown shape '$1'; expected text or gpt2" >&2; exit 2 ;;
  esac
}
if $libtorch2; then
  scripts/debian13.sh bash -c 'cmake --preset libtorch2 >/dev/null && cmake --build --preset libtorch2 --target attnkit-decode-bench >/dev/null'
  bench=(scripts/debian13.sh build-libtorch2/apps/attnkit-decode-bench)
else
  scripts/build.sh --target attnkit-decode-bench >/dev/null
  bench=(build/apps/attnkit-decode-bench)
fi
for shape in $shapes; do
  # shellcheck disable=SC2046
  "${bench[@]}" $(flags_of "$shape") --batch-prompts 8 --prompt-min 4 --prompt 64 \
    --new-tokens 200 --threads 1
done
for rope in "" --rope; do
  "${bench[@]}" --module gqa --kv-groups 4 --no-uncached --prompt 4 --new-tokens 100 \
    --repeats 3 --threads 1 $rope
done
