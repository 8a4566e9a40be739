#!/usr/bin/env python3
"""Python reference for attnkit-decode-bench: greedy generation with and without the KV cache
of the chapter-4 bonus material, over the model attnkit-train builds (token + position
embeddings, pre-LayerNorm blocks of MultiHeadAttention and a GELU feed-forward, final
LayerNorm, vocabulary head), untrained, at the same shape and flags.

    python3 scripts/bench_generate.py [--vocab 50257 --context 1024 --d-model 768 --heads 12
        --layers 12 --prompt 4 --new-tokens 200 --repeats 3 --threads 1] [--json FILE]

Prints tokens/s of each mode; run by scripts/bench_generate.sh next to the C++ program.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_attention import MultiHeadAttention  # noqa: E402
import threads  # noqa: E402


class Block(nn.Module):
    def __init__(self, d, context_length, heads):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.attention = MultiHeadAttention(d, d, context_length, 0.0, heads)
        self.feed_forward_norm = nn.LayerNorm(d)
        self.feed_forward = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, use_cache=False):
        x = x + self.attention(self.attention_norm(x), use_cache=use_cache)
        return x + self.feed_forward(self.feed_forward_norm(x))


class Model(nn.Module):
    def __init__(self, vocab, context_length, d, heads, layers):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d)
        self.position_embedding = nn.Embedding(context_length, d)
        self.blocks = nn.ModuleList([Block(d, context_length, heads) for _ in range(layers)])
        self.final_norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.current_pos = 0

    def reset_kv_cache(self):
        for block in self.blocks:
            block.attention.reset_cache()
        self.current_pos = 0

    def forward(self, tokens, use_cache=False):
        n = tokens.shape[1]
        start = self.current_pos if use_cache else 0
        positions = torch.arange(start, start + n, device=tokens.device)
        if use_cache:
            self.current_pos += n
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, use_cache=use_cache)
        return self.head(self.final_norm(x))


def generate_uncached(model, tokens, new_tokens, context_length):
    """The book's generate_text_simple: the whole (cropped) sequence for every token."""
    for _ in range(new_tokens):
        logits = model(tokens[:, -context_length:])[:, -1]
        tokens = torch.cat([tokens, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return tokens


def generate_cached(model, tokens, new_tokens):
    """The bonus material's generate_text_simple_cached: one prefill, then one token a step."""
    model.reset_kv_cache()
    logits = model(tokens, use_cache=True)
    for _ in range(new_tokens):
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
        logits = model(next_token, use_cache=True)
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="0: PyTorch's default")
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--no-uncached", action="store_true")
    parser.add_argument("--json")
    a = parser.parse_args()
    if a.prompt + a.new_tokens > a.context:
        parser.error(f"--prompt + --new-tokens must be <= --context {a.context}")
    if a.threads > 0:
        threads.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Model(a.vocab, a.context, a.d_model, a.heads, a.layers).eval()
    prompt = torch.randint(0, a.vocab, (1, a.prompt))
    modes = {"cached": lambda: generate_cached(model, prompt, a.new_tokens)}
    if not a.no_uncached:
        modes["uncached"] = lambda: generate_uncached(model, prompt, a.new_tokens, a.context)
    results = {"language": "Python", "torch": ".".join(torch.__version__.split(".")[:2]),
               "threads": torch.get_num_threads()}
    outputs = {}
    with torch.no_grad():
        generate_cached(model, prompt, 2)  # warm-up
        for mode, run in modes.items():
            rates = []
            for _ in range(a.repeats):
                start = time.perf_counter()
                outputs[mode] = run()
                rates.append(a.new_tokens / (time.perf_counter() - start))
            results[f"{mode}_tokens_per_s"] = statistics.median(rates)
            print(f"  {mode:<9}{results[f'{mode}_tokens_per_s']:10.1f} tokens/s")
    if len(outputs) == 2:
        results["identical_tokens"] = bool(torch.equal(outputs["cached"], outputs["uncached"]))
        print("  tokens " + ("identical" if results["identical_tokens"] else "DIFFER"))
    if a.json:
        with open(a.json, "w") as out:
            json.dump(results, out)
            out.write("\n")


if __name__ == "__main__":
    main()
