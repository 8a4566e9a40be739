#!/usr/bin/env python3
"""One transformers training step (forward, backward, AdamW) of a Llama-shaped model on the CPU,
packed documents, with one attention implementation: attnkit (attnkit.transformers), sdpa or
eager (docs/python.md, docs/benchmarks.md). Prints the median step time of --steps timed steps
after one warm-up step. Compare implementations in alternating processes, e.g.

  PYTHONPATH=build-pip/python farm-bench -n 5 \\
      --vs "$(scripts/pip_torch.sh) scripts/bench_transformers_step.py sdpa" -- \\
      "$(scripts/pip_torch.sh)" scripts/bench_transformers_step.py attnkit

The model: hidden 512, 8 query heads over 2 key/value heads of 64, 4 layers, float32; one row
of --tokens (2,048) tokens packed as --documents (4) documents of equal length (position_ids
restart at each; transformers makes the document mask from them).
"""

import argparse
import statistics
import time

import torch
import transformers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("implementation", choices=["attnkit", "sdpa", "eager"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    args = parser.parse_args()
    if args.tokens % args.documents:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --documents "
                     f"({args.documents})")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.implementation == "attnkit":
        import attnkit.transformers
        attnkit.transformers.register()
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=args.tokens)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=args.implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    length = args.tokens // args.documents
    input_ids = torch.randint(0, 1024, (1, args.tokens))
    position_ids = torch.arange(length).repeat(args.documents).view(1, -1)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        loss = model(input_ids=input_ids, position_ids=position_ids, labels=input_ids,
                     use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step > 0:
            times.append(time.perf_counter() - start)
    print(f"{args.implementation}: step {statistics.median(times) * 1e3:.1f} ms (median of "
          f"{len(times)}), loss {loss.item():.4f}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
