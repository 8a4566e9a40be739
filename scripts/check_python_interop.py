#!/usr/bin/env python3
"""Loads a C++-written state dict into the Python reference class and compares outputs.

    python3 scripts/check_python_interop.py --module MultiHeadAttention \
        --config '{"d_in": 6, "d_out": 8, "context_length": 7, "dropout": 0.0,
                   "num_heads": 2, "qkv_bias": true, "causal": true}' \
        --state mha.pt --io mha_io.pt

`--state` is a file from attnkit::save_state_dict; `--io` a dict {"input", "output"} the
C++ module computed (written with attnkit::write_state_dict). Loads the state dict with
the class's own load_state_dict (strict), runs the input and prints `OK maxdiff=...`
(exit 0) or `MISMATCH ...` (exit 1). Run by the C++ test suite (tests/serialize_test.cpp).
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", required=True, help="attnkit class name, e.g. MultiHeadAttention")
    parser.add_argument("--config", required=True, help="constructor arguments as JSON")
    parser.add_argument("--state", required=True, help="state dict written by attnkit")
    parser.add_argument("--io", required=True, help='dict {"input", "output"} written by attnkit')
    args = parser.parse_args()

    state = torch.load(args.state)
    io = torch.load(args.io)
    model = build(args.module, json.loads(args.config)).to(io["input"].dtype)
    model.load_state_dict(state)  # strict: every key and shape must match
    model.eval()
    with torch.no_grad():
        output = model(io["input"])
    diff = (output - io["output"]).abs().max().item()
    if diff <= TOLERANCE[output.dtype]:
        print(f"OK {args.module} maxdiff={diff:.3g}")
        return 0
    print(f"MISMATCH {args.module} maxdiff={diff:.3g} > {TOLERANCE[output.dtype]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
