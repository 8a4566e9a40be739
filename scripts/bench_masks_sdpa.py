#!/usr/bin/env python3
"""PyTorch's F.scaled_dot_product_attention with a dense bool mask, forward+backward: the
baseline of issue 26's mask targets (scripts/bench_masks.sh), in the shapes attnkit-bench's
core implementations use (x (b, n, d) viewed as (b, h, n, hd) for query, key and value).

    python3 scripts/bench_masks_sdpa.py --mask documents:16 --batch 1 --tokens 16384 --threads 1

--mask is documents:K (K causal documents of n / K tokens per row) or padded (key padding,
lengths uniform in [min(128, n), n]; causal with --causal). Prints one line:
`sdpa <mask> forward+backward median_ms=... min_ms=... runs=...`.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def allowed_mask(kind, batch, n, causal):
    """(b, 1, n, n) bool, True = may attend (SDPA's convention)."""
    q = torch.arange(n).view(1, 1, n, 1)
    kv = torch.arange(n).view(1, 1, 1, n)
    if kind.startswith("documents:"):
        size = n // int(kind.split(":")[1])
        return ((q // size) == (kv // size)) & (kv <= q)
    if kind == "padded":
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(min(128, n), n + 1, (batch,), generator=generator)
        mask = kv < lengths.view(batch, 1, 1, 1)
        return mask & (kv <= q) if causal else mask.expand(batch, 1, n, n)
    raise SystemExit(f"--mask: expected documents:K or padded, got {kind!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--causal", default="true", choices=["true", "false"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    args = parser.parse_args()
    if not hasattr(F, "scaled_dot_product_attention"):
        print(f"sdpa: not in torch {torch.__version__}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, n, h = args.batch, args.tokens, args.heads
    mask = allowed_mask(args.mask, b, n, args.causal == "true")
    x = torch.randn(b, n, args.d_model, requires_grad=True)
    times = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        heads = x.view(b, n, h, -1).transpose(1, 2)  # (b, n, d) -> (b, h, n, hd)
        F.scaled_dot_product_attention(heads, heads, heads, attn_mask=mask).sum().backward()
        x.grad = None
        if i >= args.warmup:
            times.append(1000 * (time.perf_counter() - start))
    print(f"sdpa {args.mask} forward+backward median_ms={statistics.median(times):.1f} "
          f"min_ms={min(times):.1f} runs={len(times)} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
