#pragma once

/// Grouped-query attention (Llama 2/3, Qwen3, Gemma 3), with multi-query attention as its
/// one-group case and an optional sliding window (Mistral, Gemma 3): the chapter-4 bonus
/// material's `GroupedQueryAttention`, trainable, with a KV cache of only the key/value heads.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/cached_attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"
#include "attnkit/rms_norm.h"
#include "attnkit/rope.h"

namespace attnkit {

/// Python `GroupedQueryAttention(d_in, d_out, dropout, num_heads, num_kv_groups,
/// qkv_bias=False)`: Linear `W_key`, `W_value` (d_in -> num_kv_groups * head_dim), `W_query`
/// (d_in -> d_out), created in that order, and `out_proj` (d_out -> output_dim, no bias;
/// output_dim is d_out unless set), with head_dim = d_out / num_heads. Query head h attends with
/// key/value head h / (num_heads / num_kv_groups) (`repeat_interleave` order). Causal; with
/// `sliding_window_size` W each token sees itself and the W - 1 before it.
/// Input (b, n, d_in); output (b, n, output_dim); forward, forward_with_weights and
/// forward_with_cache are CachedAttentionLayer's (attnkit/cached_attention.h).
/// Example: `GroupedQueryAttention gqa(GroupedQueryAttentionOptions(768, 768, 0.0, 12, 4));`
class GroupedQueryAttentionImpl : public CachedAttentionModule<GroupedQueryAttentionImpl> {
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
  /// `attnkit::GroupedQueryAttention(d_in=..., num_kv_groups=..., sliding_window_size=none, ...)`
  void pretty_print(std::ostream& stream) const override;

  /// A KV cache for `forward_with_cache` holding num_kv_groups heads: `batch` sequences of up
  /// to `capacity` (>= 1) positions; with a sliding window a rolling cache of
  /// sliding_window_size positions instead, whatever `capacity` says.
  KVCache make_kv_cache(int64_t batch, int64_t capacity) const override;
  /// A paged pool of num_kv_groups heads for forward_with_cache(x, cache, sequences); a
  /// sliding window frees the pages it leaves.
  PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const override;

  /// The options this module was built with (reset() re-reads them).
  GroupedQueryAttentionOptions options;
  /// Key projection, d_in -> num_kv_groups * head_dim.
  torch::nn::Linear W_key{nullptr};
  /// Value projection, d_in -> num_kv_groups * head_dim.
  torch::nn::Linear W_value{nullptr};
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Output projection after the heads are merged, d_out -> output_dim, no bias.
  torch::nn::Linear out_proj{nullptr};
  /// With `qk_norm`: RMSNorm over each query head and each key head (head_dim); otherwise
  /// empty.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  /// With `rope`: the tables queries and keys are rotated by; otherwise undefined.
  detail::RopeTables rope_tables;
  /// With `sinks`: each query head's sink logit, (num_heads); otherwise undefined.
  torch::Tensor sinks;

 protected:
  // Keys and values stay num_kv_groups heads wide: the kernels read each for its group of
  // query heads. With `rope`, self-attention only (token i at position i), and cached
  // positions past rope's context_length are refused; `qk_norm` normalises the heads.
  functional::AttentionOutput attend_inputs(const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const Mask& mask,
                                            bool with_weights) override;
  torch::Tensor attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                  const torch::Tensor& lengths, const Mask& mask) override;
  torch::Tensor attend_paged_tokens(const torch::Tensor& x, PagedKVCache& cache,
                                    const std::vector<int64_t>& sequences,
                                    const Mask& mask) override;

 public:
  /// Re-initialises the projections and QK-norm's weights as the constructor drew them, and
  /// the sinks to zeros.
  void reset_parameters();
};

/// Module holder for `GroupedQueryAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(GroupedQueryAttention);

}  // namespace attnkit
