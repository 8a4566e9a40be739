#pragma once
// tiny_gpt --hf's model description: a Hugging Face checkpoint's config.json read as
// transformers reads it for that architecture (GPT-2, Llama 3, Qwen2, Qwen3, Mistral, Phi-3,
// Gemma 2, Gemma 3), its name map, and the model built from it and loaded.

#include <string>

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include "model.h"

namespace tiny_gpt {

/// A Hugging Face decoder: tiny_gpt's configuration for it and its checkpoint's name map.
struct HfModel {
  std::string architecture;  // config.json's model_type: "gpt2", "llama", "qwen3", "gemma2", ...
  ModelConfig config;
  attnkit::NameMap names;
};

/// Reads DIR/config.json. Throws std::runtime_error naming the file and the field for what
/// tiny_gpt's model cannot express (another model_type, activation, biases, rope_type...), for
/// a value transformers would misread (a softcap of 0), and for sizes whose weights would pass
/// attnkit::memory_budget(); keys the architecture's transformers class ignores are ignored.
HfModel read_hf_model(const std::string& dir);

/// The model of DIR (config.json, model.safetensors: strict, through the name map) in `dtype`
/// on `device`, in eval mode.
TinyGpt load_hf_model(const std::string& dir, torch::ScalarType dtype, torch::Device device);

}  // namespace tiny_gpt
