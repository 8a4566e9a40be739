#!/usr/bin/env python3
"""Writes data/golden/: reference inputs, outputs and gradients of the chapter-3 classes.

Run from anywhere with Debian's python3-torch (same LibTorch as the C++ build):
    python3 scripts/make_golden.py
For every case of the grid below it writes two files:
  <case>.pt        dict: meta (format version, torch version, module, config), input,
                   output, loss_weights, grads (input and every parameter) of the scalar
                   loss sum(output * loss_weights)
  <case>.state.pt  the module's state dict, exactly as torch.save(dict(model.state_dict()))
and MANIFEST lists the cases. The C++ tests (tests/golden_test.cpp) read them all.

data/golden/kv/ holds the KV-cache cases (the multi-head classes run with use_cache=True,
the sequence fed in pieces: prefill, chunked prefill, one-token decode steps):
  <case>.pt        dict: meta, input (b, n, d_in), splits (int64 tensor of the piece lengths),
                   output (the cached pieces' outputs, concatenated), uncached_output
  <case>.state.pt  the state dict, as above
with its own MANIFEST; tests/kv_cache_test.cpp reads them.

data/golden/family/ holds the same two kinds for the attention family (GroupedQueryAttention,
multi-query, sliding windows on the multi-head classes, MultiHeadLatentAttention): golden
cases in family/ and cached ones in family/kv/, each directory with its MANIFEST. The older
directories are written only with --all, so adding a family case leaves their files alone.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import build  # noqa: E402

FORMAT_VERSION = 1
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden")
KV_DIR = os.path.join(OUT_DIR, "kv")
FAMILY_DIR = os.path.join(OUT_DIR, "family")
FAMILY_KV_DIR = os.path.join(FAMILY_DIR, "kv")


def config(d_in, d_out, context_length=0, dropout=0.0, num_heads=1, qkv_bias=False, causal=True,
           **family):
    """The chapter-3 arguments; family modules add num_kv_groups, sliding_window_size and
    latent_dim (None: the module's default)."""
    return dict(d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
                num_heads=num_heads, qkv_bias=qkv_bias, causal=causal, **family)


def gqa(d_in, d_out, num_heads, num_kv_groups, window=None, **rest):
    return config(d_in, d_out, num_heads=num_heads, num_kv_groups=num_kv_groups,
                  sliding_window_size=window, **rest)


def mla(d_in, d_out, num_heads, latent_dim=None, **rest):
    return config(d_in, d_out, num_heads=num_heads, latent_dim=latent_dim, **rest)


def grid():
    """(module, config, batch or None for an unbatched (n, d_in) input, num_tokens)."""
    yield "SelfAttentionV1", config(3, 2), None, 6
    yield "SelfAttentionV1", config(4, 4), 2, 1
    yield "SelfAttentionV2", config(3, 2), None, 6
    yield "SelfAttentionV2", config(5, 3, qkv_bias=True), 3, 4
    yield "CausalAttention", config(3, 2, context_length=6), 2, 6
    yield "CausalAttention", config(4, 4, context_length=8, qkv_bias=True), 1, 1
    yield "CausalAttention", config(6, 3, context_length=8, dropout=0.1, qkv_bias=True), 4, 5
    yield "MultiHeadAttentionWrapper", config(3, 2, context_length=6), 2, 6
    yield "MultiHeadAttentionWrapper", config(4, 3, context_length=7, num_heads=3, qkv_bias=True), 3, 7
    for module in ("MultiHeadAttention", "MultiHeadAttentionCombinedQKV"):
        yield module, config(3, 2, context_length=6, num_heads=2), 2, 6
        yield module, config(12, 12, context_length=10, num_heads=12, qkv_bias=True), 1, 1
        yield module, config(8, 12, context_length=10, dropout=0.1, num_heads=3, qkv_bias=True,
                             causal=False), 4, 7
        yield module, config(16, 16, context_length=9, num_heads=4, causal=False), 3, 9
        yield module, config(6, 8, context_length=5, num_heads=1, qkv_bias=True), 2, 3


def kv_grid():
    """(module, config, batch, splits): causal modules fed in pieces of these lengths."""
    for module in ("MultiHeadAttention", "MultiHeadAttentionCombinedQKV"):
        yield module, config(6, 8, context_length=12, num_heads=2, qkv_bias=True), 2, [5, 1, 1, 3, 1]
        yield module, config(4, 12, context_length=8, num_heads=3), 1, [1] * 8
        yield module, config(6, 8, context_length=12, num_heads=4), 3, [7, 1, 2]
        yield module, config(3, 2, context_length=6, num_heads=2), 2, [6]


def family_grid():
    """As grid(), for the attention family; windows smaller and larger than n, n = 1."""
    yield "GroupedQueryAttention", gqa(6, 8, 4, 2), 2, 7
    yield "GroupedQueryAttention", gqa(8, 12, 3, 1, qkv_bias=True), 3, 5  # multi-query
    yield "GroupedQueryAttention", gqa(6, 8, 4, 2, window=3, qkv_bias=True), 2, 9
    yield "GroupedQueryAttention", gqa(4, 8, 2, 2, dropout=0.1), 1, 1
    yield "GroupedQueryAttention", gqa(6, 12, 6, 3, window=16), 2, 6
    yield "MultiHeadAttention", config(6, 8, context_length=10, num_heads=2, qkv_bias=True,
                                       sliding_window_size=2), 2, 8
    yield "MultiHeadAttentionCombinedQKV", config(12, 12, context_length=9, num_heads=3,
                                                  sliding_window_size=4), 1, 9
    yield "MultiHeadLatentAttention", mla(8, 12, 3, latent_dim=5, qkv_bias=True), 2, 6
    yield "MultiHeadLatentAttention", mla(16, 32, 4, dropout=0.1), 1, 5  # default latent 16


def family_kv_grid():
    """As kv_grid(), for the attention family; windowed caches roll past their window."""
    yield "GroupedQueryAttention", gqa(6, 8, 4, 2, qkv_bias=True), 2, [5, 1, 1, 3, 1]
    yield "GroupedQueryAttention", gqa(4, 12, 3, 1), 1, [1] * 6
    yield "GroupedQueryAttention", gqa(6, 8, 4, 2, window=3), 2, [4, 1, 1, 1, 3, 1]
    yield "MultiHeadAttention", config(6, 8, context_length=12, num_heads=2,
                                       sliding_window_size=2), 2, [3, 1, 1, 1, 2]
    yield "MultiHeadAttentionCombinedQKV", config(6, 6, context_length=8, num_heads=3,
                                                  sliding_window_size=3), 1, [1] * 7
    yield "MultiHeadLatentAttention", mla(6, 8, 2, latent_dim=5, qkv_bias=True), 2, [5, 1, 2, 1]


def make_kv_case(seed, module_name, cfg, batch, splits, dtype):
    torch.manual_seed(seed)
    model = build(module_name, cfg).to(dtype)
    model.eval()
    x = torch.randn(batch, sum(splits), cfg["d_in"], dtype=dtype)
    with torch.no_grad():
        uncached = model(x)
        model.reset_cache()
        pieces, start = [], 0
        for length in splits:
            pieces.append(model(x[:, start:start + length], use_cache=True))
            start += length
    meta = {
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "module": module_name,
        "config": cfg,
        "dtype": str(dtype).replace("torch.", ""),
        "seed": seed,
    }
    # splits as a tensor: LibTorch's unpickler cannot read a one-element list (APPEND)
    case = {"meta": meta, "input": x, "splits": torch.tensor(splits),
            "output": torch.cat(pieces, dim=1), "uncached_output": uncached}
    return case, dict(model.state_dict())


def write_cases(directory, cases):
    """cases: (name, case dict, state dict); writes them and the MANIFEST."""
    os.makedirs(directory, exist_ok=True)
    for name, case, state in cases:
        torch.save(case, os.path.join(directory, name + ".pt"))
        torch.save(state, os.path.join(directory, name + ".state.pt"))
    with open(os.path.join(directory, "MANIFEST"), "w") as manifest:
        manifest.write(f"# attnkit golden cases, format {FORMAT_VERSION}, torch {torch.__version__}; "
                       "regenerate with: python3 scripts/make_golden.py\n")
        manifest.write("\n".join(name for name, _, _ in cases) + "\n")
    print(f"wrote {len(cases)} cases to {os.path.relpath(directory)}")


def make_case(seed, module_name, cfg, batch, num_tokens, dtype):
    torch.manual_seed(seed)
    model = build(module_name, cfg).to(dtype)
    model.eval()
    shape = (num_tokens, cfg["d_in"]) if batch is None else (batch, num_tokens, cfg["d_in"])
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    output = model(x)
    loss_weights = torch.randn_like(output)
    (output * loss_weights).sum().backward()
    grads = {"input": x.grad}
    grads.update({name: p.grad for name, p in model.named_parameters()})
    meta = {
        "format_version": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "module": module_name,
        "config": cfg,
        "dtype": str(dtype).replace("torch.", ""),
        "batched": batch is not None,
        "seed": seed,
    }
    case = {"meta": meta, "input": x.detach(), "output": output.detach(),
            "loss_weights": loss_weights, "grads": grads}
    return case, dict(model.state_dict())


def make_cases(grid_of, make, first_seed, width):
    """Every case of grid_of() in float32 and float64: (name, case, state); the seed is also
    the case's number."""
    cases, seed = [], first_seed
    for dtype in (torch.float32, torch.float64):
        dtype_name = str(dtype).replace("torch.", "")
        for module_name, cfg, batch, shape in grid_of():
            case, state = make(seed, module_name, cfg, batch, shape, dtype)
            cases.append((f"{seed:0{width}d}_{module_name}_{dtype_name}", case, state))
            seed += 1
    return cases


def main():
    parser = argparse.ArgumentParser(description="Writes attnkit's golden files (data/golden/).")
    parser.add_argument("--all", action="store_true",
                        help="also rewrite the chapter-3 and KV-cache cases (default: family only)")
    args = parser.parse_args()
    if args.all:
        write_cases(OUT_DIR, make_cases(grid, make_case, 0, 2))
        write_cases(KV_DIR, make_cases(kv_grid, make_kv_case, 100, 3))
    write_cases(FAMILY_DIR, make_cases(family_grid, make_case, 200, 3))
    write_cases(FAMILY_KV_DIR, make_cases(family_kv_grid, make_kv_case, 300, 3))


if __name__ == "__main__":
    main()
