#pragma once

/// Single-head causal (masked) self-attention with dropout: the book's `CausalAttention`.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/options.h"

namespace attnkit {

/// Python `CausalAttention(d_in, d_out, context_length, dropout, qkv_bias=False)`:
/// `torch::nn::Linear` submodules `W_query`, `W_key`, `W_value` (created in that order, so a
/// seed gives the book's weights), a `mask` buffer (context_length, context_length) holding
/// `triu(ones, 1)`, and dropout on the attention weights in training mode.
/// Input (b, n, d_in) with n <= context_length; output (b, n, d_out).
/// Example: `CausalAttention ca(/*d_in=*/3, /*d_out=*/2, /*context_length=*/6, /*dropout=*/0.0);`
class CausalAttentionImpl : public torch::nn::Cloneable<CausalAttentionImpl> {
 public:
  /// Positional arguments in the order of the Python constructor.
  CausalAttentionImpl(int64_t d_in, int64_t d_out, int64_t context_length, double dropout,
                      bool qkv_bias = false)
      : CausalAttentionImpl(
            CausalAttentionOptions(d_in, d_out, context_length, dropout).qkv_bias(qkv_bias)) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit CausalAttentionImpl(const CausalAttentionOptions& options);

  /// Validates the options, registers the projections and the `mask` buffer.
  void reset() override;
  /// Re-initialises the projections.
  void reset_parameters();
  /// `attnkit::CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0, qkv_bias=false)`
  void pretty_print(std::ostream& stream) const override;

  /// (b, n, d_in) -> (b, n, d_out).
  torch::Tensor forward(const torch::Tensor& x);

  /// Context (b, n, d_out) and attention weights (b, n, n) as used (after dropout).
  functional::AttentionOutput forward_with_weights(const torch::Tensor& x);

  /// The options this module was built with (reset() re-reads them).
  CausalAttentionOptions options;
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Key projection, d_in -> d_out.
  torch::nn::Linear W_key{nullptr};
  /// Value projection, d_in -> d_out.
  torch::nn::Linear W_value{nullptr};
  /// (context_length, context_length), 1 above the diagonal.
  torch::Tensor mask;
};

/// Module holder for `CausalAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(CausalAttention);

}  // namespace attnkit
