#pragma once

/// Multi-head attention three ways: the book's wrapper around CausalAttention heads, the
/// book's MultiHeadAttention (one projection per Q/K/V split into heads), and a variant with
/// a single combined QKV projection as in seed 001's multi-head layer.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/cached_attention.h"
#include "attnkit/causal_attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"
#include "attnkit/python_state.h"
#include "attnkit/rms_norm.h"
#include "attnkit/rope.h"

namespace attnkit {

/// Python `MultiHeadAttentionWrapper(d_in, d_out, context_length, dropout, num_heads,
/// qkv_bias=False)`: a `heads` ModuleList of `num_heads` CausalAttention(d_in, d_out, ...)
/// whose outputs are concatenated. Input (b, n, d_in); output (b, n, d_out * num_heads).
/// Example: `MultiHeadAttentionWrapper mha(3, 2, 6, 0.0, /*num_heads=*/2);  // output width 4`
class MultiHeadAttentionWrapperImpl : public torch::nn::Cloneable<MultiHeadAttentionWrapperImpl> {
 public:
  /// Positional arguments in the order of the Python constructor.
  MultiHeadAttentionWrapperImpl(int64_t d_in, int64_t d_out, int64_t context_length, double dropout,
                                int64_t num_heads, bool qkv_bias = false)
      : MultiHeadAttentionWrapperImpl(
            MultiHeadAttentionWrapperOptions(d_in, d_out, context_length, dropout, num_heads)
                .qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit MultiHeadAttentionWrapperImpl(const MultiHeadAttentionWrapperOptions& options);

  /// Validates the options and registers the heads.
  void reset() override;
  /// Re-initialises every head.
  void reset_parameters();
  /// `attnkit::MultiHeadAttentionWrapper(d_in=3, d_out=2, context_length=6, dropout=0,
  /// num_heads=2, qkv_bias=false)`
  void pretty_print(std::ostream& stream) const override;

  /// (b, n, d_in) -> (b, n, d_out * num_heads).
  torch::Tensor forward(const torch::Tensor& x);

  /// Context (b, n, d_out * num_heads) and attention weights (b, num_heads, n, n).
  functional::AttentionOutput forward_with_weights(const torch::Tensor& x);

  /// The options this module was built with (reset() re-reads them).
  MultiHeadAttentionWrapperOptions options;
  /// `num_heads` CausalAttention modules.
  torch::nn::ModuleList heads{nullptr};
};

/// Module holder for `MultiHeadAttentionWrapperImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadAttentionWrapper);

/// The longest context_length whose book `mask` buffer (n^2 values) a state dict holds: 4096,
/// 64 MiB in float32. Beyond it the buffer would cost far more than the weights (1 GiB at
/// 16,384; 64 GiB at 131,072), so `mask_omitted` says why it is absent instead.
constexpr int64_t kLongestContextWithSavedMask = 4096;

/// Python `MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)`:
/// Linear `W_query`, `W_key`, `W_value` (d_in -> d_out), split into `num_heads` heads of width
/// d_out / num_heads, attention per head, heads merged, then Linear `out_proj` (d_out -> d_out,
/// with bias). With `causal(false)` no mask is applied (encoder self-attention). Input
/// (b, n, d_in); output (b, n, d_out). The Python class's `mask` buffer is not kept (n^2
/// memory that nothing reads): `attnkit::state_dict` makes it at save time, so Python's strict
/// load takes the file, and a load ignores it. forward, forward_with_weights and
/// forward_with_cache are CachedAttentionLayer's (attnkit/cached_attention.h), each call
/// within context_length tokens.
/// Example: `MultiHeadAttention mha(MultiHeadAttentionOptions(768, 768, 1024, 0.1, 12));`
class MultiHeadAttentionImpl : public CachedAttentionModule<MultiHeadAttentionImpl>,
                               public PythonOnlyState {
 public:
  /// Positional arguments in the order of the Python constructor.
  MultiHeadAttentionImpl(int64_t d_in, int64_t d_out, int64_t context_length, double dropout,
                         int64_t num_heads, bool qkv_bias = false)
      : MultiHeadAttentionImpl(
            MultiHeadAttentionOptions(d_in, d_out, context_length, dropout, num_heads)
                .qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options);

  /// Validates the options and registers the projections.
  void reset() override;
  /// `attnkit::MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0, num_heads=2,
  /// qkv_bias=false, causal=true)`
  void pretty_print(std::ostream& stream) const override;
  /// The Python class's `mask` buffer: triu(ones(context_length, context_length), 1) in the
  /// parameters' dtype, for the state dict (PythonOnlyState), up to
  /// kLongestContextWithSavedMask; beyond, where the n^2 buffer would outweigh any weights,
  /// `mask_omitted` instead, a uint8 text saying why (docs/interop.md).
  std::vector<std::pair<std::string, torch::Tensor>> python_only_state() const override;
  /// {"mask", "mask_omitted"}, without making the n^2 buffer.
  std::vector<std::string> python_only_keys() const override { return {"mask", "mask_omitted"}; }

  /// A KV cache for `forward_with_cache`: `batch` sequences of up to `capacity` positions
  /// (0: context_length, the most the module accepts), num_heads heads of
  /// d_out / num_heads, in the parameters' dtype and on their device; with a sliding window a
  /// rolling cache of sliding_window_size positions.
  KVCache make_kv_cache(int64_t batch, int64_t capacity = 0) const override;
  /// A paged pool for forward_with_cache(x, cache, sequences), num_heads heads of
  /// d_out / num_heads; a sliding window frees the pages it leaves.
  PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const override;

  /// The options this module was built with (reset() re-reads them).
  MultiHeadAttentionOptions options;
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Key projection, d_in -> d_out.
  torch::nn::Linear W_key{nullptr};
  /// Value projection, d_in -> d_out.
  torch::nn::Linear W_value{nullptr};
  /// Output projection after the heads are merged, d_out -> d_out, with bias.
  torch::nn::Linear out_proj{nullptr};
  /// With `qk_norm`: RMSNorm over each query head and each key head (d_out / num_heads);
  /// otherwise empty.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  /// With `rope`: the tables queries and keys are rotated by; otherwise undefined.
  detail::RopeTables rope_tables;

 protected:
  // Self-attention on a backend other than kMath projects with one GEMM over the three
  // weights stacked, which the kernels may read in place; kMath and cross-attention project
  // three times, as Python does. With `rope`, self-attention only (token i at position i);
  // `qk_norm` normalises the heads in both.
  functional::AttentionOutput attend_inputs(const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const Mask& mask,
                                            bool with_weights) override;
  // With `rope`, the new queries and keys are rotated at their positions before the keys
  // enter the cache. Refused with causal(false), and past context_length or rope's.
  torch::Tensor attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                  const torch::Tensor& lengths, const Mask& mask) override;
  torch::Tensor attend_paged_tokens(const torch::Tensor& x, PagedKVCache& cache,
                                    const std::vector<int64_t>& sequences,
                                    const Mask& mask) override;
};

/// Module holder for `MultiHeadAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadAttention);

/// Multi-head attention with one combined projection `qkv` = Linear(d_in, 3 * d_out), as in
/// seed 001's multi-head layer, then `out_proj`, as in MultiHeadAttention.
///
/// Layout of `qkv`'s 3 * d_out output features (seed 001's): grouped by head, and within a
/// head query, key, value: feature `h * 3 * hd + j * hd + i` is element i of head h of
/// j = 0 query, 1 key, 2 value. So `qkv(x).view({b, n, h, 3 * hd})` chunked in three along
/// the last dimension gives each head's q, k, v. Self-attention only: forward's `key` and
/// `value` are refused. The signatures are MultiHeadAttention's, so the two modules swap.
/// Example: `MultiHeadAttentionCombinedQKV mha(MultiHeadAttentionOptions(64, 64, 32, 0.0, 4));`
class MultiHeadAttentionCombinedQKVImpl
    : public CachedAttentionModule<MultiHeadAttentionCombinedQKVImpl>,
      public PythonOnlyState {
 public:
  /// Positional arguments in the order of the Python constructor.
  MultiHeadAttentionCombinedQKVImpl(int64_t d_in, int64_t d_out, int64_t context_length,
                                    double dropout, int64_t num_heads, bool qkv_bias = false)
      : MultiHeadAttentionCombinedQKVImpl(
            MultiHeadAttentionOptions(d_in, d_out, context_length, dropout, num_heads)
                .qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit MultiHeadAttentionCombinedQKVImpl(const MultiHeadAttentionCombinedQKVOptions& options);

  /// Validates the options and registers the projections.
  void reset() override;
  /// `attnkit::MultiHeadAttentionCombinedQKV(d_in=3, d_out=2, ..., causal=true)`
  void pretty_print(std::ostream& stream) const override;
  /// The Python class's `mask` buffer: triu(ones(context_length, context_length), 1) in the
  /// parameters' dtype, for the state dict (PythonOnlyState), up to
  /// kLongestContextWithSavedMask; beyond, where the n^2 buffer would outweigh any weights,
  /// `mask_omitted` instead, a uint8 text saying why (docs/interop.md).
  std::vector<std::pair<std::string, torch::Tensor>> python_only_state() const override;
  /// {"mask", "mask_omitted"}, without making the n^2 buffer.
  std::vector<std::string> python_only_keys() const override { return {"mask", "mask_omitted"}; }

  /// A KV cache for `forward_with_cache`, as MultiHeadAttention's.
  KVCache make_kv_cache(int64_t batch, int64_t capacity = 0) const override;
  /// A paged pool, as MultiHeadAttention's.
  PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const override;

  /// Copies a MultiHeadAttention's weights into `qkv` (in the layout above) and `out_proj`;
  /// both modules then compute the same function. Fails when the options differ.
  void copy_weights_from(const MultiHeadAttentionImpl& mha);

  /// The options this module was built with (reset() re-reads them).
  MultiHeadAttentionCombinedQKVOptions options;
  /// Linear(d_in, 3 * d_out), per-head [q | k | v] layout.
  torch::nn::Linear qkv{nullptr};
  /// Output projection after the heads are merged, d_out -> d_out, with bias.
  torch::nn::Linear out_proj{nullptr};
  /// With `qk_norm`: RMSNorm over each query head and each key head; otherwise empty.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  /// With `rope`: the tables queries and keys are rotated by; otherwise undefined.
  detail::RopeTables rope_tables;

 protected:
  // Self-attention only: one projection makes queries, keys and values from one input, so a
  // `key` or `value` is refused (c10::Error); MultiHeadAttention does cross-attention.
  functional::AttentionOutput attend_inputs(const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const Mask& mask,
                                            bool with_weights) override;
  torch::Tensor attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                  const torch::Tensor& lengths, const Mask& mask) override;
  torch::Tensor attend_paged_tokens(const torch::Tensor& x, PagedKVCache& cache,
                                    const std::vector<int64_t>& sequences,
                                    const Mask& mask) override;
};

/// Module holder for `MultiHeadAttentionCombinedQKVImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadAttentionCombinedQKV);

}  // namespace attnkit
