"""The --write / --check command line shared by the golden-file references
(rope_reference.py, llama_reference.py): --write saves what the reference computes, --check
recomputes it and compares every tensor with the file (same keys and dtypes, within 1e-12)."""
import argparse
import os

import torch


def run(description, path, compute, describe_written, self_check=None):
    """`compute()` -> dict of tensors; `describe_written(golden)` -> text after "wrote FILE: ";
    `self_check(golden)` -> (ok, text) run before writing or comparing. Returns the exit code."""
    name = os.path.relpath(path)
    parser = argparse.ArgumentParser(description=description)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help=f"write {name}")
    action.add_argument("--check", action="store_true", help="recompute and compare with the file")
    args = parser.parse_args()
    golden = compute()
    note = ""
    if self_check is not None:
        ok, note = self_check(golden)
        if not ok:
            print(f"FAILED: {note}")
            return 1
        note = f", {note}"
    if args.write:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(golden, path)
        print(f"wrote {name}: {describe_written(golden)} (torch {torch.__version__})")
        return 0
    stored = torch.load(path, weights_only=True)
    failures = [k for k in golden if k not in stored or golden[k].dtype != stored[k].dtype
                or not torch.allclose(golden[k], stored[k], rtol=0, atol=1e-12)]
    failures += [k for k in stored if k not in golden]
    for key in failures:
        print(f"mismatch: {key}")
    print(f"{'FAILED' if failures else 'OK'} torch {torch.__version__}: {len(golden)} tensors{note}")
    return 1 if failures else 0
