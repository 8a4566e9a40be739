#pragma once

// The model attnkit-train fits: token + position embeddings, then `layers` blocks of
// [x + attention(norm(x)), and with --ffn x + feed_forward(norm(x))], a final LayerNorm
// and a linear head over the vocabulary. The attention is any attnkit module.

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/cached_attention.h"
#include "attnkit/generate.h"
#include "attnkit/kv_cache.h"
#include "attnkit/mask.h"

namespace attnkit::train {

struct ModelConfig {
  std::string module = "mha";
  /// Attention backend (math | fused | chunked) of the modules that have them; empty for
  /// the others, which have one implementation.
  std::string backend;
  /// gqa: key/value groups (0: 2); 0 for every other module (mqa has one).
  int64_t kv_groups = 0;
  /// mha, mha-combined, gqa, mqa: sliding window (0: full causal attention).
  int64_t window = 0;
  /// mla: the latent width (0: the module's default, max(16, d_model / 8)).
  int64_t latent_dim = 0;
  int64_t vocab_size = 0;
  int64_t context_length = 0;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 1;
  double dropout = 0.0;
  bool ffn = false;
  /// mha, mha-combined, gqa, mqa: rotary position embeddings in every attention layer (no
  /// position embedding table then), and QK-norm (RMSNorm of queries and keys per head).
  bool rope = false;
  bool qk_norm = false;
  /// Whether the task is causal: picks mha's mask and decides which modules are allowed.
  bool causal = true;
};

/// A module made for a block: the module, and the block's callables bound to it.
struct BoundAttention {
  std::shared_ptr<torch::nn::Module> module;
  // forward_with_weights (the book's path, for attention maps) and forward (the backend's).
  std::function<functional::AttentionOutput(const torch::Tensor&, const Mask&)> attend_with_weights;
  std::function<torch::Tensor(const torch::Tensor&, const Mask&)> attend;
  // The modules with a KV cache, as the interface they share; null for the others.
  std::shared_ptr<CachedAttentionLayer> cached;
};

/// What attnkit-train knows of a --module: what it can do, and how to make it. The one
/// table (module_kinds) that the flags' checks, the trainer and the blocks read.
struct ModuleKind {
  /// Which tasks it fits.
  enum class Causality {
    kNever,   ///< no causal mask (sa-v1, sa-v2): bidirectional tasks only
    kAlways,  ///< always causal: causal tasks only
    kEither,  ///< a causal option (mha, mha-combined)
  };
  std::string name;
  Causality causality;
  /// Its heads split d_model: d_model must divide by --heads.
  bool multi_head;
  /// forward takes a mask (packed documents), and the module has backends and a KV cache.
  bool masks_backends_and_cache;
  /// --window, --rope and --qk-norm.
  bool windowed;
  /// --kv-groups (gqa; mqa has 1).
  bool kv_group_choice;
  /// --latent-dim (mla).
  bool latent;
  /// The module for a block of `config`, with the block's callables.
  std::function<BoundAttention(const ModelConfig&)> make;
};

/// Every --module, in the order --help lists them.
const std::vector<ModuleKind>& module_kinds();

/// The --module named `name`; a c10::Error naming the known ones otherwise.
const ModuleKind& module_kind(const std::string& name);

/// Whether --module has attention backends and a KV cache: mha, mha-combined and the
/// attention family (gqa, mqa, mla).
bool has_backends_and_kv_cache(const std::string& module);

/// Whether --module's forward takes a mask (packed documents): the same modules.
inline bool takes_masks(const std::string& module) {
  return has_backends_and_kv_cache(module);
}

/// Fails (one-line c10::Error) when the module does not fit the task or the sizes do not
/// fit the module, saying why.
void check_model_config(const ModelConfig& config);

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelConfig& config);
  /// (b, n, d_model) -> (b, n, d_model); `weights` gets (b, h, n, n) when not null. `mask`
  /// (packed documents) combines with the module's own; only the modules that take masks
  /// accept one (takes_masks).
  torch::Tensor forward(torch::Tensor x, const Mask& mask = {}, torch::Tensor* weights = nullptr);
  /// forward for the next n tokens, the attention reading and extending `cache`.
  torch::Tensor forward_with_cache(torch::Tensor x, KVCache& cache);
  /// The same for a right-padded batch: row r brings lengths[r] new tokens.
  torch::Tensor forward_with_cache(torch::Tensor x, KVCache& cache, const torch::Tensor& lengths);
  /// forward for the next n tokens of `sequences` (one per row) in this block's paged pool.
  torch::Tensor forward_with_cache(torch::Tensor x, PagedKVCache& pool,
                                   const std::vector<int64_t>& sequences);
  /// A cache for this block's attention; fails for modules without one.
  KVCache make_kv_cache(int64_t batch, int64_t capacity) const;
  /// A paged pool for this block's attention; fails for modules without one.
  PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const;

 private:
  // x plus the feed-forward of each token (lengths: a ragged step's valid tokens per row;
  // empty: all).
  torch::Tensor cached_feed_forward(const torch::Tensor& x, const std::vector<int64_t>& lengths);

  torch::nn::LayerNorm attention_norm_{nullptr};
  BoundAttention attention_;  // its module is registered as "attention"
  std::string module_name_;
  torch::nn::LayerNorm feed_forward_norm_{nullptr};
  torch::nn::Sequential feed_forward_{nullptr};
  // feed_forward_'s two Linear layers (the same modules), for the decode step's GEMVs.
  torch::nn::Linear feed_forward_up_{nullptr}, feed_forward_down_{nullptr};
};
TORCH_MODULE(Block);

/// Also an attnkit::CausalLanguageModel, so attnkit::generate decodes with it (with KV
/// caches for the modules that have them).
class AttentionModelImpl : public torch::nn::Module, public CausalLanguageModel {
 public:
  explicit AttentionModelImpl(const ModelConfig& config);
  /// (b, n) token ids -> (b, n, vocab_size) logits. With document_ids (b, n) (packed rows),
  /// a token attends only within its document and positions restart at each document.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& document_ids = {});
  torch::Tensor logits(const torch::Tensor& tokens) override { return forward(tokens); }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<KVCache>& caches) override;
  torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                         std::vector<KVCache>& caches) override;
  std::vector<KVCache> make_kv_caches(int64_t batch, int64_t capacity) override;
  std::vector<PagedKVCache> make_paged_kv_caches(int64_t num_pages, int64_t page_size) override;
  torch::Tensor paged_logits(const torch::Tensor& tokens, std::vector<PagedKVCache>& pools,
                             const std::vector<int64_t>& sequences) override;
  int64_t context_length() const override { return config_.context_length; }
  /// Attention weights of every layer on `tokens`: layers x (b, h, n, n).
  std::vector<torch::Tensor> attention_maps(const torch::Tensor& tokens,
                                            const torch::Tensor& document_ids = {});
  const ModelConfig& config() const { return config_; }
  /// forward from now on under LibTorch's autocast in `dtype` (attnkit::Autocast) on the
  /// tokens' device; nullopt: none. The loss and backward stay outside it.
  void set_forward_autocast(std::optional<torch::ScalarType> dtype) { forward_autocast_ = dtype; }

 private:
  torch::Tensor run(const torch::Tensor& tokens, const torch::Tensor& document_ids,
                    std::vector<torch::Tensor>* maps);
  // Token plus position embeddings of tokens (b, n) at positions (n) or (b, n).
  torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& positions);

  ModelConfig config_;
  torch::nn::Embedding token_embedding_{nullptr};
  torch::nn::Embedding position_embedding_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::LayerNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
  std::optional<torch::ScalarType> forward_autocast_;
};
TORCH_MODULE(AttentionModel);

}  // namespace attnkit::train
