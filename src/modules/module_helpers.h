#pragma once

// Tensor plumbing shared by the modules: the causal `mask` buffer, the head split/merge and
// the decode steps' projections.

#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/decode.h"
#include "core/base/checks.h"

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
/// Refused before it is made when it would exceed attnkit's memory budget.
inline torch::Tensor causal_mask_buffer(int64_t context_length) {
  const double side = static_cast<double>(context_length);
  check_memory_budget(
      "[CausalAttention]",
      c10::str("option context_length ", context_length,
               ": the book's (context_length, context_length) float32 mask buffer"),
      4.0 * side * side,
      "MultiHeadAttention keeps no such buffer, and with .backend(AttentionBackend::kChunked) "
      "tiles its scores (num_heads 1 for one head); or raise the budget with "
      "attnkit::set_memory_budget");
  return torch::ones({context_length, context_length}).triu(/*diagonal=*/1);
}

/// The top-left (n, n) corner of a `mask` buffer as a bool tensor, true = hidden.
inline torch::Tensor mask_for(const torch::Tensor& mask_buffer, int64_t num_tokens) {
  return mask_buffer.slice(0, 0, num_tokens).slice(1, 0, num_tokens).to(torch::kBool);
}

// The decode steps' projections and a ragged step's valid tokens (public: attnkit/decode.h).
using attnkit::project;
using attnkit::ValidTokens;

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
