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
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import build  # noqa: E402

FORMAT_VERSION = 1
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden")
KV_DIR = os.path.join(OUT_DIR, "kv")


def config(d_in, d_out, context_length=0, dropout=0.0, num_heads=1, qkv_bias=False, causal=True):
    return dict(d_in=d_in, d_out=d_out, context_length=context_length, dropout=dropout,
                num_heads=num_heads, qkv_bias=qkv_bias, causal=causal)


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


def main():
    cases, kv_cases = [], []
    seed, kv_seed = 0, 100  # the seed is also the case's number
    for dtype in (torch.float32, torch.float64):
        dtype_name = str(dtype).replace("torch.", "")
        for module_name, cfg, batch, num_tokens in grid():
            case, state = make_case(seed, module_name, cfg, batch, num_tokens, dtype)
            cases.append((f"{seed:02d}_{module_name}_{dtype_name}", case, state))
            seed += 1
        for module_name, cfg, batch, splits in kv_grid():
            case, state = make_kv_case(kv_seed, module_name, cfg, batch, splits, dtype)
            kv_cases.append((f"{kv_seed}_{module_name}_{dtype_name}", case, state))
            kv_seed += 1
    write_cases(OUT_DIR, cases)
    write_cases(KV_DIR, kv_cases)


if __name__ == "__main__":
    main()
