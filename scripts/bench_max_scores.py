#!/usr/bin/env python3
"""What return_aux=AuxRequest(max_scores=True) costs over AuxRequest(lse=True):
attnkit.flex_attention forward on a document mask (4 documents), b 1, h 8, hd 64, float32;
a warm-up call, then --calls timed calls, median printed (docs/python.md). Compare the two
in alternating processes:

  PYTHONPATH=build-pip/python farm-bench -n 5 \\
      --vs "$(scripts/pip_torch.sh) scripts/bench_max_scores.py --max-scores" -- \\
      "$(scripts/pip_torch.sh)" scripts/bench_max_scores.py
"""

import argparse
import statistics
import time

import torch

import attnkit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-scores", action="store_true", help="ask for max_scores too")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    n = args.tokens
    q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
    document = torch.arange(n) * 4 // n

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    block_mask = attnkit.create_block_mask(same_document, None, None, n, n)
    request = attnkit.AuxRequest(lse=True, max_scores=args.max_scores)
    times = []
    with torch.no_grad():
        for _ in range(args.calls + 1):
            start = time.perf_counter()
            attnkit.flex_attention(q, k, v, block_mask=block_mask, return_aux=request)
            times.append(time.perf_counter() - start)
    print(f"{'lse + max_scores' if args.max_scores else 'lse'}: median "
          f"{statistics.median(times[1:]) * 1e3:.1f} ms over {args.calls} calls, n {n}, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
