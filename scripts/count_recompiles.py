#!/usr/bin/env python3
"""Graphs torch.compile makes for a small attention whose block mask (a sliding window) is made inside the
compiled function, one length after another: attnkit.flex_attention (forward and backward)
beside PyTorch's flex_attention (forward: PyTorch 2.15 has no CPU backward), with Inductor
(docs/python.md, "torch.compile"). Checks each first call of a length against
scaled_dot_product_attention, and prints Dynamo's frame count (graphs compiled) for
dynamic=None (PyTorch's default: a second length makes the shapes dynamic) and dynamic=True.

  PYTHONPATH=build-pip/python "$(scripts/pip_torch.sh)" scripts/count_recompiles.py
"""

import argparse
import os
import sys

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inductor_link import link_inductor_against_this_torch  # noqa: E402

import attnkit  # noqa: E402


def sliding_window(b, h, q_idx, kv_idx):
    # causal, the last 40 keys: partial tiles whose bits the kernels read
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def count(flex, make_block_mask, lengths, dynamic, backward):
    """(graphs compiled, the largest error of the output, of the query's gradient)."""
    torch._dynamo.reset()

    def attend(q):
        n = q.shape[2]
        block_mask = make_block_mask(sliding_window, None, None, n, n, device="cpu", BLOCK_SIZE=32)
        return flex(q, q, q, block_mask=block_mask)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=counter, dynamic=dynamic, fullgraph=True)
    out_error = grad_error = 0.0
    for n in lengths:
        q = torch.randn(1, 4, n, 32, requires_grad=backward)
        out = compiled(q)
        q_ref = q.detach().clone().requires_grad_(backward)
        positions = torch.arange(n)
        allowed = sliding_window(0, 0, positions.view(-1, 1), positions.view(1, -1))
        ref = torch.nn.functional.scaled_dot_product_attention(q_ref, q_ref, q_ref,
                                                               attn_mask=allowed)
        out_error = max(out_error, (out - ref).abs().max().item())
        if backward:
            (grad,) = torch.autograd.grad(out.square().sum(), q)
            (grad_ref,) = torch.autograd.grad(ref.square().sum(), q_ref)
            grad_error = max(grad_error, (grad - grad_ref).abs().max().item())
    return counter.frame_count, out_error, grad_error


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 96, 128, 192, 256])
    args = parser.parse_args()
    link_inductor_against_this_torch()
    print(f"PyTorch {torch.__version__}, lengths {args.lengths}, a sliding-window mask (40) made inside, "
          "Inductor, fullgraph=True")
    for dynamic in (None, True):
        for name, flex, make, backward in (
                ("attnkit", attnkit.flex_attention, attnkit.create_block_mask, True),
                ("attnkit, mask by PyTorch", attnkit.flex_attention, torch_create_block_mask,
                 True),
                ("PyTorch", torch_flex_attention, torch_create_block_mask, False)):
            graphs, out_error, grad_error = count(flex, make, args.lengths, dynamic, backward)
            print(f"dynamic={dynamic!s:5} {name:25} graphs {graphs:2}  max |out - sdpa| "
                  f"{out_error:.2e}" + (f"  max |grad - sdpa's| {grad_error:.2e}"
                                        if backward else "  (no CPU backward)"), flush=True)


if __name__ == "__main__":
    main()
