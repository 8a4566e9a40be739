#pragma once
// tiny_gpt's checks against models that nobody here wrote or that Python computed:
//   --golden FILE   the Llama-style design against scripts/llama_reference.py's file;
//   --hf DIR        a Hugging Face checkpoint (GPT-2, Llama 3, Qwen2, Qwen3, Mistral, Phi-3,
//                   Gemma 2, Gemma 3) loaded through a name
//                   map into tiny_gpt's model, against what transformers computed
//                   (scripts/hf_decoder_reference.py).
// Each prints one line per model and precision, and returns the exit code: 0, or 1 on a
// mismatch.

#include <string>

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include "hf_config.h"
#include "model.h"

namespace tiny_gpt {

int check_golden(const std::string& path);

/// DIR's model against DIR/reference.safetensors: each prompt's logits without a cache and
/// from a ragged prefill with the KV caches, and attnkit::generate's greedy tokens for the
/// prompts as one ragged batch. Without `dtype`, float64 and float32.
int check_hf(const std::string& dir, torch::Device device, c10::optional<torch::ScalarType> dtype);

/// Tokens/s of attnkit::generate on DIR's model: the reference's longest prompt, `new_tokens`
/// greedy tokens, with the KV caches and without (each step recomputing the whole sequence),
/// in alternation, medians of 5 rounds after one warm-up of each. Prints one line; returns 0
/// (1 when new_tokens passes the model's context).
int decode_speed(const std::string& dir, torch::Device device, torch::ScalarType dtype,
                 int64_t new_tokens);

}  // namespace tiny_gpt
