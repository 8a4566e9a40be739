#!/usr/bin/env python3
"""Loads a C++-written state dict into the Python reference class and compares outputs.

    python3 scripts/check_python_interop.py --module MultiHeadAttention \
        --config '{"d_in": 6, "d_out": 8, "context_length": 7, "dropout": 0.0,
                   "num_heads": 2, "qkv_bias": true, "causal": true}' \
        --state mha.pt --io mha_io.pt --write-back mha_python.pt

`--state` is a file from attnkit::save_state_dict; `--io` a dict {"input", "output"} the
C++ module computed (written with attnkit::write_state_dict). Both are read with the
weights-only unpickler (`weights_only=True`, PyTorch 2.6's default and the safe choice on
1.13) and, where that is a different call, with plain `torch.load(path)`. The state dict goes
into the class's own strict load_state_dict (every key and shape must match, the book's
`mask` buffer included), the input through the model; prints
`OK maxdiff=...` (exit 0) or `MISMATCH ...` (exit 1). `--write-back` then saves the model's
state dict with this PyTorch's torch.save, for the C++ side to read back. Run by the C++
test suite (tests/serialize_test.cpp) with the Python of each LibTorch leg.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import build  # noqa: E402

# C++ and Python run the same LibTorch kernels; 1e-6 absorbs any order-of-operations drift.
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12}


def load(path):
    """torch.load with the weights-only unpickler, and plain torch.load where that differs."""
    safe = torch.load(path, weights_only=True)
    plain = torch.load(path)  # PyTorch >= 2.6: weights-only too; 1.13: the full unpickler
    if safe.keys() != plain.keys() or any(not torch.equal(safe[k], plain[k]) for k in safe):
        raise SystemExit(f"MISMATCH {path}: weights_only=True and plain torch.load differ")
    return safe


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", required=True, help="attnkit class name, e.g. MultiHeadAttention")
    parser.add_argument("--config", required=True, help="constructor arguments as JSON")
    parser.add_argument("--state", required=True, help="state dict written by attnkit")
    parser.add_argument("--io", required=True, help='dict {"input", "output"} written by attnkit')
    parser.add_argument("--write-back", help="save the loaded model's state dict here (torch.save)")
    args = parser.parse_args()

    state = load(args.state)
    io = load(args.io)
    model = build(args.module, json.loads(args.config)).to(io["input"].dtype)
    # Strict, as a user's `model.load_state_dict(torch.load(path))`: a missing or unexpected
    # key, or a wrong shape, is the RuntimeError Python raises.
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        print(f"MISMATCH {args.module} strict load_state_dict: {error}")
        return 1
    model.eval()
    with torch.no_grad():
        output = model(io["input"])
    diff = (output - io["output"]).abs().max().item()
    if diff <= TOLERANCE[output.dtype]:
        if args.write_back:
            # dict(): LibTorch's unpickler reads plain dicts, not state_dict()'s OrderedDict.
            torch.save(dict(model.state_dict()), args.write_back)
        print(f"OK {args.module} maxdiff={diff:.3g} (torch {torch.__version__})")
        return 0
    print(f"MISMATCH {args.module} maxdiff={diff:.3g} > {TOLERANCE[output.dtype]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
