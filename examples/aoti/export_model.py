"""Exports a model that calls attnkit.flex_attention (a document mask and ALiBi) with
torch.export, packages it with AOTInductor, and saves inputs and Python's output for
run_exported (docs/python.md, "From Python to a C++ program").

    python examples/aoti/export_model.py OUT_DIR
writes OUT_DIR/model.pt2, q.bin, k.bin, v.bin, expected.bin (float32, (1, 4, 256, 32)) and
prints the package's size, the compile time and Python's time per call."""

import os
import sys
import time

import torch

import attnkit

# [doc:export]
B, H, L, D = 1, 4, 256, 32
document_ids = torch.arange(L) // 64  # four documents of 64 tokens
slopes = torch.tensor([2.0 ** -(i + 1) for i in range(H)])


def same_document(b, h, q_idx, kv_idx):
    return (document_ids[q_idx] == document_ids[kv_idx]) & (kv_idx <= q_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


class DocumentAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block_mask = attnkit.create_block_mask(same_document, None, None, L, L,
                                                    BLOCK_SIZE=64)

    def forward(self, q, k, v):
        return attnkit.flex_attention(q, k, v, score_mod=alibi, block_mask=self.block_mask)


def export(out_dir):
    model = DocumentAttention()
    q, k, v = (torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    # The graph holds the score_mod as attnkit's score graph (a string) and the block mask's
    # lists as constant tensors: both survive export and AOTInductor as they are.
    program = torch.export.export(model, (q, k, v), strict=False)
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=os.path.join(out_dir, "model.pt2"))
# [doc:end]
    return model, (q, k, v), package


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    model, inputs, package = export(out_dir)
    compiled = time.perf_counter() - start
    with torch.no_grad():
        expected = model(*inputs)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(*inputs)
            times.append(time.perf_counter() - start)
    for name, tensor in zip(("q", "k", "v", "expected"), (*inputs, expected)):
        tensor.contiguous().numpy().tofile(os.path.join(out_dir, f"{name}.bin"))
    print(f"{package}: {os.path.getsize(package) / 1e6:.2f} MB, exported and compiled in "
          f"{compiled:.1f} s; eager Python {sum(times) / len(times) * 1e3:.3f} ms per call")


if __name__ == "__main__":
    main()
