#include "attnkit/self_attention.h"

#include "attnkit/attention.h"
#include "core/base/checks.h"
#include "modules/module_helpers.h"

namespace attnkit {

namespace F = attnkit::functional;

// ---- SelfAttentionV1 --------------------------------------------------------------------

SelfAttentionV1Impl::SelfAttentionV1Impl(const SelfAttentionV1Options& options) : options(options) {
  reset();
}

void SelfAttentionV1Impl::reset() {
  detail::check_positive_option("SelfAttentionV1", "d_in", options.d_in());
  detail::check_positive_option("SelfAttentionV1", "d_out", options.d_out());
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  W_query = register_parameter("W_query", torch::empty({d_in, d_out}));
  W_key = register_parameter("W_key", torch::empty({d_in, d_out}));
  W_value = register_parameter("W_value", torch::empty({d_in, d_out}));
  reset_parameters();
}

void SelfAttentionV1Impl::reset_parameters() {
  torch::NoGradGuard no_grad;
  // Same draws, in the same order, as the notebook's three torch.rand(d_in, d_out) calls.
  W_query.uniform_(0.0, 1.0);
  W_key.uniform_(0.0, 1.0);
  W_value.uniform_(0.0, 1.0);
}

void SelfAttentionV1Impl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::SelfAttentionV1(d_in=" << options.d_in() << ", d_out=" << options.d_out()
         << ")";
}

torch::Tensor SelfAttentionV1Impl::forward(const torch::Tensor& x) {
  return forward_with_weights(x).context;
}

F::AttentionOutput SelfAttentionV1Impl::forward_with_weights(const torch::Tensor& x) {
  detail::check_forward_input("SelfAttentionV1", x,
                              {options.d_in(), /*context_length=*/0, /*allow_unbatched=*/true},
                              W_query);
  const auto keys = torch::matmul(x, W_key);  // (..., n, d_out)
  const auto queries = torch::matmul(x, W_query);
  const auto values = torch::matmul(x, W_value);
  return F::attention_with_weights(queries, keys, values,
                                   F::AttentionOptions().backend(AttentionBackend::kMath));
}

void SelfAttentionV1Impl::copy_weights_from(const SelfAttentionV2Impl& v2) {
  const auto& o = v2.options;
  TORCH_CHECK(o.d_in() == options.d_in() && o.d_out() == options.d_out(),
              "[SelfAttentionV1::copy_weights_from] v2: expected d_in = ", options.d_in(),
              ", d_out = ", options.d_out(), ", got d_in = ", o.d_in(), ", d_out = ", o.d_out());
  TORCH_CHECK(!o.qkv_bias(),
              "[SelfAttentionV1::copy_weights_from] v2: expected qkv_bias = false (SelfAttentionV1 "
              "has no bias), got qkv_bias = true");
  torch::NoGradGuard no_grad;
  // Linear stores (d_out, d_in) and computes x W^T; V1 stores (d_in, d_out) and computes x W.
  W_query.copy_(v2.W_query->weight.t());
  W_key.copy_(v2.W_key->weight.t());
  W_value.copy_(v2.W_value->weight.t());
}

// ---- SelfAttentionV2 --------------------------------------------------------------------

SelfAttentionV2Impl::SelfAttentionV2Impl(const SelfAttentionV2Options& options) : options(options) {
  reset();
}

void SelfAttentionV2Impl::reset() {
  detail::check_positive_option("SelfAttentionV2", "d_in", options.d_in());
  detail::check_positive_option("SelfAttentionV2", "d_out", options.d_out());
  const auto linear =
      torch::nn::LinearOptions(options.d_in(), options.d_out()).bias(options.qkv_bias());
  // Creation order fixes the random draws: query, key, value, as in Python.
  W_query = register_module("W_query", torch::nn::Linear(linear));
  W_key = register_module("W_key", torch::nn::Linear(linear));
  W_value = register_module("W_value", torch::nn::Linear(linear));
}

void SelfAttentionV2Impl::reset_parameters() {
  W_query->reset_parameters();
  W_key->reset_parameters();
  W_value->reset_parameters();
}

void SelfAttentionV2Impl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::SelfAttentionV2(d_in=" << options.d_in() << ", d_out=" << options.d_out()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias()) << ")";
}

torch::Tensor SelfAttentionV2Impl::forward(const torch::Tensor& x) {
  return forward_with_weights(x).context;
}

F::AttentionOutput SelfAttentionV2Impl::forward_with_weights(const torch::Tensor& x) {
  detail::check_forward_input("SelfAttentionV2", x,
                              {options.d_in(), /*context_length=*/0, /*allow_unbatched=*/true},
                              W_query->weight);
  return F::attention_with_weights(W_query(x), W_key(x), W_value(x),
                                   F::AttentionOptions().backend(AttentionBackend::kMath));
}

}  // namespace attnkit
