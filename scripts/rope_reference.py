#!/usr/bin/env python3
"""Float64 reference of rotary position embeddings (RoPE), and its golden file.

    python3 scripts/rope_reference.py --write    # data/golden/rope/reference.pt
    python3 scripts/rope_reference.py --check    # run by the C++ suite on each LibTorch leg

Written from the definitions, not from attnkit's code: each frequency is computed with
Python floats (Llama 3.1's smoothing by explicit cases), and a head's pairs are rotated as
complex numbers, z * exp(i * position * inv_freq). Split-half pairs element i with i + d/2
(the book's Llama code); interleaved pairs 2i with 2i + 1 (GPT-J, Meta's Llama).

The golden file is one dict of tensors:
  inputs/{x,w,offsets}                       x (3, 2, 7, 16); per-row offsets (3)
  tables/<freq>/{cos,sin}                    (32, 16): [angles, angles] as the book stores them
  case/<layout>/<freq>/<offset>/{out,dx}     out and d sum(out * w) / dx
with layout split_half | interleaved, freq none | llama31 (factor 4, low 1, high 4,
original_context_length 16, so all three kinds of wavelength occur at head_dim 16), offset
scalar (3) | rows. tests/rope_test.cpp rebuilds every case with attnkit in float64 (1e-10)
and float32 (1e-5). --check recomputes everything and compares with the file (1e-12).
"""
import math
import os
import sys

import torch

import golden_file

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "data", "golden", "rope", "reference.pt")
HEAD_DIM, CONTEXT, THETA = 16, 32, 10000.0
SCALAR_OFFSET = 3
LLAMA31 = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context_length=16)


def inverse_frequencies(freq, head_dim=HEAD_DIM, theta=THETA):
    """inv_freq[i] = theta^(-2i / d), then Llama 3.1's smoothing when freq is given."""
    result = []
    for i in range(head_dim // 2):
        f = theta ** (-(2.0 * i) / head_dim)
        if freq is not None:
            wavelength = 2.0 * math.pi / f
            long_limit = freq["original_context_length"] / freq["low_freq_factor"]
            short_limit = freq["original_context_length"] / freq["high_freq_factor"]
            if wavelength > long_limit:  # long waves: slowed by factor
                f = f / freq["factor"]
            elif wavelength >= short_limit:  # between: blended
                t = ((freq["original_context_length"] / wavelength - freq["low_freq_factor"])
                     / (freq["high_freq_factor"] - freq["low_freq_factor"]))
                f = (1.0 - t) * f / freq["factor"] + t * f
        result.append(f)
    return torch.tensor(result, dtype=torch.float64)


def angles(freq, positions, head_dim=HEAD_DIM, theta=THETA):
    """positions (..., n) -> angles (..., n, d/2)."""
    return positions.to(torch.float64).unsqueeze(-1) * inverse_frequencies(freq, head_dim, theta)


def rope(x, freq, positions, layout):
    """x (b, h, n, d) at positions (b, n) -> rotated x, by complex multiplication."""
    b, h, n, d = x.shape
    if layout == "split_half":
        real, imag = x[..., : d // 2], x[..., d // 2:]
    else:
        real, imag = x[..., 0::2], x[..., 1::2]
    z = torch.complex(real, imag)
    theta = angles(freq, positions).unsqueeze(1)  # (b, 1, n, d/2)
    turned = z * torch.polar(torch.ones_like(theta), theta)
    if layout == "split_half":
        return torch.cat([turned.real, turned.imag], dim=-1)
    return torch.stack([turned.real, turned.imag], dim=-1).reshape(b, h, n, d)


def everything():
    gen = torch.Generator().manual_seed(27)
    x = torch.randn(3, 2, 7, HEAD_DIM, generator=gen, dtype=torch.float64)
    w = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    offsets = torch.tensor([0, 5, 2], dtype=torch.int64)
    golden = {"inputs/x": x, "inputs/w": w, "inputs/offsets": offsets}
    n = x.shape[2]
    for freq_name, freq in (("none", None), ("llama31", LLAMA31)):
        table = angles(freq, torch.arange(CONTEXT))
        both = torch.cat([table, table], dim=-1)
        golden[f"tables/{freq_name}/cos"] = torch.cos(both)
        golden[f"tables/{freq_name}/sin"] = torch.sin(both)
        for layout in ("split_half", "interleaved"):
            for offset_name, first in (("scalar", torch.full((3,), SCALAR_OFFSET)),
                                       ("rows", offsets)):
                positions = first.unsqueeze(1) + torch.arange(n)  # (b, n)
                xs = x.clone().requires_grad_(True)
                out = rope(xs, freq, positions, layout)
                (out * w).sum().backward()
                key = f"case/{layout}/{freq_name}/{offset_name}"
                golden[f"{key}/out"] = out.detach()
                golden[f"{key}/dx"] = xs.grad
    return golden


def main():
    def cases(golden):
        count = sum(1 for k in golden if k.startswith("case/") and k.endswith("/out"))
        return f"{count} cases"
    return golden_file.run(__doc__.splitlines()[0], GOLDEN, everything, cases)


if __name__ == "__main__":
    sys.exit(main())
