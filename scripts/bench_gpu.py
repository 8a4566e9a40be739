#!/usr/bin/env python3
"""PyTorch's side of scripts/bench_gpu.sh: compiled flex_attention with a block mask, and
F.scaled_dot_product_attention with the dense mask (and, for ALiBi, the dense float bias),
forward and forward+backward, in the shapes of attnkit-bench's core implementations (x (b, n,
d) viewed as (b, h, n, hd) for query, key and value) and with its masks:

    documents:K  K causal documents of n / K tokens per row
    padded       key padding, lengths uniform in [min(128, n), n] (torch's CPU generator,
                 seed 0, as attnkit-bench draws them); causal with --causal
    module       causal (--causal), with --window W a sliding window of W keys

--score none | alibi (the paper's slopes, slope * (kv - q)) | softcap (30 tanh(s / 30)).
Prints one line per implementation and pass:
`<impl> <pass> median_ms=... min_ms=... runs=...`, impl flex or sdpa.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def mask_mod_and_dense(args, device):
    """(mask_mod or None, dense bool (b, 1, n, n) or None), True = may attend."""
    b, n = args.batch, args.tokens
    causal = args.causal == "true"
    if args.mask.startswith("documents:"):
        size = n // int(args.mask.split(":")[1])
        ids = torch.arange(n, device=device) // size

        def mask_mod(b_, h_, q, kv):
            return (ids[q] == ids[kv]) & (kv <= q)
    elif args.mask == "padded":
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(min(128, n), n + 1, (b,), generator=generator).to(device)

        def mask_mod(b_, h_, q, kv):
            return (kv < lengths[b_]) & (kv <= q) if causal else kv < lengths[b_]
    elif args.mask == "module":
        if not causal:
            return None, None
        window = args.window

        def mask_mod(b_, h_, q, kv):
            return (kv <= q) & (q - kv < window) if window > 0 else kv <= q
    else:
        raise SystemExit(f"--mask: expected documents:K, padded or module, got {args.mask!r}")
    q = torch.arange(n, device=device).view(1, 1, n, 1)
    kv = torch.arange(n, device=device).view(1, 1, 1, n)
    batch = torch.arange(b, device=device).view(b, 1, 1, 1)
    return mask_mod, mask_mod(batch, 0, q, kv).expand(b, 1, n, n)


def score_mod_and_bias(args, device):
    """(score_mod or None, dense float bias (1, h, n, n) or None)."""
    h, n = args.heads, args.tokens
    if args.score == "none":
        return None, None
    if args.score == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)], device=device)

        def score_mod(score, b_, head, q, kv):
            return score + slopes[head] * (kv - q)
        q = torch.arange(n, device=device).view(1, 1, n, 1)
        kv = torch.arange(n, device=device).view(1, 1, 1, n)
        return score_mod, slopes.view(1, h, 1, 1) * (kv - q)
    if args.score == "softcap":
        def score_mod(score, b_, head, q, kv):
            return 30.0 * torch.tanh(score / 30.0)
        return score_mod, None
    raise SystemExit(f"--score: expected none, alibi or softcap, got {args.score!r}")


def timed(run, args, device):
    for _ in range(args.warmup):
        run()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask", default="module")
    parser.add_argument("--score", default="none")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--causal", default="true", choices=["true", "false"])
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", default="flex,sdpa", help="comma-separated: flex, sdpa")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    b, n, h = args.batch, args.tokens, args.heads
    torch.manual_seed(0)
    mask_mod, dense = mask_mod_and_dense(args, device)
    score_mod, bias = score_mod_and_bias(args, device)
    x = torch.randn(b, n, args.d_model, device=device, dtype=dtype)

    def heads_of(x):
        return x.view(b, n, h, -1).transpose(1, 2)  # (b, n, d) -> (b, h, n, hd)

    impls = {}
    if "flex" in args.only.split(","):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention)
        # Judged once, as a training step reads one block mask in every layer.
        block_mask = (create_block_mask(mask_mod, b, None, n, n, device=device)
                      if mask_mod is not None else None)
        impls["flex"] = lambda t: flex(t, t, t, score_mod=score_mod, block_mask=block_mask)
    if "sdpa" in args.only.split(","):
        attn_mask = dense
        if bias is not None:
            minus_inf = torch.tensor(float("-inf"), device=device, dtype=dtype)
            attn_mask = bias.to(dtype) if dense is None else torch.where(dense, bias.to(dtype),
                                                                         minus_inf)
        if score_mod is not None and bias is None:
            print("sdpa: has no softcap", file=sys.stderr)
        else:
            impls["sdpa"] = lambda t: F.scaled_dot_product_attention(t, t, t, attn_mask=attn_mask)
    for name, attend in impls.items():
        for backward in (False, True):
            leaf = x.detach().requires_grad_(backward)

            def run():
                if backward:
                    leaf.grad = None
                    attend(heads_of(leaf)).sum().backward()
                else:
                    with torch.no_grad():
                        attend(heads_of(leaf))
            times = timed(run, args, device)
            label = "forward+backward" if backward else "forward"
            print(f"{name} {label} median_ms={statistics.median(times):.3f} "
                  f"min_ms={min(times):.3f} runs={len(times)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
