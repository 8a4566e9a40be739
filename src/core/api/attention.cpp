// attnkit::functional::attention and the split calls: argument checks, then the planner. The
// choice of kernel: src/core/plan/planner.cpp; the math core: src/core/kernels/math_kernel.cpp; the
// masks: src/core/masks/mask.cpp; the score functions: src/core/scores/score_mods.cpp.

#include "attnkit/attention.h"

#include <cmath>
#include <limits>

#include "core/api/argument_checks.h"
#include "core/base/attention_layout.h"
#include "core/base/autocast.h"
#include "core/base/checks.h"
#include "core/base/lse_merge.h"
#include "core/plan/planner.h"
#include "core/scores/row_variants.h"
#include "core/scores/score_variants.h"

namespace attnkit {

using detail::shape_string;

std::string backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kMath:
      return "math";
    case AttentionBackend::kFused:
      return "fused";
    case AttentionBackend::kChunked:
      return "chunked";
    case AttentionBackend::kAuto:
      return "auto";
  }
  return "unknown";
}

AttentionBackend parse_backend(const std::string& name) {
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kFused,
                             AttentionBackend::kChunked, AttentionBackend::kAuto}) {
    if (name == backend_name(backend))
      return backend;
  }
  TORCH_CHECK(false, "[parse_backend] unknown backend '", name,
              "'; expected math, fused, chunked or auto");
}

namespace functional {

namespace {

const char* const kFn = "[attention]";

// The problem as (b, h, n, hd) inputs: 2-D and 3-D inputs gain unit batch and head
// dimensions.
torch::Tensor as_4d(const torch::Tensor& t) {
  return t.dim() == 2 ? t.view({1, 1, t.size(0), t.size(1)}) : t.dim() == 3 ? t.unsqueeze(1) : t;
}

// (b, h, n, f) back to the rank of `like`.
torch::Tensor as_rank_of(const torch::Tensor& t4, const torch::Tensor& like) {
  return like.dim() == 2 ? t4.view({t4.size(2), t4.size(3)}) : like.dim() == 3 ? t4.squeeze(1) : t4;
}

}  // namespace

void check_attention_arguments(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const AttentionOptions& options,
                               const char* fn) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), fn,
              " query, key and value must all be defined tensors");
  TORCH_CHECK(q.dim() >= 2 && q.dim() <= 4 && k.dim() == q.dim() && v.dim() == q.dim(), fn,
              " query, key and value must share a rank of 2 to 4 ((n, hd), (b, n, hd) or (b, h, ",
              "n, hd)), got query ", shape_string(q), ", key ", shape_string(k), ", value ",
              shape_string(v));
  TORCH_CHECK(q.dim() < 3 || (k.size(0) == q.size(0) && v.size(0) == q.size(0)), fn,
              " key and value must have the query's batch size ", q.size(0), ", got key ",
              shape_string(k), " and value ", shape_string(v));
  TORCH_CHECK(q.size(-1) == k.size(-1), fn,
              " query and key must have the same last dimension (head_dim), got query ",
              shape_string(q), " and key ", shape_string(k));
  TORCH_CHECK(k.size(-2) == v.size(-2) && (q.dim() < 4 || k.size(1) == v.size(1)), fn,
              " key and value must have the same heads and tokens, got key ", shape_string(k),
              " and value ", shape_string(v));
  TORCH_CHECK(k.size(-2) >= 1, fn, " key must hold at least one token, got ", shape_string(k));
  if (q.dim() == 4) {
    TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, fn, " key/value heads (", k.size(1),
                ") must divide query heads (", q.size(1), "), got query ", shape_string(q),
                " and key ", shape_string(k));
  }
  // Under autocast they share the dtype they are cast to (detail::attention_dtype).
  const auto q_dtype = detail::attention_dtype(q);
  TORCH_CHECK(q_dtype == detail::attention_dtype(k) && q_dtype == detail::attention_dtype(v) &&
                  q.is_floating_point() && k.is_floating_point() && v.is_floating_point(),
              fn, " query, key and value must share a floating dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && k.device() == v.device(), fn,
              " query, key and value must be on one device, got ", q.device(), ", ", k.device(),
              ", ", v.device());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  TORCH_CHECK(!options.scale().has_value() || std::isfinite(*options.scale()), fn,
              " scale must be finite, got ", options.scale().value_or(0.0));
  const auto& sinks = options.sinks();
  TORCH_CHECK(!sinks.defined() || (sinks.dim() == 1 && q.dim() == 4 && sinks.size(0) == q.size(1) &&
                                   sinks.is_floating_point() && sinks.device() == q.device()),
              fn, " sinks must be a floating (", q.dim() == 4 ? q.size(1) : -1,
              ") tensor, one logit per query head of 4-D inputs, on ", q.device(), ", got ",
              sinks.defined()
                  ? c10::str(shape_string(sinks), " ", sinks.scalar_type(), " on ", sinks.device())
                  : std::string());
  TORCH_CHECK(options.query_block_size() >= 1, fn, " query_block_size must be >= 1, got ",
              options.query_block_size());
  TORCH_CHECK(options.key_block_size() >= 1, fn, " key_block_size must be >= 1, got ",
              options.key_block_size());
  const auto q4 = as_4d(q);
  options.mask().check(fn, q4.size(0), q4.size(1), q4.size(2), k.size(-2), q.device());
}

namespace {

// The options every backend reads: a block mask given as `block_mask` becomes the call's
// mask (Mask::from_block_mask), so the chunked kernel reads its lists and the others its mask.
AttentionOptions resolve_block_mask(const char* fn, const AttentionOptions& options) {
  if (!options.block_mask().defined())
    return options;
  TORCH_CHECK(options.mask().is_none(), fn, " pass the mask either as mask(...) or inside ",
              "block_mask(...), not both; got mask ", options.mask().to_string(),
              " and a block mask of ", options.block_mask().mask().to_string());
  auto resolved = options;
  resolved.mask(Mask::from_block_mask(options.block_mask())).block_mask({});
  return resolved;
}

// The call of attention(query, key, value, options) for the planner, its inputs made 4-D.
detail::AttentionCall call_of(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const AttentionOptions& options) {
  detail::AttentionCall call;
  call.query = as_4d(query);
  call.key = as_4d(key);
  call.value = as_4d(value);
  call.options = options;
  return call;
}

}  // namespace

std::string unsupported_reason(AttentionBackend backend, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value,
                               const AttentionOptions& options) {
  return detail::backend_lacks(backend,
                               call_of(query, key, value, resolve_block_mask(kFn, options)));
}

AttentionBackend choose_backend(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const AttentionOptions& options) {
  if (options.backend() != AttentionBackend::kAuto)
    return options.backend();
  return detail::plan_attention(call_of(query, key, value, resolve_block_mask(kFn, options)))
      .backend;
}

torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& key,
                        const torch::Tensor& value, const AttentionOptions& given) {
  const auto options = resolve_block_mask(kFn, given);
  check_attention_arguments(query, key, value, options);
  return as_rank_of(detail::run_attention(call_of(query, key, value, options)).context, query);
}

namespace {

const char* const kSplitFn = "[attention_forward]";

// The split call of attention_forward and attention_backward: checked, 4-D, no dropout.
detail::AttentionCall split_call_of(const char* fn, const torch::Tensor& query,
                                    const torch::Tensor& key, const torch::Tensor& value,
                                    const AttentionOptions& given) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, fn,
              " query, key and value must be 4-D (b, h, n, hd), got ", shape_string(query), ", ",
              shape_string(key), " and ", shape_string(value));
  const auto options = resolve_block_mask(fn, given);
  check_attention_arguments(query, key, value, options);
  TORCH_CHECK(!options.training() || options.dropout_p() == 0.0, fn,
              " dropout is not offered in a split call (its backward must redraw forward's "
              "masks); got dropout_p ",
              options.dropout_p(), " in training");
  std::string why;
  TORCH_CHECK(!options.score_mod() || detail::score_variant_of(options.score_mod(), &why), fn,
              " score_mod: ", why,
              "; a split call takes the named score functions and ScoreGraphs");
  TORCH_CHECK(query.device().is_cpu(), fn, " a split call runs on the CPU, got ", query.device());
  auto call = call_of(query, key, value, options);
  call.options.backend(AttentionBackend::kAuto).dropout_p(0.0).training(false);
  call.split = true;
  return call;
}

}  // namespace

AttentionWithLse attention_forward(const torch::Tensor& query, const torch::Tensor& key,
                                   const torch::Tensor& value, const AttentionOptions& options) {
  auto call = split_call_of(kSplitFn, query, key, value, options);
  // Made as backward reads it where autograd would want gradients (SplitForward::unrounded).
  call.backward_follows = detail::wants_gradient(call);
  const torch::NoGradGuard no_grad;
  auto result = detail::run_split_forward(call);
  return {result.out, result.lse, call.backward_follows ? result.unrounded : torch::Tensor()};
}

AttentionGradients attention_backward(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, const AttentionWithLse& forward,
                                      const torch::Tensor& grad_out,
                                      const AttentionOptions& options) {
  const char* fn = "[attention_backward]";
  auto call = split_call_of(fn, query, key, value, options);
  const auto rows = std::vector<int64_t>{query.size(0), query.size(1), query.size(2)};
  TORCH_CHECK(forward.out.defined() && forward.lse.defined() && grad_out.defined() &&
                  forward.out.dim() == 4 && forward.out.sizes().slice(0, 3) == rows &&
                  forward.out.size(3) == value.size(3) && forward.lse.sizes() == rows &&
                  grad_out.sizes() == forward.out.sizes(),
              fn, " forward.out and grad_out must be (", query.size(0), ", ", query.size(1), ", ",
              query.size(2), ", ", value.size(3), ") and forward.lse (", query.size(0), ", ",
              query.size(1), ", ", query.size(2), "), got ",
              forward.out.defined() ? shape_string(forward.out) : std::string("undefined"), ", ",
              grad_out.defined() ? shape_string(grad_out) : std::string("undefined"), " and ",
              forward.lse.defined() ? shape_string(forward.lse) : std::string("undefined"));
  // The score function's tensors that want gradients, as leaves of their own.
  std::vector<torch::Tensor> parameters;
  if (const auto variant = detail::score_variant_of(call.options.score_mod())) {
    for (const auto& tensor : variant->tensors()) {
      if (tensor.requires_grad())
        parameters.push_back(tensor);
    }
  }
  const torch::NoGradGuard no_grad;
  const auto& out = forward.out_for_backward.defined() ? forward.out_for_backward : forward.out;
  TORCH_CHECK(out.sizes() == forward.out.sizes(), fn,
              " forward.out_for_backward must be shaped as forward.out ", shape_string(forward.out),
              ", got ", shape_string(out));
  const auto grads = detail::run_split_backward(call, {out, forward.lse, grad_out, parameters});
  return {grads[0], grads[1], grads[2], std::vector<torch::Tensor>(grads.begin() + 3, grads.end())};
}

AttentionWithLse merge_attention(const std::vector<AttentionWithLse>& parts) {
  const char* fn = "[merge_attention]";
  TORCH_CHECK(!parts.empty(), fn, " needs at least one part");
  const auto& first = parts.front();
  bool any_for_backward = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    any_for_backward = any_for_backward || part.out_for_backward.defined();
    TORCH_CHECK(part.out.defined() && part.lse.defined() && part.out.dim() == 4 &&
                    part.out.sizes() == first.out.sizes() &&
                    part.lse.sizes() == first.out.sizes().slice(0, 3),
                fn, " part ", i, ": out must be shaped as part 0's ",
                first.out.defined() ? shape_string(first.out) : std::string("undefined"),
                " and lse as its first three dimensions, got ",
                part.out.defined() ? shape_string(part.out) : std::string("undefined"), " and ",
                part.lse.defined() ? shape_string(part.lse) : std::string("undefined"));
    TORCH_CHECK(
        !part.out_for_backward.defined() || part.out_for_backward.sizes() == part.out.sizes(), fn,
        " part ", i, ": out_for_backward must be shaped as its out ", shape_string(part.out),
        ", got ", shape_string(part.out_for_backward));
  }
  const torch::NoGradGuard no_grad;
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  // Merged in the dtype the parts' lse was computed in (float32 for 16-bit parts).
  auto out = torch::zeros(first.out.sizes(), first.out.options().dtype(first.lse.scalar_type()));
  auto log_weight = torch::full(first.lse.sizes(), -kInfinity, first.lse.options());
  for (const auto& part : parts)
    merge_into(out, log_weight, part);
  // A row that sees no key in any part: lse +inf, as a single call's, and zeros.
  const bool rounded = out.scalar_type() != first.out.scalar_type();
  return {out.to(first.out.scalar_type()), log_weight.masked_fill(log_weight.isneginf(), kInfinity),
          rounded && any_for_backward ? out : torch::Tensor()};
}

AttentionOutput attention_with_weights(const torch::Tensor& query, const torch::Tensor& key,
                                       const torch::Tensor& value, const AttentionOptions& given) {
  const auto options = resolve_block_mask(kFn, given);
  check_attention_arguments(query, key, value, options);
  TORCH_CHECK(
      options.backend() == AttentionBackend::kAuto || options.backend() == AttentionBackend::kMath,
      "[attention_with_weights] the weights come from the math backend, which builds ",
      "them; got backend ", backend_name(options.backend()),
      " (use kAuto or kMath, or attention() for the context alone)");
  auto call = call_of(query, key, value, options);
  call.with_weights = true;
  const auto out = detail::run_attention(call);
  return {as_rank_of(out.context, query), as_rank_of(out.weights, query)};
}

}  // namespace functional

namespace detail {

functional::AttentionOutput run_checked_attention(const AttentionCall& call) {
  functional::check_attention_arguments(call.query, call.key, call.value, call.options);
  return run_attention(call);
}

}  // namespace detail
}  // namespace attnkit
