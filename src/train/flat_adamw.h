#pragma once

// AdamW over one flat buffer: the parameters (and their gradients) become views of a single
// tensor, so zeroing, clipping and the AdamW update are a handful of tensor ops per step
// instead of about ten per parameter. The update is LibTorch's AdamW (torch::optim::AdamW,
// amsgrad off) element for element; clipping is clip_grad_norm_'s (L2, coefficient clamped
// at 1). Why: at attnkit-train's toy sizes the per-parameter ops of torch::optim::AdamW
// took about 9% of a training step.

#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/serialize.h"

namespace attnkit::train {

/// Makes `parameters` views of `values` and their gradients views of `gradients`, back to back
/// in order (both (numel of them all), of the parameters' dtype and device), keeping their
/// values. Backward then accumulates into `gradients` in place.
void view_as_flat(std::vector<torch::Tensor>& parameters, torch::Tensor& values,
                  torch::Tensor& gradients);

class FlatAdamW {
 public:
  /// Takes over `parameters` (all on one device, one dtype): their data and gradients are
  /// moved into flat buffers they then view. Betas (0.9, 0.999), eps 1e-8 as LibTorch's.
  FlatAdamW(std::vector<torch::Tensor> parameters, double lr, double weight_decay);

  void set_lr(double lr) { lr_ = lr; }
  void set_weight_decay(double weight_decay) { weight_decay_ = weight_decay; }

  void zero_grad();
  /// Scales the gradients so that their global L2 norm is at most `max_norm`; returns the
  /// norm before scaling.
  double clip_grad_norm(double max_norm);
  void step();

  /// Every parameter, back to back, and their gradients in the same layout: data-parallel
  /// training broadcasts the one and sums the other in a single collective each.
  torch::Tensor& flat_values() { return values_; }
  torch::Tensor& flat_gradients() { return gradients_; }

  /// Moments and step count (the parameters are saved with the model).
  /// Under `prefix`: "exp_avg", "exp_avg_sq" (float tensors) and "step" (int64 scalar).
  void save(attnkit::StateDict& dict, const std::string& prefix) const;
  /// Checks every entry's shape and type before it changes anything.
  void load(const attnkit::StateDict& dict, const std::string& prefix);

 private:
  std::vector<torch::Tensor> parameters_;
  torch::Tensor values_;     // (numel) every parameter, back to back
  torch::Tensor gradients_;  // (numel) their gradients, the same layout
  torch::Tensor exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  double lr_, weight_decay_;
  static constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;
};

}  // namespace attnkit::train
