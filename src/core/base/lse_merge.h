#pragma once

// The one merge of attention over disjoint key sets by their log-sum-exp (lse_merge.cpp): key
// shards, context-parallel pieces and attention sinks.

#include <torch/torch.h>

#include "attnkit/attention_types.h"

namespace attnkit::detail {

/// How attention over two disjoint key sets combines, from each side's log weight (its
/// log-sum-exp; -inf: no key seen): total = logaddexp(log_weight, other), and each side's
/// share of it, exp(side - total), (..., 1) to scale its output (0 where neither side has seen
/// a key).
struct LseMerge {
  torch::Tensor total, kept, taken;
};
LseMerge lse_merge(const torch::Tensor& log_weight, const torch::Tensor& other);

/// An lse with +inf (a row that sees no key, as the kernels return it) as -inf: what the row
/// adds to a sum of exponentials.
torch::Tensor as_log_weight(const torch::Tensor& lse);

}  // namespace attnkit::detail

namespace attnkit::functional {

/// Merges a part's (out, lse) into a running (out, log_weight) in place, each side weighted by
/// exp(its lse - their logaddexp): the attention over both parts' keys. log_weight is -inf
/// where no key has been seen yet (and becomes the merged lse); a part's lse is +inf for a
/// row that saw no key, which then takes nothing from it. `out` may be of a wider dtype than
/// the part's (16-bit parts merged in float32).
void merge_into(torch::Tensor& out, torch::Tensor& log_weight, const AttentionWithLse& part);

}  // namespace attnkit::functional
