#pragma once

/// Multi-head attention three ways: the book's wrapper around CausalAttention heads, the
/// book's MultiHeadAttention (one projection per Q/K/V split into heads), and a variant with
/// a single combined QKV projection as in seed 001's multi-head layer.

#include <torch/torch.h>

#include "attnkit/causal_attention.h"
#include "attnkit/functional.h"
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

/// Python `MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)`:
/// Linear `W_query`, `W_key`, `W_value` (d_in -> d_out), split into `num_heads` heads of width
/// d_out / num_heads, attention per head, heads merged, then Linear `out_proj` (d_out -> d_out,
/// with bias). With `causal(false)` no mask is applied (encoder self-attention). Input
/// (b, n, d_in); output (b, n, d_out). The Python class's `mask` buffer is not kept (n^2
/// memory that nothing reads): `attnkit::state_dict` makes it at save time, so Python's strict
/// load takes the file, and a load ignores it.
/// Example: `MultiHeadAttention mha(MultiHeadAttentionOptions(768, 768, 1024, 0.1, 12));`
class MultiHeadAttentionImpl : public torch::nn::Cloneable<MultiHeadAttentionImpl>,
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
  /// Re-initialises the projections.
  void reset_parameters();
  /// `attnkit::MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0, num_heads=2,
  /// qkv_bias=false, causal=true)`
  void pretty_print(std::ostream& stream) const override;
  /// The Python class's `mask` buffer: triu(ones(context_length, context_length), 1) in the
  /// parameters' dtype, for the state dict (PythonOnlyState).
  std::vector<std::pair<std::string, torch::Tensor>> python_only_state() const override;
  /// {"mask"}, without making the n^2 buffer.
  std::vector<std::string> python_only_keys() const override { return {"mask"}; }

  /// Self-attention `forward(x)`: (b, n, d_in) -> (b, n, d_out). Cross-attention
  /// `forward(query, key, value)`: queries from query (b, n, d_in), keys and values from
  /// key and value (b, m, d_in) (value defaults to key; m may differ from n). `mask`
  /// (docs/masks.md) combines with the module's own causal and window settings, e.g.
  /// `Mask::key_padding(lengths)` for padded batches or `Mask::documents(ids)` for packed
  /// ones. Computed by `options.backend()`. With `rope`, self-attention only (token i at
  /// position i); `qk_norm` normalises the heads in both.
  /// Example: `mha->forward(x, {}, {}, attnkit::Mask::key_padding(lengths))`.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key = {},
                        const torch::Tensor& value = {}, const Mask& mask = {});

  /// `forward`, also returning the attention weights (b, num_heads, n, m); always the math
  /// path, since the other backends never form the weights.
  functional::AttentionOutput forward_with_weights(const torch::Tensor& query,
                                                   const torch::Tensor& key = {},
                                                   const torch::Tensor& value = {},
                                                   const Mask& mask = {});

  /// A KV cache for `forward_with_cache`: `batch` sequences of up to `capacity` positions
  /// (0: context_length, the most the module accepts), num_heads heads of
  /// d_out / num_heads, in the parameters' dtype and on their device.
  KVCache make_kv_cache(int64_t batch, int64_t capacity = 0) const;

  /// Inference with a KV cache: x (b, n, d_in) holds the next n tokens of b sequences, at
  /// positions [cache.size(), cache.size() + n). Their keys and values are appended to the
  /// cache and their queries attend to every position held, with the causal mask aligned
  /// bottom-right. Returns (b, n, d_out): the rows of forward() over the whole sequence, for
  /// a prompt at once (prefill), in pieces, or a token at a time; computed by
  /// `options.backend()`. `mask` combines with the causal one; its query index is the row of
  /// x and its key index the position in the cache (0 .. cache.size() + n), e.g.
  /// `Mask::key_padding` over those positions. With `rope`, the new queries and keys are
  /// rotated at their positions before the keys enter the cache. Runs without autograd. Fails
  /// (c10::Error) in training mode, with causal(false), with a mask on a rolling cache, and
  /// when the positions would pass context_length, rope's context_length or the capacity.
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
  // forward(x) keeps working through torch::nn::AnyModule and Sequential.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(Mask())})
};

/// Module holder for `MultiHeadAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadAttention);

/// Multi-head attention with one combined projection `qkv` = Linear(d_in, 3 * d_out), as in
/// seed 001's multi-head layer, then `out_proj`, as in MultiHeadAttention.
///
/// Layout of `qkv`'s 3 * d_out output features (seed 001's): grouped by head, and within a
/// head query, key, value: feature `h * 3 * hd + j * hd + i` is element i of head h of
/// j = 0 query, 1 key, 2 value. So `qkv(x).view({b, n, h, 3 * hd})` chunked in three along
/// the last dimension gives each head's q, k, v.
/// Example: `MultiHeadAttentionCombinedQKV mha(MultiHeadAttentionOptions(64, 64, 32, 0.0, 4));`
class MultiHeadAttentionCombinedQKVImpl
    : public torch::nn::Cloneable<MultiHeadAttentionCombinedQKVImpl>,
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
  /// Re-initialises the projections.
  void reset_parameters();
  /// `attnkit::MultiHeadAttentionCombinedQKV(d_in=3, d_out=2, ..., causal=true)`
  void pretty_print(std::ostream& stream) const override;
  /// The Python class's `mask` buffer: triu(ones(context_length, context_length), 1) in the
  /// parameters' dtype, for the state dict (PythonOnlyState).
  std::vector<std::pair<std::string, torch::Tensor>> python_only_state() const override;
  /// {"mask"}, without making the n^2 buffer.
  std::vector<std::string> python_only_keys() const override { return {"mask"}; }

  /// Self-attention (b, n, d_in) -> (b, n, d_out) under the module's mask and `mask`, computed
  /// by `options.backend()`. One projection makes queries, keys and values from one input, so
  /// a `key` or `value` is refused (c10::Error): MultiHeadAttention does cross-attention. The
  /// signature is MultiHeadAttention's, so the two modules swap.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key = {},
                        const torch::Tensor& value = {}, const Mask& mask = {});

  /// `forward`, also returning the attention weights (b, num_heads, n, n); the math path.
  functional::AttentionOutput forward_with_weights(const torch::Tensor& query,
                                                   const torch::Tensor& key = {},
                                                   const torch::Tensor& value = {},
                                                   const Mask& mask = {});

  /// A KV cache for `forward_with_cache`: `batch` sequences of up to `capacity` positions
  /// (0: context_length, the most the module accepts), num_heads heads of
  /// d_out / num_heads, in the parameters' dtype and on their device.
  KVCache make_kv_cache(int64_t batch, int64_t capacity = 0) const;

  /// Inference with a KV cache, as MultiHeadAttention's: x (b, n, d_in) holds the next n tokens of
  /// b sequences, at positions [cache.size(), cache.size() + n). Their keys and values are appended
  /// to the cache and their queries attend to every position held, with the causal mask aligned
  /// bottom-right. Returns (b, n, d_out): the rows of forward() over the whole sequence, for
  /// a prompt at once (prefill), in pieces, or a token at a time; computed by
  /// `options.backend()`. `mask` as in MultiHeadAttention's. Runs without autograd. Fails
  /// (c10::Error) in training mode, with causal(false), with a mask on a rolling cache, and
  /// when the positions would pass context_length or the capacity.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache, const Mask& mask = {});

  /// A right-padded batch whose rows hold different numbers of new tokens: row r's first
  /// lengths[r] tokens of x (b, n, d_in), `lengths` a (b) int64 tensor with entries in [0, n],
  /// sit at positions [cache.lengths()[r], cache.lengths()[r] + lengths[r]) of its own
  /// sequence, so a batch of prompts of different lengths is prefilled and decoded together.
  /// Each row's outputs at its valid tokens equal that row run alone; those at padding are
  /// finite and meaningless. Every cache kind, a rolling one too.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache,
                                   const torch::Tensor& lengths, const Mask& mask = {});

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
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(Mask())})
};

/// Module holder for `MultiHeadAttentionCombinedQKVImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadAttentionCombinedQKV);

}  // namespace attnkit
