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
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import build  # noqa: E402

FORMAT_VERSION = 1
OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "golden")


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
    os.makedirs(OUT_DIR, exist_ok=True)
    names = []
    seed = 0
    for dtype in (torch.float32, torch.float64):
        for module_name, cfg, batch, num_tokens in grid():
            name = f"{seed:02d}_{module_name}_{str(dtype).replace('torch.', '')}"
            case, state = make_case(seed, module_name, cfg, batch, num_tokens, dtype)
            torch.save(case, os.path.join(OUT_DIR, name + ".pt"))
            torch.save(state, os.path.join(OUT_DIR, name + ".state.pt"))
            names.append(name)
            seed += 1
    with open(os.path.join(OUT_DIR, "MANIFEST"), "w") as manifest:
        manifest.write(f"# attnkit golden cases, format {FORMAT_VERSION}, torch {torch.__version__}; "
                       "regenerate with: python3 scripts/make_golden.py\n")
        manifest.write("\n".join(names) + "\n")
    print(f"wrote {len(names)} cases to data/golden/")


if __name__ == "__main__":
    main()
