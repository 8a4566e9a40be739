#include "flat_adamw.h"

#include <cmath>

namespace attnkit::train {

FlatAdamW::FlatAdamW(std::vector<torch::Tensor> parameters, double lr, double weight_decay)
    : parameters_(std::move(parameters)), lr_(lr), weight_decay_(weight_decay) {
  TORCH_CHECK(!parameters_.empty(), "[FlatAdamW] expected at least one parameter");
  int64_t numel = 0;
  for (const auto& p : parameters_) {
    TORCH_CHECK(p.device() == parameters_.front().device() &&
                    p.scalar_type() == parameters_.front().scalar_type(),
                "[FlatAdamW] parameters must share one device and dtype, got ", p.device(), " ",
                p.scalar_type(), " and ", parameters_.front().device(), " ",
                parameters_.front().scalar_type());
    numel += p.numel();
  }
  const auto options = parameters_.front().options();
  values_ = torch::empty({numel}, options);
  gradients_ = torch::zeros({numel}, options);
  exp_avg_ = torch::zeros({numel}, options);
  exp_avg_sq_ = torch::zeros({numel}, options);
  view_as_flat(parameters_, values_, gradients_);
}

void view_as_flat(std::vector<torch::Tensor>& parameters, torch::Tensor& values,
                  torch::Tensor& gradients) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : parameters) {
    const auto n = p.numel();
    auto value = values.narrow(0, offset, n);
    value.copy_(p.detach().reshape({n}));
    p.set_data(value.view(p.sizes()));
    // Backward accumulates into a defined gradient in place, so it lands in `gradients`.
    p.mutable_grad() = gradients.narrow(0, offset, n).view(p.sizes());
    offset += n;
  }
}

void FlatAdamW::zero_grad() {
  gradients_.zero_();
}

double FlatAdamW::clip_grad_norm(double max_norm) {
  torch::NoGradGuard no_grad;
  const auto total_norm = gradients_.norm();
  gradients_.mul_(torch::clamp(max_norm / (total_norm + 1e-6), c10::nullopt, 1.0));
  return total_norm.item<double>();
}

void FlatAdamW::step() {
  torch::NoGradGuard no_grad;
  ++step_;
  if (weight_decay_ != 0)
    values_.mul_(1 - lr_ * weight_decay_);
  const double bias_correction1 = 1 - std::pow(kBeta1, static_cast<double>(step_));
  const double bias_correction2 = 1 - std::pow(kBeta2, static_cast<double>(step_));
  exp_avg_.mul_(kBeta1).add_(gradients_, 1 - kBeta1);
  exp_avg_sq_.mul_(kBeta2).addcmul_(gradients_, gradients_, 1 - kBeta2);
  const auto denominator = (exp_avg_sq_.sqrt() / std::sqrt(bias_correction2)).add_(kEps);
  values_.addcdiv_(exp_avg_, denominator, -lr_ / bias_correction1);
}

void FlatAdamW::save(StateDict& dict, const std::string& prefix) const {
  dict.insert(prefix + "exp_avg", exp_avg_);
  dict.insert(prefix + "exp_avg_sq", exp_avg_sq_);
  dict.insert(prefix + "step", torch::tensor(step_, torch::kLong));
}

void FlatAdamW::load(const StateDict& dict, const std::string& prefix) {
  const auto entry = [&](const std::string& name) -> const torch::Tensor& {
    const auto* tensor = dict.find(prefix + name);
    TORCH_CHECK(tensor != nullptr, "[FlatAdamW] saved state has no '", prefix + name, "'");
    return *tensor;
  };
  const auto& exp_avg = entry("exp_avg");
  const auto& exp_avg_sq = entry("exp_avg_sq");
  const auto& step = entry("step");
  TORCH_CHECK(exp_avg.sizes() == exp_avg_.sizes() && exp_avg_sq.sizes() == exp_avg_sq_.sizes(),
              "[FlatAdamW] saved state holds ", exp_avg.sizes(), " and ", exp_avg_sq.sizes(),
              " values, this model has ", exp_avg_.sizes());
  TORCH_CHECK(step.scalar_type() == torch::kLong && step.dim() == 0 && step.item<int64_t>() >= 0,
              "[FlatAdamW] saved step: expected a non-negative int64 scalar, got a ",
              step.scalar_type(), " tensor of shape ", step.sizes());
  torch::NoGradGuard no_grad;
  exp_avg_.copy_(exp_avg);
  exp_avg_sq_.copy_(exp_avg_sq);
  step_ = step.item<int64_t>();
}

}  // namespace attnkit::train
