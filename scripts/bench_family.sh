#!/usr/bin/env bash
# The attention family's targets, measured on this machine's LibTorch (one run; medians):
#   cache   KV-cache bytes per token and decode tokens/s at the GPT-2-small shape (vocab 50257,
#           context 1024, d 768, 12 heads, 12 layers; 4-token prompt, 200 new, cached, greedy,
#           1 thread) for mha, gqa with 4 groups, mqa and mla with latent 96.
#   rolling a sliding-window cache (W 256) over 4096 generated tokens (d 768, 12 heads, 2
#           layers, vocab 256, context 4100), traced step by step, against the full cache.
#   window  chunked forward+backward at 16,384 tokens (b 1, d 768, 12 heads), core alone and
#           the whole module (projections included), sliding window
#           1024 against full causal attention.
# Usage: scripts/bench_family.sh [cache] [rolling] [window]   (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
parts=${*:-cache rolling window}
scripts/build.sh --target attnkit-decode-bench --target attnkit-bench >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
decode=build/apps/attnkit-decode-bench
for part in $parts; do
  case "$part" in
    cache)
      # Interleaved, so that both of a pair see the same machine load.
      for round in 1 2; do
        for module in "mha" "gqa --kv-groups 4" "mqa" "mla --latent-dim 96"; do
          echo "== cache, round $round: $module =="
          read -ra flags <<<"$module"
          "$decode" --module "${flags[@]}" --prompt 4 --new-tokens 200 --repeats 3 --threads 1 \
            --no-uncached --json "$work/${flags[0]}-$round.json"
        done
      done
      /usr/bin/env python3 - "$work" <<'EOF'
import json, os, sys
work = sys.argv[1]
print("| module | KV-cache bytes per token per layer | / mha | cached tokens/s (round 1 / 2) | / mha |")
print("|---|---|---|---|---|")
runs = {m: [json.load(open(os.path.join(work, f"{m}-{r}.json"))) for r in (1, 2)]
        for m in ("mha", "gqa", "mqa", "mla")}
base = runs["mha"]
for m, (a, b) in runs.items():
    size = a["cache_bytes_per_token_per_layer"]
    print(f"| {m} | {size} | 1/{base[0]['cache_bytes_per_token_per_layer'] / size:.0f} "
          f"| {a['cached_tokens_per_s']:.1f} / {b['cached_tokens_per_s']:.1f} "
          f"| {a['cached_tokens_per_s'] / base[0]['cached_tokens_per_s']:.2f}x / "
          f"{b['cached_tokens_per_s'] / base[1]['cached_tokens_per_s']:.2f}x |")
EOF
      ;;
    rolling)
      for window in 256 0; do
        echo "== rolling: window $window (0 = full cache) =="
        "$decode" --module mha --window "$window" --vocab 256 --context 4100 --layers 2 \
          --prompt 4 --new-tokens 4096 --repeats 1 --threads 1 --no-uncached --trace-cache
      done
      ;;
    window)
      for window in 1024 0; do
        echo "== window: chunked at 16384 tokens, window $window (0 = full causal) =="
        build/apps/attnkit-bench --batch 1 --tokens 16384 --only chunked-core,chunked --window "$window" \
          --repeats 3 --warmup 1
      done
      ;;
    *) echo "unknown part '$part'; expected cache, rolling or window" >&2; exit 2 ;;
  esac
done
