#!/usr/bin/env python3
"""References for the decoder checks of docs/models.md: small GPT-2, Llama 3, Qwen3, Mistral,
Qwen2, Phi-3, Gemma 2 and Gemma 3 models with random weights, made from each model's config by
`transformers` on the CPU, saved as Hugging Face checkpoints, with what transformers computes
from them. tiny_gpt --hf reads them (data/golden/hf/, checked by the package test on the 1.13
and pip legs).

    "$(scripts/pip_torch.sh)" scripts/hf_decoder_reference.py OUT_DIR
    "$(scripts/pip_torch.sh)" scripts/hf_decoder_reference.py --check data/golden/hf

--check recomputes everything into a temporary folder and compares it with the folder given:
the same configs, the same weights, the same prompts and greedy tokens, and logits within
FLOAT32_TOLERANCE and FLOAT64_TOLERANCE of their largest; exit 1 on a difference.

The models: gpt2; llama3 (grouped-query attention, RoPE with Llama 3's scaling, its original
context below the prompts' positions so that the scaling matters); qwen3 (QK-norm, an explicit
head_dim); mistral (a sliding window on every layer); qwen2 (query, key and value biases); phi3
(fused projections, a sliding window); gemma2 (a window layer and a full one, softcaps on the
scores and the logits, its own query scale, four norms per block, GeGLU, scaled embeddings);
gemma3 (the same without softcaps, with QK-norm and a RoPE base per kind of layer). The windows
(5 tokens) are shorter than two prompts, and the third passes it while decoding. For each,
OUT_DIR/<name>/ gets:
  config.json, model.safetensors   save_pretrained's checkpoint (float32 weights)
  reference.safetensors            prompt<i> (int64): three prompts of 7, 12 and 3 tokens;
                                   logits_float32_<i>, logits_float64_<i>: each prompt's logits
                                   (the model in float32, and in float64 from the same weights,
                                   float64 throughout: see float64_throughout);
                                   generated<i> (int64): 32 greedy tokens, float64, from the
                                   three prompts as one left-padded batch
                                   (generate(do_sample=False)), checked here to equal each
                                   prompt decoded alone
The smallest gap between the best and second-best logit over every greedy step is printed:
a near tie would make token-for-token equality a matter of rounding.
"""
import json
import os
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config,
                          LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

VOCAB = 97
NEW_TOKENS = 32
PROMPT_LENGTHS = (7, 12, 3)
PAD = 0  # a token id the prompts do not use
WINDOW = 5


def configs():
    # No end-of-text token: every row decodes all 32 steps.
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=None, pad_token_id=PAD)
    yield "gpt2", GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common)
    yield "llama3", LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}, **common)
    yield "qwen3", Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        **common)
    # The models below: a sliding window of 5 tokens, so that the prompts (7 and 12 tokens)
    # pass it in the prefill and the third (3 tokens) during decoding.
    llama_like = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      **common)
    yield "mistral", MistralConfig(sliding_window=WINDOW, tie_word_embeddings=False, **llama_like)
    yield "qwen2", Qwen2Config(tie_word_embeddings=False, **llama_like)  # query/key/value biases
    # Fused qkv_proj (its key and value heads narrower than its query heads) and gate_up_proj.
    yield "phi3", Phi3Config(sliding_window=WINDOW, tie_word_embeddings=False, **llama_like)
    # Gemma 2: a window on the first layer, full attention on the second; its own query scale
    # (24, not the head width 16); caps small enough to bite on these scores and logits.
    yield "gemma2", Gemma2Config(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=10.0, **llama_like)
    # Gemma 3: QK-norm, the window layer's RoPE base 10,000 and the full layer's 1,000,000.
    yield "gemma3", Gemma3TextConfig(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        **llama_like)


# Models whose 1-d parameters (norms, biases) are drawn too, so that each matters: the first
# three keep their init (norm weights 1, no biases) as their committed files hold them.
FIRST_MODELS = ("gpt2", "llama3", "qwen3")


def float64_throughout(model):
    """Lets the float64 model compute in float64 everywhere. transformers' Llama and Qwen3 cast
    to float32 inside RMSNorm (`hidden_states.to(torch.float32)`) and RoPE (inverse
    frequencies made in float32, angles taken with `.float()`) even in a float64 model, so
    their float64 logits would carry float32 rounding (4e-7 relative here; GPT-2 has no such
    cast). Same formulas, same code for the frequencies (run with torch.float meaning
    float64), no casts."""
    def rms_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq64.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.attention_scaling).to(x.dtype),
                (emb.sin() * self.attention_scaling).to(x.dtype))

    def gemma_norm(self, x):  # Gemma's weights are offsets from 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def rotary_by_layer_type(self, x, position_ids, layer_type):  # Gemma 3's two RoPE bases
        freqs = position_ids[..., None].to(torch.float64) * getattr(self, f"{layer_type}_inv_freq64")
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(self, f"{layer_type}_attention_scaling")
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    def in_float64(init, *args, **kwargs):
        single = torch.float
        torch.float = torch.float64  # the frequencies' code as written, in float64
        try:
            inv_freq, _ = init(*args, **kwargs)
        finally:
            torch.float = single
        assert inv_freq.dtype == torch.float64
        return inv_freq

    # Eager attention (Gemma 2's, for its softcap) takes the softmax in float32.
    for name in ("gemma2", "gemma3"):
        modeling = sys.modules.get(f"transformers.models.{name}.modeling_{name}")
        if modeling is not None:
            modeling.eager_attention_forward = eager_attention_float64

    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = (gemma_norm if kind.startswith("Gemma") else rms_norm).__get__(module)
        elif hasattr(module, "scalar_embed_scale"):  # Gemma 3's scale, kept in float32
            module.embed_scale = torch.tensor(module.scalar_embed_scale, dtype=torch.float64)
        elif kind.endswith("RotaryEmbedding") and isinstance(module.rope_type, dict):
            for layer_type, rope_type in module.rope_type.items():
                init = (module.compute_default_rope_parameters if rope_type == "default"
                        else ROPE_INIT_FUNCTIONS[rope_type])
                setattr(module, f"{layer_type}_inv_freq64",
                        in_float64(init, module.config, layer_type=layer_type))
            module.forward = rotary_by_layer_type.__get__(module)
        elif kind.endswith("RotaryEmbedding"):
            init = (module.compute_default_rope_parameters if module.rope_type == "default"
                    else ROPE_INIT_FUNCTIONS[module.rope_type])
            module.inv_freq64 = in_float64(init, module.config)
            module.forward = rotary.__get__(module)


def eager_attention_float64(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            softcap=None, **kwargs):
    """transformers' eager attention (scale, softcap, additive mask, softmax, values) with the
    softmax in the scores' own dtype."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    weights = torch.matmul(query, key.transpose(2, 3)) * (
        module.head_dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def greedy(model, prompts):
    """The prompts as one left-padded batch, and each alone: the same tokens, or exit 1."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    batch = out.sequences[:, width:]
    logits = torch.stack(out.logits, 1)  # (rows, steps, vocab)
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).min().item()
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt.unsqueeze(0), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=PAD)[0, len(prompt):]
        if not torch.equal(alone, batch[row]):
            sys.exit(f"hf_decoder_reference: prompt {row}: the batch's tokens {batch[row].tolist()} "
                     f"differ from the prompt's alone {alone.tolist()}")
    return batch, gap


# Relative to the largest logit. The BLAS picks its kernels by the processor (AVX2, AVX-512,
# AVX-512 bf16/VNNI), and each sums float32 products in its own order: two layers moved Llama's
# float32 logits by up to 9e-6 of their largest on an AMD EPYC against the machine that made the
# files, and MKL_CBWR=AVX2 did not hold them. 1e-4 is tiny_gpt --hf's own float32 check. float64
# differs by about 1e-15 from one kernel to another, so its check stays tight.
FLOAT32_TOLERANCE = 1e-4
FLOAT64_TOLERANCE = 1e-12


def compare(expected_dir, actual_dir):
    """Differences between the committed folder and a fresh one, as lines of text."""
    problems = []
    for name, _ in configs():
        expected, actual = (os.path.join(d, name) for d in (expected_dir, actual_dir))
        with open(os.path.join(expected, "config.json")) as a, \
                open(os.path.join(actual, "config.json")) as b:
            if json.load(a) != json.load(b):
                problems.append(f"{name}/config.json differs")
        for file in ("model.safetensors", "reference.safetensors"):
            old, new = (load_file(os.path.join(d, file)) for d in (expected, actual))
            if old.keys() != new.keys():
                problems.append(f"{name}/{file}: keys {sorted(old)} != {sorted(new)}")
                continue
            for key, value in old.items():
                fresh = new[key]
                if value.dtype != fresh.dtype or value.shape != fresh.shape:
                    problems.append(f"{name}/{file}: {key} is {value.dtype} {tuple(value.shape)}, "
                                    f"now {fresh.dtype} {tuple(fresh.shape)}")
                elif value.is_floating_point() and file == "reference.safetensors":
                    tolerance = FLOAT64_TOLERANCE if value.dtype == torch.float64 else FLOAT32_TOLERANCE
                    scale = value.abs().max().item()
                    worst = (value - fresh).abs().max().item()
                    if worst > tolerance * scale:
                        problems.append(f"{name}/{file}: {key} differs by {worst:.3g} "
                                        f"(tolerance {tolerance} x {scale:.3g})")
                elif not torch.equal(value, fresh):
                    problems.append(f"{name}/{file}: {key} differs")
    return problems


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        with tempfile.TemporaryDirectory() as fresh:
            write(fresh)
            problems = compare(sys.argv[2], fresh)
        for problem in problems:
            print(f"hf_decoder_reference: {problem}")
        print("hf_decoder_reference: " + ("the files differ from what transformers computes now"
                                          if problems else f"{sys.argv[2]} is what transformers "
                                          f"{transformers.__version__} computes"))
        return 1 if problems else 0
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    write(sys.argv[1])
    return 0


def write(out_dir):
    for name, config in configs():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # weights far from the tiny default init: decisive logits
            for key, parameter in model.named_parameters():
                if parameter.dim() >= 2:
                    parameter.normal_(0.0, 0.3)
                elif name not in FIRST_MODELS:
                    if key.endswith("bias") or name.startswith("gemma"):  # Gemma's: offsets
                        parameter.normal_(0.0, 0.3)
                    else:
                        parameter.uniform_(0.5, 1.5)
        folder = os.path.join(out_dir, name)
        model.save_pretrained(folder, safe_serialization=True)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, VOCAB, (n,), generator=generator) for n in PROMPT_LENGTHS]
        reference = {}
        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                reference[f"prompt{i}"] = prompt
                reference[f"logits_float32_{i}"] = model(prompt.unsqueeze(0)).logits[0]
            model.double()
            float64_throughout(model)
            for i, prompt in enumerate(prompts):
                reference[f"logits_float64_{i}"] = model(prompt.unsqueeze(0)).logits[0]
            generated, gap = greedy(model, prompts)
        for i in range(len(prompts)):
            reference[f"generated{i}"] = generated[i].contiguous()
        save_file({k: v.contiguous() for k, v in reference.items()},
                  os.path.join(folder, "reference.safetensors"),
                  metadata={"transformers": transformers.__version__})
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, "
              f"{len(prompts)} prompts, {NEW_TOKENS} greedy tokens each; smallest top-2 logit gap "
              f"{gap:.3g}; -> {folder}")


if __name__ == "__main__":
    sys.exit(main())
