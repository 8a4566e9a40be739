#pragma once

/// RMSNorm (Zhang and Sennrich 2019), the normalisation of Llama, Qwen and Gemma, and of
/// QK-norm inside attention. LibTorch 1.13 has no torch::nn::RMSNorm; this one has the
/// parameter name of PyTorch's `nn.RMSNorm` (`weight`), so state dicts cross.

#include <torch/torch.h>

#include "attnkit/options.h"

namespace attnkit {

/// x / sqrt(mean(x^2 over the last dimension) + eps) * weight, computed in float32 for
/// half-precision inputs (as Llama and Qwen do) and returned in x's dtype. `weight` (dim)
/// starts at ones. Example: `RMSNorm norm(RMSNormOptions(64).eps(1e-5));`
class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  explicit RMSNormImpl(const RMSNormOptions& options);

  /// Validates the options and registers `weight`.
  void reset() override;
  /// Sets `weight` to ones.
  void reset_parameters();
  /// `attnkit::RMSNorm(dim=64, eps=1e-06)`
  void pretty_print(std::ostream& stream) const override;

  /// (..., dim) -> (..., dim).
  torch::Tensor forward(const torch::Tensor& x);

  /// The options this module was built with (reset() re-reads them).
  RMSNormOptions options;
  /// The learnable scale, (dim).
  torch::Tensor weight;
};

/// Module holder for `RMSNormImpl` (shared-pointer semantics).
TORCH_MODULE(RMSNorm);

}  // namespace attnkit
