#include "mixed_precision.h"

#include "flat_adamw.h"

namespace attnkit::train {

torch::ScalarType parse_train_dtype(const std::string& name) {
  if (name == "float32")
    return torch::kFloat;
  if (name == "bfloat16")
    return torch::kBFloat16;
  TORCH_CHECK(name == "float16", "--dtype: expected float32, bfloat16 or float16, got '", name,
              "'");
  return torch::kHalf;
}

void check_dtype_runs_on(torch::ScalarType dtype, const torch::Device& device) {
  TORCH_CHECK(dtype != torch::kHalf || !device.is_cpu() || attnkit::cpu_multiplies_float16(),
              "--dtype float16: this LibTorch has no float16 matrix products on the CPU (1.13 "
              "has none); use --dtype bfloat16, or a GPU");
}

namespace {

void check_16bit(torch::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "[MixedPrecision] expected a 16-bit dtype, got ", dtype);
}

}  // namespace

MixedPrecision::MixedPrecision(AttentionModel& master, torch::ScalarType dtype)
    : dynamic_scale_(dtype == torch::kHalf) {
  check_16bit(dtype);
  master->set_forward_autocast(dtype);
  if (dynamic_scale_)
    scale_ = kInitialScale;
}

MixedPrecision::MixedPrecision(const ModelConfig& config, torch::ScalarType dtype,
                               const torch::Device& device, const torch::Tensor& master_values)
    : model_(config), dynamic_scale_(dtype == torch::kHalf) {
  check_16bit(dtype);
  model_->to(device, dtype);
  parameters_ = model_->parameters();
  const auto options = master_values.options().dtype(dtype);
  values_ = torch::empty({master_values.numel()}, options);
  gradients_ = torch::zeros({master_values.numel()}, options);
  view_as_flat(parameters_, values_, gradients_);
  TORCH_CHECK(values_.numel() == master_values.numel(),
              "[MixedPrecision] the working copy has another layout than the float32 model");
  copy_weights_from(master_values);
  if (dynamic_scale_)
    scale_ = kInitialScale;
}

void MixedPrecision::move_gradients_into(torch::Tensor& master_gradients) {
  if (!has_working_copy())
    return;
  torch::NoGradGuard no_grad;
  master_gradients.copy_(gradients_);
  gradients_.zero_();
}

bool MixedPrecision::unscale(torch::Tensor& master_gradients) {
  torch::NoGradGuard no_grad;
  if (scale_ != 1.0)
    master_gradients.div_(scale_);
  const bool finite = master_gradients.isfinite().all().item<bool>();
  if (!finite) {
    ++skipped_;
    finite_in_a_row_ = 0;
    if (dynamic_scale_)
      scale_ /= 2;
  } else if (dynamic_scale_ && ++finite_in_a_row_ == kGrowthInterval) {
    scale_ *= 2;
    finite_in_a_row_ = 0;
  }
  return finite;
}

void MixedPrecision::copy_weights_from(const torch::Tensor& master_values) {
  if (!has_working_copy())
    return;
  torch::NoGradGuard no_grad;
  values_.copy_(master_values);
}

}  // namespace attnkit::train
