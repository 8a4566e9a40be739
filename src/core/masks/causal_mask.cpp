// functional::causal_mask (attnkit/mask.h): the book's dense causal mask, as a bool tensor.

#include "attnkit/mask.h"

#include "core/base/checks.h"

namespace attnkit::functional {

torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys, const torch::Device& device,
                          int64_t query_offset, c10::optional<int64_t> window_size) {
  TORCH_CHECK(num_queries >= 0 && num_keys >= 0,
              "[causal_mask] sizes must be >= 0, got num_queries = ", num_queries,
              ", num_keys = ", num_keys);
  detail::check_query_offset("[causal_mask]", query_offset);
  detail::check_window_size("[causal_mask]", window_size, /*is_causal=*/true);
  const auto ones = torch::ones({num_queries, num_keys}, torch::dtype(torch::kBool).device(device));
  // Row i is masked from column query_offset + i + 1 on.
  auto mask = ones.triu(/*diagonal=*/1 + query_offset);
  if (window_size.has_value()) {
    // ... and up to column query_offset + i - window_size.
    mask.logical_or_(ones.tril(/*diagonal=*/query_offset - *window_size));
  }
  return mask;
}

}  // namespace attnkit::functional
