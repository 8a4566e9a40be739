#pragma once

/// Helpers for a model's own decode steps, the ones attnkit's modules use around their
/// attention: a projection fast for the one or few rows of a decode step, and the valid
/// tokens of a right-padded ragged step (`forward_with_cache(x, cache, lengths)`), so that a
/// model's feed-forward and head can work on those alone. attnkit-train's model and
/// apps/tiny_gpt use them the same way.

#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace attnkit {

/// `linear(x)` for x (..., in). One row or a few on the CPU (decode steps) stream the weight
/// once for all of them (AVX2, float32); where that does not apply (no AVX2, float64), a
/// single row goes through addmv: Linear runs it as a one-row GEMM, which OpenBLAS does
/// 2-11x slower than the same product as a GEMV (GPT-2-small's weight shapes, 1 thread,
/// LibTorch 1.13 and 2.6). Anything else, and other devices: `linear(x)`.
/// Example: `auto logits = attnkit::project(head, last_hidden);`.
torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x);

/// The valid tokens of a right-padded ragged step x (b, n, f) whose row r brings
/// new_lengths[r] of them. When padding is most of the step, as in a ragged batch's refill
/// (one row's half context, the others' one token each), per-token work pays on the valid
/// tokens alone: pack() gathers them, unpack() and add_to() put results back. Otherwise, or
/// with no lengths (a uniform step), packs() is false and the step runs padded.
/// Example: `attnkit::ValidTokens valid(x, {5, 1, 1}); if (valid.packs()) y = valid.pack(x);`.
class ValidTokens {
 public:
  ValidTokens(const torch::Tensor& x, const std::vector<int64_t>& new_lengths);
  bool packs() const { return index_.defined(); }
  /// (b, n, f) -> (valid, f)
  torch::Tensor pack(const torch::Tensor& x) const;
  /// (valid, f) -> (b, n, f), zeros at the padding
  torch::Tensor unpack(const torch::Tensor& packed) const;
  /// x (b, n, f) plus packed (valid, f) at the valid tokens' places
  torch::Tensor add_to(const torch::Tensor& x, const torch::Tensor& packed) const;

 private:
  int64_t b_ = 0, n_ = 0;
  torch::Tensor index_;  // (valid)
};

/// `linear(x)` for a ragged step x (b, n, in): on its valid tokens alone where that pays
/// (ValidTokens), the padding's outputs zero.
torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x, const ValidTokens& tokens);

}  // namespace attnkit
