#!/usr/bin/env python3
"""Float64 reference of apps/tiny_gpt's Llama-style model, and its golden file.

    python3 scripts/llama_reference.py --write    # data/golden/llama/reference.pt
    python3 scripts/llama_reference.py --check    # run by the C++ suite on each LibTorch leg

The model, after the designs of the book's Llama 3 and Qwen3 chapters: token embedding (no
position table), blocks of x + attention(RMSNorm(x)) and x + SwiGLU(RMSNorm(x)) with
grouped-query attention and RoPE (reference_attention.py's GroupedQueryAttention), a final
RMSNorm and a bias-free head. SwiGLU is fc3(silu(fc1(x)) * fc2(x)). Two configurations:
"llama" (Llama 3.1 frequency smoothing) and "qwen3" (QK-norm, theta 1e6).

Each prompt is decoded alone, with the reference's own concatenating KV cache: the golden
outputs are what a ragged batch of the three prompts must give row by row
(`tiny_gpt --golden` decodes them together). The file is one dict of tensors:
  <model>/config/<name>    the sizes (int64 scalars) and RoPE settings (float64 scalars)
  <model>/state/<key>      the model's state dict, float64, seeded
  <model>/prompt/<r>       prompt r's tokens (n_r), lengths 5, 11 and 2
  <model>/prefill/<r>      logits (n_r, vocab) of the prompt, one cached call
  <model>/generated/<r>    STEPS greedy tokens after it
  <model>/steps/<r>        logits (STEPS, vocab), each generated token fed back one at a time
  <model>/full/<r>         logits (n_r + STEPS, vocab) of prompt and tokens, no cache
--check recomputes everything and compares with the file (1e-12), and checks that the cached
logits equal the uncached ones (1e-10).
"""
import os
import sys

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import golden_file  # noqa: E402
from reference_attention import GroupedQueryAttention, RMSNorm  # noqa: E402

GOLDEN = os.path.join(HERE, "..", "data", "golden", "llama", "reference.pt")
PROMPT_LENGTHS = (5, 11, 2)
STEPS = 6
SIZES = dict(vocab=64, context_length=32, d_model=32, heads=4, kv_groups=2, layers=2, hidden=64)
CONFIGS = {
    # rope_original_context_length 0: no frequency smoothing.
    "llama": dict(SIZES, qk_norm=0, rope_theta=10000.0, rope_factor=8.0, rope_low_freq_factor=1.0,
                  rope_high_freq_factor=4.0, rope_original_context_length=16, norm_eps=1e-5),
    "qwen3": dict(SIZES, qk_norm=1, rope_theta=1e6, rope_factor=1.0, rope_low_freq_factor=1.0,
                  rope_high_freq_factor=4.0, rope_original_context_length=0, norm_eps=1e-6),
}


class SwiGLU(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden, bias=False)
        self.fc2 = nn.Linear(d_model, hidden, bias=False)
        self.fc3 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        return self.fc3(nn.functional.silu(self.fc1(x)) * self.fc2(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        rope = dict(context_length=c["context_length"], theta_base=c["rope_theta"],
                    layout="split_half", freq_config=None)
        if c["rope_original_context_length"] > 0:
            rope["freq_config"] = dict(
                factor=c["rope_factor"], low_freq_factor=c["rope_low_freq_factor"],
                high_freq_factor=c["rope_high_freq_factor"],
                original_context_length=c["rope_original_context_length"])
        self.attention_norm = RMSNorm(c["d_model"], c["norm_eps"])
        self.attention = GroupedQueryAttention(c["d_model"], c["d_model"], 0.0, c["heads"],
                                               c["kv_groups"], rope=rope,
                                               qk_norm=bool(c["qk_norm"]))
        self.feed_forward_norm = RMSNorm(c["d_model"], c["norm_eps"])
        self.feed_forward = SwiGLU(c["d_model"], c["hidden"])

    def forward(self, x, use_cache):
        x = x + self.attention(self.attention_norm(x), use_cache=use_cache)
        return x + self.feed_forward(self.feed_forward_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.token_embedding = nn.Embedding(c["vocab"], c["d_model"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.final_norm = RMSNorm(c["d_model"], c["norm_eps"])
        self.head = nn.Linear(c["d_model"], c["vocab"], bias=False)

    def forward(self, tokens, use_cache=False):  # (b, n) -> (b, n, vocab)
        x = self.token_embedding(tokens)
        for block in self.blocks:
            x = block(x, use_cache)
        return self.head(self.final_norm(x))

    def reset_cache(self):
        for block in self.blocks:
            block.attention.reset_cache()


def everything():
    golden = {}
    for index, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(100 + index)
        model = TinyLlama(config).double().eval()
        with torch.no_grad():  # norm weights start at one: made distinct so that each counts
            for key, parameter in model.named_parameters():
                if key.endswith("norm.weight"):
                    parameter.normal_(1.0, 0.3)
        for key, value in config.items():
            dtype = torch.float64 if isinstance(value, float) else torch.int64
            golden[f"{name}/config/{key}"] = torch.tensor(value, dtype=dtype)
        for key, value in model.state_dict().items():
            golden[f"{name}/state/{key}"] = value.clone()
        generator = torch.Generator().manual_seed(7 + index)
        with torch.no_grad():
            for r, length in enumerate(PROMPT_LENGTHS):
                prompt = torch.randint(config["vocab"], (length,), generator=generator)
                model.reset_cache()
                prefill = model(prompt.unsqueeze(0), use_cache=True)[0]
                tokens, steps, last = [], [], prefill[-1]
                for _ in range(STEPS):
                    tokens.append(int(last.argmax()))
                    last = model(torch.tensor([[tokens[-1]]]), use_cache=True)[0, -1]
                    steps.append(last)
                generated = torch.tensor(tokens, dtype=torch.int64)
                full = model(torch.cat([prompt, generated]).unsqueeze(0))[0]
                golden[f"{name}/prompt/{r}"] = prompt
                golden[f"{name}/prefill/{r}"] = prefill
                golden[f"{name}/generated/{r}"] = generated
                golden[f"{name}/steps/{r}"] = torch.stack(steps)
                golden[f"{name}/full/{r}"] = full
    return golden


def cached_equals_uncached(golden):
    """The reference's own consistency: the cached logits are the uncached ones (1e-10)."""
    worst = 0.0
    for name in CONFIGS:
        for r, length in enumerate(PROMPT_LENGTHS):
            cached = torch.cat([golden[f"{name}/prefill/{r}"], golden[f"{name}/steps/{r}"]])
            worst = max(worst, (cached - golden[f"{name}/full/{r}"]).abs().max().item())
    return worst


def main():
    def cached_matches(golden):
        worst = cached_equals_uncached(golden)
        return worst <= 1e-10, f"cached vs uncached {worst:.3g}"
    return golden_file.run(
        __doc__.splitlines()[0], GOLDEN, everything,
        lambda golden: f"{len(CONFIGS)} models, {len(PROMPT_LENGTHS)} prompts each", cached_matches)


if __name__ == "__main__":
    sys.exit(main())
