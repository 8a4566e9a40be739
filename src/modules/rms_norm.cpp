#include "attnkit/rms_norm.h"

#include <algorithm>
#include <cmath>

#include <ATen/Parallel.h>

#include "core/base/checks.h"
#include "modules/module_helpers.h"

namespace attnkit {

RMSNormImpl::RMSNormImpl(const RMSNormOptions& options) : options(options) {
  reset();
}

void RMSNormImpl::reset() {
  detail::check_positive_option("RMSNorm", "dim", options.dim());
  TORCH_CHECK(options.eps() > 0.0, "[RMSNorm] option eps must be > 0, got ", options.eps());
  weight = register_parameter("weight", torch::ones({options.dim()}));
  reset_parameters();
}

void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(options.unit_offset() ? 0.0 : 1.0);
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::RMSNorm(dim=" << options.dim()
         << ", eps=" << detail::option_text(options.eps());
  if (options.unit_offset())
    stream << ", unit_offset=true";
  stream << ")";
}

namespace {

// x / sqrt(mean(x^2) + eps) * (weight, or 1 + weight) over rows of `width`, in one pass per
// row: a decode step's norms (one token, a few dozen wide) cost a call each instead of the
// seven LibTorch operations of the formula.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows,
                   int64_t width, double eps, bool unit_offset) {
  const int64_t grain = std::max<int64_t>(1, 32768 / width);
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const scalar_t* in = x + row * width;
      scalar_t* result = out + row * width;
      double squares = 0.0;
      for (int64_t i = 0; i < width; ++i)
        squares += static_cast<double>(in[i]) * static_cast<double>(in[i]);
      const auto inverse_rms =
          static_cast<scalar_t>(1.0 / std::sqrt(squares / static_cast<double>(width) + eps));
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t scale = unit_offset ? scalar_t(1) + weight[i] : weight[i];
        result[i] = in[i] * inverse_rms * scale;
      }
    }
  });
}

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.dim() && x.is_floating_point(),
              "[RMSNorm::forward] x must be a floating (..., ", options.dim(), ") tensor, got ",
              x.defined() ? c10::str(detail::shape_string(x), " ", x.scalar_type())
                          : std::string("an undefined tensor"));
  const bool records_gradient =
      torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad());
  if (!records_gradient && x.device().is_cpu() && weight.device().is_cpu() &&
      (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble) &&
      weight.scalar_type() == x.scalar_type()) {
    const auto input = x.contiguous();
    const auto scale = weight.contiguous();
    auto out = torch::empty_like(input);
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm", [&] {
      rms_norm_rows<scalar_t>(input.data_ptr<scalar_t>(), scale.data_ptr<scalar_t>(),
                              out.data_ptr<scalar_t>(), input.numel() / options.dim(),
                              options.dim(), options.eps(), options.unit_offset());
    });
    return out;
  }
  const bool low_precision = x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16;
  const auto wide = low_precision ? x.to(torch::kFloat32) : x;
  const auto normed = wide * torch::rsqrt(wide.pow(2).mean(-1, /*keepdim=*/true) + options.eps());
  return (normed * (options.unit_offset() ? weight + 1 : weight)).to(x.scalar_type());
}

}  // namespace attnkit
