// The notebooks' teaching steps (attnkit/book_steps.h).

#include "attnkit/book_steps.h"

#include <cmath>
#include <limits>

#include "attnkit/attention.h"
#include "core/base/checks.h"
#include "core/kernels/math_kernel.h"

namespace attnkit::functional {

using detail::shape_string;

torch::Tensor attention_scores(const torch::Tensor& queries, const torch::Tensor& keys) {
  TORCH_CHECK(keys.dim() >= 2, "[attention_scores] keys: expected at least 2-D (..., m, d), got ",
              keys.dim(), "-D with shape ", shape_string(keys));
  TORCH_CHECK(queries.size(-1) == keys.size(-1),
              "[attention_scores] queries and keys must have the same last dimension, got "
              "queries ",
              shape_string(queries), " and keys ", shape_string(keys));
  // (..., m, d) -> (..., d, m)
  return torch::matmul(queries, keys.transpose(-2, -1));
}

torch::Tensor normalize_by_sum(const torch::Tensor& attn_scores) {
  return attn_scores / attn_scores.sum(-1, /*keepdim=*/true);
}

torch::Tensor softmax_weights(const torch::Tensor& attn_scores) {
  return torch::softmax(attn_scores, -1);
}

torch::Tensor context_vectors(const torch::Tensor& attn_weights, const torch::Tensor& values) {
  TORCH_CHECK(attn_weights.size(-1) == values.size(values.dim() >= 2 ? -2 : -1),
              "[context_vectors] attn_weights has ", attn_weights.size(-1),
              " keys per row but values has ", values.size(values.dim() >= 2 ? -2 : -1),
              " rows (attn_weights ", shape_string(attn_weights), ", values ", shape_string(values),
              ")");
  return torch::matmul(attn_weights, values);
}

torch::Tensor simple_self_attention(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3,
              "[simple_self_attention] x: expected (num_tokens, d) or (b, num_tokens, d), got ",
              x.dim(), "-D with shape ", shape_string(x));
  return context_vectors(softmax_weights(attention_scores(x, x)), x);
}

torch::Tensor causal_weights_by_renormalizing(const torch::Tensor& attn_weights) {
  const auto n = attn_weights.size(-1);
  const auto keep = torch::ones({attn_weights.size(-2), n}, attn_weights.options()).tril();
  const auto masked = attn_weights * keep;
  return masked / masked.sum(-1, /*keepdim=*/true);
}

torch::Tensor causal_weights_by_masking(const torch::Tensor& attn_scores, int64_t d_k) {
  TORCH_CHECK(d_k > 0, "[causal_weights_by_masking] d_k must be > 0, got ", d_k);
  const auto mask = causal_mask(attn_scores.size(-2), attn_scores.size(-1), attn_scores.device());
  const auto masked = attn_scores.masked_fill(mask, -std::numeric_limits<double>::infinity());
  return torch::softmax(masked / std::sqrt(static_cast<double>(d_k)), -1);
}

torch::Tensor dropout_weights(const torch::Tensor& attn_weights, double p, bool training) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "[dropout_weights] p must be in [0, 1), got ", p);
  return detail::attention_dropout(attn_weights, p, training);
}

}  // namespace attnkit::functional
