#include "attnkit/causal_attention.h"

#include "core/base/checks.h"
#include "modules/module_helpers.h"

namespace attnkit {

namespace F = attnkit::functional;

CausalAttentionImpl::CausalAttentionImpl(const CausalAttentionOptions& options) : options(options) {
  reset();
}

void CausalAttentionImpl::reset() {
  const char* name = "CausalAttention";
  detail::check_positive_option(name, "d_in", options.d_in());
  detail::check_positive_option(name, "d_out", options.d_out());
  detail::check_positive_option(name, "context_length", options.context_length());
  detail::check_dropout_option(name, options.dropout());
  const auto linear =
      torch::nn::LinearOptions(options.d_in(), options.d_out()).bias(options.qkv_bias());
  // Creation order fixes the random draws: query, key, value, as in Python. The Linear
  // constructors initialise themselves, so no second reset_parameters() pass here.
  W_query = register_module("W_query", torch::nn::Linear(linear));
  W_key = register_module("W_key", torch::nn::Linear(linear));
  W_value = register_module("W_value", torch::nn::Linear(linear));
  mask = register_buffer("mask", detail::causal_mask_buffer(options.context_length()));
}

void CausalAttentionImpl::reset_parameters() {
  W_query->reset_parameters();
  W_key->reset_parameters();
  W_value->reset_parameters();
}

void CausalAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::CausalAttention(d_in=" << options.d_in() << ", d_out=" << options.d_out()
         << ", context_length=" << options.context_length()
         << ", dropout=" << detail::option_text(options.dropout())
         << ", qkv_bias=" << detail::option_text(options.qkv_bias()) << ")";
}

F::AttentionOutput CausalAttentionImpl::forward_with_weights(const torch::Tensor& x) {
  detail::check_forward_input("CausalAttention", x, {options.d_in(), options.context_length()},
                              W_query->weight);
  const auto num_tokens = x.size(1);
  // The buffer's corner, 1 = hidden, as the keys each query may see.
  const auto allowed = detail::mask_for(mask, num_tokens).logical_not();
  return F::attention_with_weights(W_query(x), W_key(x), W_value(x),
                                   F::AttentionOptions()
                                       .mask(Mask::from_tensor(allowed))
                                       .dropout_p(options.dropout())
                                       .training(is_training())
                                       .backend(AttentionBackend::kMath));
}

torch::Tensor CausalAttentionImpl::forward(const torch::Tensor& x) {
  return forward_with_weights(x).context;
}

}  // namespace attnkit
