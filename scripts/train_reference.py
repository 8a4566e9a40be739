#!/usr/bin/env python3
"""The default attnkit-train copy and text runs, in Python PyTorch: the same model and loop.

Token + position embeddings, blocks x + MultiHeadAttention(LayerNorm(x)) (the book's
class, from reference_attention.py), final LayerNorm, linear head; AdamW (lr 3e-3, weight
decay 0.01), gradient clipping at 1.0; batch 64.
- copy (1 block): 8 random symbols + separator + copy, loss on the copy;
- text (2 blocks): 64-byte windows of the first 90% of data/the-verdict.txt, next-byte
  loss at every position.
Prints training steps per second (batch generation included, evaluation excluded) so
scripts/bench_train_vs_python.sh can compare it with attnkit-train.
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import MultiHeadAttention  # noqa: E402
import threads  # noqa: E402

SYMBOLS = 10


class Block(nn.Module):
    def __init__(self, context, d_model, heads):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = MultiHeadAttention(d_model, d_model, context, 0.0, heads)

    def forward(self, x):
        return x + self.attention(self.attention_norm(x))


class Model(nn.Module):
    def __init__(self, vocab, context, d_model, heads, layers):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[Block(context, d_model, heads) for _ in range(layers)])
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1])
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.final_norm(self.blocks(x)))


def copy_batch(batch, length, generator):
    symbols = torch.randint(1, SYMBOLS + 1, (batch, length), generator=generator)
    sequence = torch.cat([symbols, torch.zeros(batch, 1, dtype=torch.long), symbols], 1)
    mask = torch.zeros(batch, 2 * length, dtype=torch.bool)
    mask[:, length:] = True
    return sequence[:, :-1], sequence[:, 1:], mask


def text_batch(train_bytes, batch, context, generator):
    starts = torch.randint(0, train_bytes.numel() - context - 1, (batch, 1), generator=generator)
    windows = train_bytes[starts + torch.arange(context + 1)]  # (batch, context + 1)
    return windows[:, :-1], windows[:, 1:], None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("copy", "text"), default="copy")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=0, help="0: copy 8, text 64")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    threads.set_num_threads(args.threads)
    torch.manual_seed(1)
    generator = torch.Generator().manual_seed(1)
    if args.task == "copy":
        seq_len = args.seq_len or 8
        model = Model(SYMBOLS + 1, 2 * seq_len, args.d_model, args.heads, layers=1)

        def next_batch():
            return copy_batch(args.batch_size, seq_len, generator)
    else:
        context = args.seq_len or 64
        corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data",
                              "the-verdict.txt")
        with open(corpus, "rb") as f:
            data = f.read()
        train_bytes = torch.tensor(list(data[:len(data) * 9 // 10]), dtype=torch.long)
        model = Model(256, context, args.d_model, args.heads, layers=2)

        def next_batch():
            return text_batch(train_bytes, args.batch_size, context, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    start = time.perf_counter()
    for _ in range(args.steps):
        inputs, targets, mask = next_batch()
        logits = model(inputs)
        if mask is not None:
            logits, targets = logits[mask], targets[mask]
        loss = nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()  # attnkit-train reads the loss every step too
    seconds = time.perf_counter() - start
    print(f"python: {args.steps / seconds:.1f} steps/s (final loss {loss.item():.4f})")


if __name__ == "__main__":
    main()
