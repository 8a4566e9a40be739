#!/usr/bin/env python3
"""attnkit's safetensors files against the `safetensors` package (the pip leg's Python).

    check_safetensors.py --read OURS.safetensors --expect OURS.pt
        the package's load_file and safe_open read attnkit's file: the same names, dtypes,
        shapes and values as the torch.save file beside it, and the metadata key=value pairs
        given with --metadata
    check_safetensors.py --write THEIRS.safetensors --reference THEIRS.pt
        the package writes a dict in every dtype that attnkit reads (shapes 0-d, empty, odd
        sizes that misalign the next tensor) plus metadata; the same dict via torch.save beside
        it, for the C++ side to compare with
Exits 1 with a message naming the key on any difference.
"""
import argparse
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def fail(message):
    print(f"check_safetensors: {message}", file=sys.stderr)
    sys.exit(1)


def read(path, expected_path, metadata):
    ours = load_file(path)
    expected = torch.load(expected_path, weights_only=True)
    if list(ours) != list(expected) and sorted(ours) != sorted(expected):
        fail(f"names differ: {sorted(ours)} vs {sorted(expected)}")
    for key, tensor in expected.items():
        got = ours[key]
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(got, tensor):
            fail(f"{key}: {got.dtype} {tuple(got.shape)} differs from {tensor.dtype} {tuple(tensor.shape)}")
    with safe_open(path, framework="pt") as file:
        got = file.metadata() or {}
    want = dict(pair.split("=", 1) for pair in metadata)
    if got != want:
        fail(f"metadata {got} != {want}")
    print(f"check_safetensors: the package read {len(ours)} tensors and the metadata")


def write(path, reference_path):
    generator = torch.Generator().manual_seed(7)
    floats = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    tensors = {
        "f64": floats,
        "f32": floats.float(),
        "f16": floats.half()[:, :3].contiguous(),  # 9 x 2 bytes: the next tensor starts odd
        "bf16": floats.bfloat16(),
        "i64": torch.tensor([-(2**40), 0, 2**40], dtype=torch.int64),
        "i32": torch.tensor([[-7, 8]], dtype=torch.int32),
        "i16": torch.tensor([-300, 300, 5], dtype=torch.int16),
        "i8": torch.tensor([-128, 127, 0], dtype=torch.int8),
        "u8": torch.tensor([0, 255, 1], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "layers.0.attn.c_attn.weight": torch.randn(4, 12, generator=generator),
    }
    save_file(tensors, path, metadata={"format": "pt", "written_by": "safetensors"})
    torch.save(tensors, reference_path)
    print(f"check_safetensors: the package wrote {len(tensors)} tensors")


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--read")
parser.add_argument("--expect")
parser.add_argument("--metadata", nargs="*", default=[])
parser.add_argument("--write")
parser.add_argument("--reference")
args = parser.parse_args()
if args.read:
    read(args.read, args.expect, args.metadata)
if args.write:
    write(args.write, args.reference)
