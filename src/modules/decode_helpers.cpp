#include "attnkit/decode.h"

#include "modules/few_rows_linear.h"

namespace attnkit {

torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x) {
  if (!x.device().is_cpu() || x.dim() < 1)
    return linear(x);
  const auto few_rows = detail::few_rows_linear_if_fits(x, linear->weight, linear->bias);
  if (few_rows.defined())
    return few_rows;
  if (x.numel() != x.size(-1))
    return linear(x);
  const auto& weight = linear->weight;
  const auto& bias = linear->bias;
  const auto row = x.reshape({-1});
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return (bias.defined() ? at::addmv(bias, weight, row) : at::mv(weight, row)).view(sizes);
}

ValidTokens::ValidTokens(const torch::Tensor& x, const std::vector<int64_t>& new_lengths) {
  if (new_lengths.empty() || x.dim() != 3 || x.size(0) != static_cast<int64_t>(new_lengths.size()))
    return;
  b_ = x.size(0);
  n_ = x.size(1);
  std::vector<int64_t> valid;  // indices into the (b * n) tokens
  for (int64_t r = 0; r < b_; ++r) {
    for (int64_t i = 0; i < new_lengths[r]; ++i)
      valid.push_back(r * n_ + i);
  }
  if (2 * static_cast<int64_t>(valid.size()) <= b_ * n_)
    index_ = torch::tensor(valid, torch::kInt64).to(x.device());
}

torch::Tensor ValidTokens::pack(const torch::Tensor& x) const {
  return x.reshape({b_ * n_, x.size(2)}).index_select(0, index_);
}

torch::Tensor ValidTokens::unpack(const torch::Tensor& packed) const {
  return torch::zeros({b_ * n_, packed.size(1)}, packed.options())
      .index_copy_(0, index_, packed)
      .view({b_, n_, packed.size(1)});
}

torch::Tensor ValidTokens::add_to(const torch::Tensor& x, const torch::Tensor& packed) const {
  return x.reshape({b_ * n_, x.size(2)}).index_add(0, index_, packed).view(x.sizes());
}

torch::Tensor project(torch::nn::Linear& linear, const torch::Tensor& x,
                      const ValidTokens& tokens) {
  if (!tokens.packs())
    return project(linear, x);
  return tokens.unpack(project(linear, tokens.pack(x)));
}

}  // namespace attnkit
