#pragma once

// The model attnkit-train fits: token + position embeddings, then `layers` blocks of
// [x + attention(norm(x)), and with --ffn x + feed_forward(norm(x))], a final LayerNorm
// and a linear head over the vocabulary. The attention is any attnkit module.

#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/functional.h"

namespace attnkit::train {

/// The --module names, in the order --help lists them.
const std::vector<std::string>& module_names();

struct ModelConfig {
  std::string module = "mha";
  /// Attention backend of mha and mha-combined (math | fused | chunked); empty for the
  /// other modules, which have one implementation.
  std::string backend;
  int64_t vocab_size = 0;
  int64_t context_length = 0;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 1;
  double dropout = 0.0;
  bool ffn = false;
  /// Whether the task is causal: picks mha's mask and decides which modules are allowed.
  bool causal = true;
};

/// Fails (one-line c10::Error) when the module does not fit the task or the sizes do not
/// fit the module, saying why.
void check_model_config(const ModelConfig& config);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelConfig& config);
  /// (b, n, d_model) -> (b, n, d_model); `weights` gets (b, h, n, n) when not null.
  torch::Tensor forward(torch::Tensor x, torch::Tensor* weights = nullptr);

 private:
  torch::nn::LayerNorm attention_norm_{nullptr};
  std::shared_ptr<torch::nn::Module> attention_;
  // forward_with_weights (the book's path, for attention maps) and forward (the backend's).
  std::function<functional::AttentionOutput(const torch::Tensor&)> attend_with_weights_;
  std::function<torch::Tensor(const torch::Tensor&)> attend_;
  torch::nn::LayerNorm feed_forward_norm_{nullptr};
  torch::nn::Sequential feed_forward_{nullptr};
};
TORCH_MODULE(Block);

class AttentionModelImpl : public torch::nn::Module {
 public:
  explicit AttentionModelImpl(const ModelConfig& config);
  /// (b, n) token ids -> (b, n, vocab_size) logits.
  torch::Tensor forward(const torch::Tensor& tokens);
  /// Attention weights of every layer on `tokens`: layers x (b, h, n, n).
  std::vector<torch::Tensor> attention_maps(const torch::Tensor& tokens);
  const ModelConfig& config() const { return config_; }

 private:
  torch::Tensor run(const torch::Tensor& tokens, std::vector<torch::Tensor>* maps);

  ModelConfig config_;
  torch::nn::Embedding token_embedding_{nullptr};
  torch::nn::Embedding position_embedding_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(AttentionModel);

}  // namespace attnkit::train
