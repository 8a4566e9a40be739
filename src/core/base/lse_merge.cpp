#include "core/base/lse_merge.h"

#include <limits>

namespace attnkit::detail {

LseMerge lse_merge(const torch::Tensor& log_weight, const torch::Tensor& other) {
  auto total = torch::logaddexp(log_weight, other);
  // (..., n) -> (..., n, 1); 0 where neither side has seen a key (-inf - -inf is nan).
  auto kept = (log_weight - total).exp().nan_to_num(0.0).unsqueeze(-1);
  auto taken = (other - total).exp().nan_to_num(0.0).unsqueeze(-1);
  return {std::move(total), std::move(kept), std::move(taken)};
}

torch::Tensor as_log_weight(const torch::Tensor& lse) {
  return lse.masked_fill(lse.isposinf(), -std::numeric_limits<double>::infinity());
}

}  // namespace attnkit::detail

namespace attnkit::functional {

void merge_into(torch::Tensor& out, torch::Tensor& log_weight, const AttentionWithLse& part) {
  const auto merge = detail::lse_merge(log_weight, detail::as_log_weight(part.lse));
  // A 16-bit part's output before its rounding, where it has one.
  const auto& part_out = part.out_for_backward.defined() ? part.out_for_backward : part.out;
  out.mul_(merge.kept.to(out.scalar_type()))
      .addcmul_(part_out.to(out.scalar_type()), merge.taken.to(out.scalar_type()));
  log_weight.copy_(merge.total);
}

}  // namespace attnkit::functional
