#!/usr/bin/env python3
"""FlexAttention's own block masks, for attnkit::create_block_mask to be compared with.

    python3 scripts/block_mask_reference.py --out block_masks.pt

Builds PyTorch's `torch.nn.attention.flex_attention.create_block_mask` on the CPU for each
case of CASES (causal, sliding window, documents of varied lengths, prefix-LM, key padding,
and `&` combinations; block sizes 64 and 128; lengths that are and are not multiples of the
block) and saves one dict of tensors:
  inputs/{lengths,ids,prefix}                     what the mask_mods read
  <case>/{kv_num_blocks,kv_indices,full_kv_num_blocks,full_kv_indices,sparsity,dense}
where <case> is "<mask>/n<length>/b<block size>". Run by tests/masks_test.cpp
(BlockMaskReference.*) with the Python of each LibTorch leg; PyTorch before 2.5 has no
flex_attention: the script then says so and exits 3 (the C++ test skips on LibTorch 1.x and
fails on 2.x).
"""
import argparse
import sys

import torch

WINDOW = 96
PREFIX = 70
BATCH = 2  # key padding: two sequences of different lengths
LENGTHS = (256, 512, 300, 1000)
BLOCK_SIZES = (64, 128)


def document_ids(n):
    """Documents of varied lengths (37, 150, 5, 300, ...) packed into n tokens."""
    sizes = [37, 150, 5, 300, 64, 129, 1]
    ids, doc = [], 0
    while len(ids) < n:
        ids.extend([doc] * sizes[doc % len(sizes)])
        doc += 1
    return torch.tensor(ids[:n], dtype=torch.int64)


def padding_lengths(n):
    return torch.tensor([n, n * 2 // 3 + 1], dtype=torch.int64)


def mask_mods(n):
    """name -> (mask_mod, B): B is None where the mask does not depend on the batch."""
    ids = document_ids(n)
    lengths = padding_lengths(n)

    def causal(b, h, q, kv):
        return kv <= q

    def window(b, h, q, kv):
        return (kv <= q) & (q - kv < WINDOW)

    def documents(b, h, q, kv):
        return ids[q] == ids[kv]

    def prefix_lm(b, h, q, kv):
        return (kv <= q) | (kv < PREFIX)

    def key_padding(b, h, q, kv):
        return kv < lengths[b]

    def causal_and_padding(b, h, q, kv):
        return causal(b, h, q, kv) & key_padding(b, h, q, kv)

    def causal_documents(b, h, q, kv):
        return causal(b, h, q, kv) & documents(b, h, q, kv)

    return {
        "causal": (causal, None),
        "window": (window, None),
        "documents": (documents, None),
        "prefix_lm": (prefix_lm, None),
        "key_padding": (key_padding, BATCH),
        "causal_and_padding": (causal_and_padding, BATCH),
        "causal_documents": (causal_documents, None),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to torch.save the dict of tensors")
    args = parser.parse_args()
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        print(f"no flex_attention in torch {torch.__version__} (it came in 2.5)")
        return 3

    out = {}
    for n in LENGTHS:
        out[f"inputs/ids/n{n}"] = document_ids(n)
        out[f"inputs/lengths/n{n}"] = padding_lengths(n)
        for name, (mask_mod, batch) in mask_mods(n).items():
            for block in BLOCK_SIZES:
                bm = create_block_mask(mask_mod, batch, None, n, n, device="cpu", BLOCK_SIZE=block)
                case = f"{name}/n{n}/b{block}"
                out[f"{case}/kv_num_blocks"] = bm.kv_num_blocks.clone()
                out[f"{case}/kv_indices"] = bm.kv_indices.clone()
                out[f"{case}/full_kv_num_blocks"] = bm.full_kv_num_blocks.clone()
                out[f"{case}/full_kv_indices"] = bm.full_kv_indices.clone()
                out[f"{case}/sparsity"] = torch.tensor(float(bm.sparsity()), dtype=torch.float64)
                out[f"{case}/dense"] = bm.to_dense().bool().clone()
    torch.save(out, args.out)
    print(f"OK torch {torch.__version__}: {len(LENGTHS) * 7 * len(BLOCK_SIZES)} block masks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
