// What the kernels' decisions read (kernel_spec.h): the call's derived facts, made once, and
// the rules several kernels share.

#include "core/plan/kernel_spec.h"

#include "core/scores/row_variants.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

double KernelInput::dropout_p() const {
  return call.options.training() ? call.options.dropout_p() : 0.0;
}

double KernelInput::scale() const {
  return call.options.scale().value_or(default_scale(call.query.size(3)));
}

bool KernelInput::has_default_scale() const {
  const auto& scale = call.options.scale();
  return !scale.has_value() || *scale == default_scale(call.query.size(3));
}

const Mask& KernelInput::mask() const {
  if (!mask_) {
    if (call.step != StepKind::kRagged) {
      mask_ = call.options.mask();
    } else {
      auto rows = Mask::causal(call.ragged.query_offsets);
      if (call.ragged.window > 0)
        rows = rows.sliding_window(call.ragged.window);
      mask_ = rows & Mask::key_padding(call.ragged.key_ends) & call.options.mask();
    }
  }
  return *mask_;
}

const std::optional<CausalSpan>& KernelInput::causal_span() const {
  if (!causal_span_) {
    CausalSpan span;
    if (mask().is_none())
      causal_span_.emplace(span);
    else if ((span.causal = mask().is_causal(&span.query_offset, &span.window)))
      causal_span_.emplace(span);
    else
      causal_span_.emplace(std::nullopt);
  }
  return *causal_span_;
}

bool KernelInput::cpu_query_or_key_has_nan() const {
  if (real_ != nullptr)
    return real_->cpu_query_or_key_has_nan();
  if (!cpu_nan_) {
    // A sum is NaN where an entry is (or where +inf meets -inf: the call then runs on
    // attnkit's kernels, which is right too): one pass over the query and the key, without
    // isnan()'s bool tensors.
    cpu_nan_ = call.query.is_cpu() && call.query.is_floating_point() &&
               (call.query.sum().isnan().item<bool>() || call.key.sum().isnan().item<bool>());
  }
  return *cpu_nan_;
}

std::string libtorch_cpu_nan_declines(const KernelInput& input) {
  // A call that demands kFused, or names the kernel, runs LibTorch's SDPA as asked.
  if (!cpu_route_allowed(input.call) && input.cpu_query_or_key_has_nan())
    return "the query or key holds a NaN, which LibTorch's CPU SDPA drops from a row (its flash "
           "kernel) or spreads into masked rows (a dense mask); attnkit's kernels keep NaN "
           "where it is seen (docs/masks.md)";
  return "";
}

std::string fused_kernels_decline(const KernelInput& input) {
  const auto& call = input.call;
  if (call.options.score_mod())
    return "the fused backend has no score functions (score_mod)";
  if (!input.causal_span()) {
    return c10::str("the fused backend takes only causal and sliding-window masks, not ",
                    input.mask().to_string());
  }
  if (!input.has_default_scale()) {
    return c10::str("the fused backend has only the default scale 1/sqrt(head_dim), not ",
                    *call.options.scale());
  }
  if (call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  return "";
}

std::string sdpa_routes_decline(const KernelInput& input) {
  if (input.call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  if (!input.has_default_scale()) {
    return c10::str("the fused backend has only the default scale 1/sqrt(head_dim), not ",
                    *input.call.options.scale());
  }
  return "";
}

bool cpu_route_allowed(const AttentionCall& call) {
  return !call.query.is_cpu() || !call.options.kernel().empty() ||
         (!call.backend_is_preference && call.options.backend() == AttentionBackend::kFused);
}

bool is_16bit(const torch::Tensor& tensor) {
  return tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kHalf;
}

torch::ScalarType compute_dtype(const torch::Tensor& tensor) {
  return is_16bit(tensor) ? torch::kFloat : tensor.scalar_type();
}

int64_t block_for(int64_t size, int64_t tokens) {
  return std::min(size, std::max<int64_t>(2, (tokens + 1) / 2 * 2));
}

bool wants_gradient(const AttentionCall& call) {
  if (!torch::GradMode::is_enabled())
    return false;
  if (call.query.requires_grad() || call.key.requires_grad() || call.value.requires_grad())
    return true;
  if (const auto variant = score_variant_of(call.options.score_mod())) {
    for (const auto& tensor : variant->tensors()) {
      if (tensor.requires_grad())
        return true;
    }
  }
  return false;
}

}  // namespace attnkit::detail
