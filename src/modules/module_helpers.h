#pragma once

// Tensor plumbing shared by the modules: the causal `mask` buffer and the head split/merge.

#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/few_rows_linear.h"

namespace attnkit::detail {

/// Option values for pretty_print, independent of the caller's stream flags
/// (std::fixed, std::boolalpha) so the printed text is always the same.
inline std::string option_text(double value) {
  std::ostringstream text;
  text << value;
  return text.str();
}
inline const char* option_text(bool value) {
  return value ? "true" : "false";
}
inline std::string option_text(const c10::optional<int64_t>& value) {
  return value.has_value() ? std::to_string(*value) : "none";
}

/// The book's buffer: `torch.triu(torch.ones(L, L), diagonal=1)`, float, 1 above the diagonal.
inline torch::Tensor causal_mask_buffer(int64_t context_length) {
  return torch::ones({context_length, context_length}).triu(/*diagonal=*/1);
}

/// The top-left (n, n) corner of a `mask` buffer as a bool mask for `SdpaOptions::attn_mask`.
inline torch::Tensor mask_for(const torch::Tensor& mask_buffer, int64_t num_tokens) {
  return mask_buffer.slice(0, 0, num_tokens).slice(1, 0, num_tokens).to(torch::kBool);
}

/// `linear(x)` for x (..., in). One row or a few on the CPU (decode steps) go through
/// few_rows_linear_if_fits, which streams the weight once for all of them; where it does not
/// apply (no AVX2, float64), a single row goes through addmv: Linear runs it as a one-row
/// GEMM, which OpenBLAS does 2-11x slower than the same product as a GEMV (GPT-2-small's
/// weight shapes, 1 thread, LibTorch 1.13 and 2.6).
inline torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x) {
  if (!x.device().is_cpu() || x.dim() < 1)
    return linear(x);
  const auto few_rows = few_rows_linear_if_fits(x, linear->weight, linear->bias);
  if (few_rows.defined())
    return few_rows;
  if (x.numel() != x.size(-1))
    return linear(x);
  const auto& weight = linear->weight;
  const auto& bias = linear->bias;
  const auto row = x.reshape({-1});
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return (bias.defined() ? at::addmv(bias, weight, row) : at::mv(weight, row)).view(sizes);
}

/// The valid tokens of a right-padded ragged step x (b, n, f) whose row r brings
/// new_lengths[r] of them. When padding is most of the step, as in a ragged batch's refill
/// (one row's half context, the others' one token each), per-token work pays on the valid
/// tokens alone: pack() gathers them, unpack() and add_to() put results back. Otherwise, or
/// with no lengths (a uniform step), packs() is false and the step runs padded.
class ValidTokens {
 public:
  ValidTokens(const torch::Tensor& x, const std::vector<int64_t>& new_lengths) {
    if (new_lengths.empty() || x.dim() != 3 ||
        x.size(0) != static_cast<int64_t>(new_lengths.size()))
      return;
    b_ = x.size(0);
    n_ = x.size(1);
    std::vector<int64_t> valid;  // indices into the (b * n) tokens
    for (int64_t r = 0; r < b_; ++r) {
      for (int64_t i = 0; i < new_lengths[r]; ++i)
        valid.push_back(r * n_ + i);
    }
    if (2 * static_cast<int64_t>(valid.size()) <= b_ * n_)
      index_ = torch::tensor(valid, torch::kInt64).to(x.device());
  }
  bool packs() const { return index_.defined(); }
  /// (b, n, f) -> (valid, f)
  torch::Tensor pack(const torch::Tensor& x) const {
    return x.reshape({b_ * n_, x.size(2)}).index_select(0, index_);
  }
  /// (valid, f) -> (b, n, f), zeros at the padding
  torch::Tensor unpack(const torch::Tensor& packed) const {
    return torch::zeros({b_ * n_, packed.size(1)}, packed.options())
        .index_copy_(0, index_, packed)
        .view({b_, n_, packed.size(1)});
  }
  /// x (b, n, f) plus packed (valid, f) at the valid tokens' places
  torch::Tensor add_to(const torch::Tensor& x, const torch::Tensor& packed) const {
    return x.reshape({b_ * n_, x.size(2)}).index_add(0, index_, packed).view(x.sizes());
  }

 private:
  int64_t b_ = 0, n_ = 0;
  torch::Tensor index_;  // (valid)
};

/// `linear(x)` for a ragged step x (b, n, in): on its valid tokens alone where that pays
/// (ValidTokens), the padding's outputs zero.
inline torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x,
                             const ValidTokens& tokens) {
  if (!tokens.packs())
    return project(linear, x);
  return tokens.unpack(project(linear, tokens.pack(x)));
}

/// (b, n, h * hd) -> (b, h, n, hd)
inline torch::Tensor split_heads(const torch::Tensor& x, int64_t num_heads) {
  const auto b = x.size(0);
  const auto n = x.size(1);
  // (b, n, h * hd) -> (b, n, h, hd) -> (b, h, n, hd)
  return x.view({b, n, num_heads, x.size(2) / num_heads}).transpose(1, 2);
}

/// (b, h, n, hd) -> (b, n, h * hd)
inline torch::Tensor merge_heads(const torch::Tensor& x) {
  const auto b = x.size(0);
  const auto n = x.size(2);
  // (b, h, n, hd) -> (b, n, h, hd) -> (b, n, h * hd)
  return x.transpose(1, 2).contiguous().view({b, n, x.size(1) * x.size(3)});
}

}  // namespace attnkit::detail
