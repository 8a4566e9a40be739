#pragma once

/// Grouped-query attention (Llama 2/3, Qwen3, Gemma 3), with multi-query attention as its
/// one-group case and an optional sliding window (Mistral, Gemma 3): the chapter-4 bonus
/// material's `GroupedQueryAttention`, trainable, with a KV cache of only the key/value heads.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/functional.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"
#include "attnkit/rms_norm.h"
#include "attnkit/rope.h"

namespace attnkit {

/// Python `GroupedQueryAttention(d_in, d_out, dropout, num_heads, num_kv_groups,
/// qkv_bias=False)`: Linear `W_key`, `W_value` (d_in -> num_kv_groups * head_dim), `W_query`
/// (d_in -> d_out), created in that order, and `out_proj` (d_out -> d_out, no bias), with
/// head_dim = d_out / num_heads. Query head h attends with key/value head
/// h / (num_heads / num_kv_groups) (`repeat_interleave` order). Causal; with
/// `sliding_window_size` W each token sees itself and the W - 1 before it.
/// Input (b, n, d_in); output (b, n, d_out).
/// Example: `GroupedQueryAttention gqa(GroupedQueryAttentionOptions(768, 768, 0.0, 12, 4));`
class GroupedQueryAttentionImpl : public torch::nn::Cloneable<GroupedQueryAttentionImpl> {
 public:
  /// Positional arguments in the order of the Python constructor.
  GroupedQueryAttentionImpl(int64_t d_in, int64_t d_out, double dropout, int64_t num_heads,
                            int64_t num_kv_groups, bool qkv_bias = false)
      : GroupedQueryAttentionImpl(
            GroupedQueryAttentionOptions(d_in, d_out, dropout, num_heads, num_kv_groups)
                .qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit GroupedQueryAttentionImpl(const GroupedQueryAttentionOptions& options);

  /// Validates the options and registers the projections.
  void reset() override;
  /// Re-initialises the projections.
  void reset_parameters();
  /// `attnkit::GroupedQueryAttention(d_in=..., num_kv_groups=..., sliding_window_size=none, ...)`
  void pretty_print(std::ostream& stream) const override;

  /// Self-attention `forward(x)`: (b, n, d_in) -> (b, n, d_out); cross-attention
  /// `forward(query, key, value)` with keys and values from key and value (b, m, d_in), value
  /// defaulting to key. `mask` (docs/masks.md) combines with the causal and window mask, as
  /// in MultiHeadAttention. Computed by `options.backend()`. With `rope`, self-attention only
  /// (token i at position i); `qk_norm` normalises the heads in both.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key = {},
                        const torch::Tensor& value = {}, const Mask& mask = {});

  /// `forward`, also returning the attention weights (b, num_heads, n, m); the math path.
  functional::AttentionOutput forward_with_weights(const torch::Tensor& query,
                                                   const torch::Tensor& key = {},
                                                   const torch::Tensor& value = {},
                                                   const Mask& mask = {});

  /// A KV cache for `forward_with_cache` holding num_kv_groups heads: `batch` sequences of up
  /// to `capacity` (>= 1) positions; with a sliding window a rolling cache of
  /// sliding_window_size positions instead, whatever `capacity` says.
  KVCache make_kv_cache(int64_t batch, int64_t capacity) const;

  /// Inference with a KV cache, as `MultiHeadAttention::forward_with_cache`: x (b, n, d_in)
  /// holds the next n tokens; returns the rows forward() gives them over the whole sequence.
  /// `mask` as there: query index the row of x, key index the position in the cache; refused
  /// on a rolling cache. With `rope`, new queries and keys are rotated at their positions
  /// before the keys enter the cache; positions past rope's context_length are refused.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache, const Mask& mask = {});

  /// A right-padded batch whose rows hold different numbers of new tokens: row r's first
  /// lengths[r] tokens of x (b, n, d_in), `lengths` a (b) int64 tensor with entries in [0, n],
  /// sit at positions [cache.lengths()[r], cache.lengths()[r] + lengths[r]) of its own
  /// sequence, so a batch of prompts of different lengths is prefilled and decoded together.
  /// Each row's outputs at its valid tokens equal that row run alone; those at padding are
  /// finite and meaningless. Every cache kind, a rolling one too.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache,
                                   const torch::Tensor& lengths, const Mask& mask = {});

  /// The options this module was built with (reset() re-reads them).
  GroupedQueryAttentionOptions options;
  /// Key projection, d_in -> num_kv_groups * head_dim.
  torch::nn::Linear W_key{nullptr};
  /// Value projection, d_in -> num_kv_groups * head_dim.
  torch::nn::Linear W_value{nullptr};
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Output projection after the heads are merged, d_out -> d_out, no bias.
  torch::nn::Linear out_proj{nullptr};
  /// With `qk_norm`: RMSNorm over each query head and each key head (head_dim); otherwise
  /// empty.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  /// With `rope`: the tables queries and keys are rotated by; otherwise undefined.
  detail::RopeTables rope_tables;

 protected:
  // forward(x) keeps working through torch::nn::AnyModule and Sequential.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(Mask())})
};

/// Module holder for `GroupedQueryAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(GroupedQueryAttention);

}  // namespace attnkit
