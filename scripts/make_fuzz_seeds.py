#!/usr/bin/env python3
"""Writes the PyTorch-written seeds of the fuzz corpora (data/fuzz/, see scripts/fuzz.sh).

Run once per PyTorch version, so the corpora hold what each version's torch.save writes:
    /usr/bin/python3 scripts/make_fuzz_seeds.py            # Debian 12: PyTorch 1.13
    scripts/debian13.sh python3 scripts/make_fuzz_seeds.py # Debian 13: PyTorch 2.6
Files are named python<major><minor>_*.pt:
  state_dict/..._ordereddict.pt  the book's MultiHeadAttention (d_in 6, d_out 8, 2 heads, the
                                 fuzz target's module) saved as torch.save(model.state_dict())
  state_dict/..._views.pt        a dict whose tensors are views sharing one storage
                                 (transposed, offset, 0-d) and tensors of other dtypes, as torch.save(dict(...)) keeps them
  checkpoint/..._resaved.pt      data/fuzz/checkpoint/attnkit_train_copy.pt loaded and saved
                                 again by this PyTorch (what a user editing a checkpoint gets)
With --safetensors (under pip's PyTorch, whose environment has the safetensors package:
"$(scripts/pip_torch.sh)" scripts/make_fuzz_seeds.py --safetensors) it writes only
  safetensors/package_views.safetensors  the views dict above and a bool, with metadata
  safetensors/package_gpt2.safetensors   the fuzz module's weights under GPT-2's names ("model."
                                         prefix, c_attn fused and stored (in, out), a bias_mask)
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import MultiHeadAttention  # noqa: E402

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "fuzz")
major, minor = torch.__version__.split(".")[:2]
prefix = f"python{major}{minor}_"

torch.manual_seed(123)
model = MultiHeadAttention(6, 8, 7, 0.0, 2)
base = torch.arange(12, dtype=torch.float32)
views = {
    "a": base[:6].view(2, 3).t(),  # (3, 2), strides (1, 3)
    "b": base[7],  # 0-d at offset 7
    "h": torch.tensor([1.5, -2.0], dtype=torch.float16),  # a storage of its own, another dtype
    "n": torch.tensor([3, 4], dtype=torch.int64),
    "v": base[1:3],  # offset 1
}

if sys.argv[1:] == ["--safetensors"]:
    from safetensors.torch import save_file

    folder = os.path.join(root, "safetensors")
    os.makedirs(folder, exist_ok=True)
    contiguous = {key: value.contiguous() for key, value in views.items()}
    contiguous["mask"] = torch.tensor([True, False, True])
    save_file(contiguous, os.path.join(folder, "package_views.safetensors"), metadata={"format": "pt"})
    weights = model.state_dict()
    gpt2 = {
        "model.c_attn.weight": torch.cat([weights["W_query.weight"], weights["W_key.weight"],
                                          weights["W_value.weight"]]).t().contiguous(),
        "model.out_proj.weight": weights["out_proj.weight"],
        "model.out_proj.bias": weights["out_proj.bias"],
        "model.attn.bias_mask": weights["mask"].bool(),
    }
    save_file(gpt2, os.path.join(folder, "package_gpt2.safetensors"), metadata={"format": "pt"})
    print("fuzz seeds written by the safetensors package: safetensors/package_*.safetensors")
    sys.exit(0)

torch.save(model.state_dict(), os.path.join(root, "state_dict", prefix + "ordereddict.pt"))
torch.save(views, os.path.join(root, "state_dict", prefix + "views.pt"))

checkpoint = torch.load(os.path.join(root, "checkpoint", "attnkit_train_copy.pt"))
torch.save(checkpoint, os.path.join(root, "checkpoint", prefix + "resaved.pt"))
print(f"fuzz seeds written by PyTorch {torch.__version__}: {prefix}*.pt")
