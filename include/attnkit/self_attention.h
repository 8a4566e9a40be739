#pragma once

/// Self-attention with trainable weights and no mask: the notebooks'
/// `SelfAttention_v1` (raw parameter matrices) and `SelfAttention_v2` (Linear layers).

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/options.h"

namespace attnkit {

class SelfAttentionV2Impl;

/// Python `SelfAttention_v1`: parameters `W_query`, `W_key`, `W_value` of shape (d_in, d_out),
/// initialised with `torch::rand` in that order, so `torch::manual_seed(123)` gives the book's
/// weights. Input (n, d_in) or (b, n, d_in); output (n, d_out) or (b, n, d_out).
/// Example: `torch::manual_seed(123); SelfAttentionV1 sa(3, 2); auto z = sa(inputs);`
class SelfAttentionV1Impl : public torch::nn::Cloneable<SelfAttentionV1Impl> {
 public:
  /// Positional arguments in the order of the Python constructor.
  SelfAttentionV1Impl(int64_t d_in, int64_t d_out)
      : SelfAttentionV1Impl(SelfAttentionV1Options(d_in, d_out)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit SelfAttentionV1Impl(const SelfAttentionV1Options& options);

  /// Registers the three weight matrices and initialises them.
  void reset() override;
  /// Re-draws the weights from U[0, 1), as `torch.rand` does.
  void reset_parameters();
  /// `attnkit::SelfAttentionV1(d_in=3, d_out=2)`
  void pretty_print(std::ostream& stream) const override;

  /// (n, d_in) -> (n, d_out), or (b, n, d_in) -> (b, n, d_out).
  torch::Tensor forward(const torch::Tensor& x);

  /// Context as `forward` and the attention weights (n, n) or (b, n, n).
  functional::AttentionOutput forward_with_weights(const torch::Tensor& x);

  /// Copies a bias-free SelfAttentionV2's weights (transposed) into this module, after which
  /// both give the same output (the notebook's exercise). Fails on a size or bias mismatch.
  void copy_weights_from(const SelfAttentionV2Impl& v2);

  /// The options this module was built with (reset() re-reads them).
  SelfAttentionV1Options options;
  /// (d_in, d_out)
  torch::Tensor W_query;
  /// (d_in, d_out)
  torch::Tensor W_key;
  /// (d_in, d_out)
  torch::Tensor W_value;
};

/// Module holder for `SelfAttentionV1Impl` (shared-pointer semantics).
TORCH_MODULE(SelfAttentionV1);

/// Python `SelfAttention_v2`: `torch::nn::Linear` submodules `W_query`, `W_key`, `W_value`
/// created in that order, so `torch::manual_seed(789)` gives the book's weights.
/// Input (n, d_in) or (b, n, d_in); output (n, d_out) or (b, n, d_out).
/// Example: `torch::manual_seed(789); SelfAttentionV2 sa(3, 2); auto z = sa(inputs);`
class SelfAttentionV2Impl : public torch::nn::Cloneable<SelfAttentionV2Impl> {
 public:
  /// Positional arguments in the order of the Python constructor.
  SelfAttentionV2Impl(int64_t d_in, int64_t d_out, bool qkv_bias = false)
      : SelfAttentionV2Impl(SelfAttentionV2Options(d_in, d_out).qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit SelfAttentionV2Impl(const SelfAttentionV2Options& options);

  /// Registers the three projections (each initialised as `torch::nn::Linear` does).
  void reset() override;
  /// Re-initialises the projections.
  void reset_parameters();
  /// `attnkit::SelfAttentionV2(d_in=3, d_out=2, qkv_bias=false)`
  void pretty_print(std::ostream& stream) const override;

  /// (n, d_in) -> (n, d_out), or (b, n, d_in) -> (b, n, d_out).
  torch::Tensor forward(const torch::Tensor& x);

  /// Context as `forward` and the attention weights (n, n) or (b, n, n).
  functional::AttentionOutput forward_with_weights(const torch::Tensor& x);

  /// The options this module was built with (reset() re-reads them).
  SelfAttentionV2Options options;
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Key projection, d_in -> d_out.
  torch::nn::Linear W_key{nullptr};
  /// Value projection, d_in -> d_out.
  torch::nn::Linear W_value{nullptr};
};

/// Module holder for `SelfAttentionV2Impl` (shared-pointer semantics).
TORCH_MODULE(SelfAttentionV2);

}  // namespace attnkit
