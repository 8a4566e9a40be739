#include "attnkit/rms_norm.h"

#include "core/checks.h"
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

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.dim() && x.is_floating_point(),
              "[RMSNorm::forward] x must be a floating (..., ", options.dim(), ") tensor, got ",
              x.defined() ? c10::str(detail::shape_string(x), " ", x.scalar_type())
                          : std::string("an undefined tensor"));
  const bool low_precision = x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16;
  const auto wide = low_precision ? x.to(torch::kFloat32) : x;
  const auto normed = wide * torch::rsqrt(wide.pow(2).mean(-1, /*keepdim=*/true) + options.eps());
  return (normed * (options.unit_offset() ? weight + 1 : weight)).to(x.scalar_type());
}

}  // namespace attnkit
