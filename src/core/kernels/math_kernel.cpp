// The math core: attention as LibTorch's dense ops, with autograd, every other path is tested
// against (functional::attention's kMath, and the reference of the kernels' tests), and its
// spec for the planner.

#include "core/kernels/math_kernel.h"

#include <cmath>
#include <limits>

#include "attnkit/memory_budget.h"

#include "core/base/checks.h"
#include "core/plan/planner.h"
#include "core/scores/score_mods.h"

namespace attnkit::detail {

torch::Tensor attention_dropout(const torch::Tensor& weights, double dropout_p, bool training) {
  return torch::dropout(weights, dropout_p, training);
}

functional::AttentionOutput math_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value, const MathMasking& masking,
                                           c10::optional<double> scale, double dropout_p,
                                           bool training) {
  // A fresh (..., n, m) product, so the scale and the mask go in place where no score
  // function needs the scores: fewer passes over the largest tensor.
  // (..., n, hd) @ (..., hd, m) -> (..., n, m)
  auto scores = torch::matmul(query, key.transpose(-2, -1));
  // Divide (not multiply by the reciprocal) so float32 results are bit-identical to the book.
  if (scale.has_value()) {
    scores.mul_(*scale);
  } else {
    scores.div_(std::sqrt(static_cast<double>(query.size(-1))));
  }
  if (masking.score_mod)
    scores = apply_score_mod(masking.score_mod, scores, masking.index);
  if (masking.bias.defined())
    scores = scores + masking.bias.to(scores.scalar_type());
  const auto& allowed = masking.allowed;
  if (allowed.defined()) {
    constexpr double kMasked = -std::numeric_limits<double>::infinity();
    const auto masked = allowed.logical_not();
    if (!masking.score_mod && at::infer_size(masked.sizes(), scores.sizes()) == scores.sizes()) {
      scores.masked_fill_(masked, kMasked);
    } else {  // a mask with more leading dimensions broadcasts the scores up
      scores = scores.masked_fill(masked, kMasked);
    }
  }
  torch::Tensor weights;
  if (masking.sinks.defined()) {
    // Each row's softmax over its keys and its head's sink, which has no value:
    // (b, h, n, m) scores and a (b, h, n, 1) sink column -> (b, h, n, m + 1) -> the m keys'.
    const auto sinks = masking.sinks.to(scores.scalar_type()).view({1, -1, 1, 1});
    const auto column = sinks.expand({scores.size(0), scores.size(1), scores.size(2), 1});
    weights = torch::softmax(torch::cat({scores, column}, -1), -1).narrow(-1, 0, scores.size(-1));
  } else {
    weights = torch::softmax(scores, -1);
  }
  if (allowed.defined()) {
    // A row that sees no key is softmax(-inf, ...) = NaN; it attends to nothing. On CPU the
    // (small) mask is checked first so the weights are rewritten only when needed; on a GPU
    // that check would be a device sync, so the fill always runs there.
    const auto no_key = allowed.logical_not().all(-1, /*keepdim=*/true);
    if (!allowed.device().is_cpu() || no_key.any().item<bool>())
      weights = weights.masked_fill(no_key, 0.0);
  }
  weights = attention_dropout(weights, dropout_p, training);
  return {torch::matmul(weights, value), weights};
}

namespace {

// Refuses a math call on the CPU whose (b, h, n, m) tensors would exceed the memory budget,
// before any of them is made. A lower bound: the scores and the weights in the compute dtype
// and, with a mask, its dense bool (n, m) (dropout and score functions add more).
void check_math_memory(const KernelInput& input) {
  const auto& call = input.call;
  const auto& q4 = call.query;
  if (!q4.device().is_cpu())
    return;
  const int64_t batch = q4.size(0), heads = q4.size(1), n = q4.size(2), m = call.key.size(2);
  const bool masked = !input.mask().is_none();
  const double pairs = static_cast<double>(n) * static_cast<double>(m);
  const double bytes =
      2.0 * static_cast<double>(batch * heads) * pairs * static_cast<double>(q4.element_size()) +
      (masked ? pairs : 0.0);
  // Every math call passes here: the message is built only for a call that is refused.
  if (bytes <= static_cast<double>(memory_budget()))
    return;
  std::string way_out;
  if (call.with_weights) {
    way_out =
        "the weights are that size themselves: ask for the context alone (attention(), "
        "not attention_with_weights), which the tiled kernels compute in memory linear in n";
  } else if (backend_lacks(AttentionBackend::kChunked, call).empty()) {
    way_out =
        "use AttentionBackend::kAuto or kChunked, which tile the scores in memory linear in n";
  } else {
    way_out = c10::str("no tiled kernel runs this call (chunked: ",
                       backend_lacks(AttentionBackend::kChunked, call), "); use fewer tokens");
  }
  check_memory_budget("[attention]",
                      c10::str("the math backend's scores and weights",
                               masked ? " and dense mask" : "", " for (batch, heads, n, m) = (",
                               batch, ", ", heads, ", ", n, ", ", m, ") in ", q4.scalar_type()),
                      bytes, way_out + ", or raise the budget with attnkit::set_memory_budget");
}

// The math core on the call's 4-D inputs: key/value heads repeated for their query heads,
// the dense mask, index tensors for a score function.
functional::AttentionOutput run_math(const KernelInput& input) {
  check_math_memory(input);
  const auto& call = input.call;
  const auto &q4 = call.query, &k4 = call.key, &v4 = call.value;
  const auto& options = call.options;
  const int64_t batch = q4.size(0), heads = q4.size(1), n = q4.size(2), m = k4.size(2);
  const int64_t group_size = heads / k4.size(1);
  MathMasking masking;
  if (!input.mask().is_none())
    masking.allowed = input.mask().dense(batch, heads, n, m, q4.device());
  if (options.score_mod()) {
    masking.score_mod = options.score_mod();
    const auto index = torch::dtype(torch::kInt64).device(q4.device());
    masking.index = {torch::arange(batch, index).view({-1, 1, 1, 1}),
                     torch::arange(heads, index).view({1, -1, 1, 1}),
                     torch::arange(n, index).view({1, 1, -1, 1}),
                     torch::arange(m, index).view({1, 1, 1, -1})};
  }
  masking.sinks = options.sinks();
  const auto k = group_size == 1 ? k4 : k4.repeat_interleave(group_size, 1);
  const auto v = group_size == 1 ? v4 : v4.repeat_interleave(group_size, 1);
  return math_attention(q4, k, v, masking, options.scale(), options.dropout_p(),
                        options.training());
}

}  // namespace

KernelSpec math_spec() {
  return {"math", AttentionBackend::kMath, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput&) {
            return KernelDecision{"", run_math};
          },
          /*takes_sinks=*/true};
}

}  // namespace attnkit::detail
