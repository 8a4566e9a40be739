#pragma once

// attnkit-train's mixed precision (--dtype bfloat16 | float16): the model's forward and
// backward run on a 16-bit working copy, while the weights the optimizer updates and its
// moments stay float32 (FlatAdamW over the float32 model, which checkpoints save). Each step
// the working copy's gradients are widened into the float32 buffer and, after the update, the
// float32 weights are rounded into the working copy: two copies of the flat buffers a step.
//
// With --autocast there is no working copy: the float32 model runs forward under LibTorch's
// autocast in the 16-bit dtype (its linear layers and matrix products; attnkit's attention
// computes in float32 inside), and backward writes float32 gradients straight into the
// optimizer's buffer, where data-parallel ranks sum them as in a float32 run.
//
// float16's range is small enough that small gradients underflow, so its loss is scaled up
// before backward and the gradients down after it, by a dynamic scale as PyTorch's
// GradScaler keeps it: 2^16 to start, halved (and the step skipped) when a gradient is
// infinite or NaN, doubled after 2,000 steps in a row without one. bfloat16 has float32's
// range and runs unscaled; a step with a non-finite gradient is skipped there too.

#include <string>

#include <torch/torch.h>

#include "model.h"

namespace attnkit::train {

/// "float32", "bfloat16" or "float16" as a dtype; anything else is an error naming --dtype.
torch::ScalarType parse_train_dtype(const std::string& name);

/// Fails, naming --dtype and the way out, when `device` cannot multiply in `dtype`: float16
/// on a CPU whose LibTorch has no float16 matrix products (1.13). attnkit-train and
/// attnkit-bench both ask it.
void check_dtype_runs_on(torch::ScalarType dtype, const torch::Device& device);

class MixedPrecision {
 public:
  /// A working copy in `dtype` of a model built from `config`, its weights those of
  /// `master_values` (the float32 model's flat buffer, FlatAdamW::flat_values()).
  MixedPrecision(const ModelConfig& config, torch::ScalarType dtype, const torch::Device& device,
                 const torch::Tensor& master_values);
  /// Autocast instead of a working copy: `master`'s forward runs under LibTorch's autocast in
  /// `dtype` from now on.
  MixedPrecision(AttentionModel& master, torch::ScalarType dtype);

  /// Whether forward and backward run on a 16-bit working copy (else on the float32 model,
  /// under autocast).
  bool has_working_copy() const { return values_.defined(); }
  /// The 16-bit working copy: forward, backward, evaluation and sampling run on it.
  AttentionModel& model() { return model_; }
  /// What the loss is multiplied by before backward (1 for bfloat16).
  double loss_scale() const { return scale_; }

  /// The working copy's gradients (from backward) into `master_gradients` (float32, still
  /// scaled); the copy's are zeroed for the next backward. Nothing to do under autocast.
  void move_gradients_into(torch::Tensor& master_gradients);
  /// Divides `master_gradients` by the loss scale. Returns whether they are all finite; when
  /// not, the step must be skipped, and the scale is halved for the next one.
  bool unscale(torch::Tensor& master_gradients);
  /// The float32 weights after an update, rounded into the working copy (if any).
  void copy_weights_from(const torch::Tensor& master_values);
  /// Steps skipped for non-finite gradients so far.
  int64_t skipped_steps() const { return skipped_; }

 private:
  AttentionModel model_{nullptr};
  std::vector<torch::Tensor> parameters_;
  torch::Tensor values_, gradients_;  // (numel) of the working copy, in its dtype
  double scale_ = 1.0;
  bool dynamic_scale_ = false;
  int64_t finite_in_a_row_ = 0, skipped_ = 0;
  static constexpr double kInitialScale = 65536.0;
  static constexpr int64_t kGrowthInterval = 2000;
};

}  // namespace attnkit::train
