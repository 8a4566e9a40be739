#include "attnkit/grouped_query_attention.h"

#include "core/base/checks.h"
#include "modules/module_attention.h"
#include "modules/module_helpers.h"

namespace attnkit {

namespace {

constexpr const char* kGqaName = "GroupedQueryAttention";

// The core's settings from the options, with the module's sinks (undefined without).
detail::ModuleAttention settings_of(const GroupedQueryAttentionOptions& opt,
                                    const torch::Tensor& sinks) {
  auto settings = detail::module_attention_of(opt, /*causal=*/true, opt.sliding_window_size());
  settings.options.sinks(sinks);
  return settings;
}

detail::CacheLayout cache_layout_of(const GroupedQueryAttentionOptions& opt) {
  return {opt.num_kv_groups(), opt.d_out() / opt.num_heads(), opt.sliding_window_size().value_or(0),
          /*latent=*/false};
}

// A cached step: x (b, n, d_in) projected to query, key and value heads (on the valid tokens
// alone where `new_lengths` makes that pay), `attend_heads`, then the heads merged and
// projected -> (b, n, output_dim).
torch::Tensor projected_step(GroupedQueryAttentionImpl& module, const torch::Tensor& x,
                             const std::vector<int64_t>& new_lengths,
                             const detail::AttendHeads& attend_heads) {
  const auto g = module.options.num_kv_groups();
  const detail::ValidTokens tokens(x, new_lengths);
  const auto context = attend_heads(
      detail::split_heads(detail::project(module.W_query, x, tokens), module.options.num_heads()),
      detail::split_heads(detail::project(module.W_key, x, tokens), g),
      detail::split_heads(detail::project(module.W_value, x, tokens), g));
  return detail::project(module.out_proj, detail::merge_heads(context), tokens);
}

}  // namespace

GroupedQueryAttentionImpl::GroupedQueryAttentionImpl(const GroupedQueryAttentionOptions& options)
    : options(options) {
  reset();
}

void GroupedQueryAttentionImpl::reset() {
  detail::check_multi_head_options(kGqaName, options);
  detail::check_positive_option(kGqaName, "num_kv_groups", options.num_kv_groups());
  TORCH_CHECK(options.num_heads() % options.num_kv_groups() == 0, "[", kGqaName,
              "] option num_heads must be divisible by num_kv_groups, got num_heads = ",
              options.num_heads(), ", num_kv_groups = ", options.num_kv_groups());
  detail::check_window_option(kGqaName, options.sliding_window_size(), /*causal=*/true);
  TORCH_CHECK(options.qk_norm_eps() > 0.0, "[", kGqaName, "] option qk_norm_eps must be > 0, got ",
              options.qk_norm_eps());
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  const auto output_dim = options.output_dim().value_or(d_out);
  detail::check_positive_option(kGqaName, "output_dim", output_dim);
  const auto kv_width = options.num_kv_groups() * (d_out / options.num_heads());
  const auto bias = options.qkv_bias();
  // Creation order fixes the random draws: key, value, query, out_proj, as in Python.
  W_key = register_module("W_key",
                          torch::nn::Linear(torch::nn::LinearOptions(d_in, kv_width).bias(bias)));
  W_value = register_module("W_value",
                            torch::nn::Linear(torch::nn::LinearOptions(d_in, kv_width).bias(bias)));
  W_query = register_module("W_query",
                            torch::nn::Linear(torch::nn::LinearOptions(d_in, d_out).bias(bias)));
  out_proj = register_module(
      "out_proj", torch::nn::Linear(torch::nn::LinearOptions(d_out, output_dim).bias(false)));
  if (options.sinks())
    sinks = register_parameter("sinks", torch::zeros({options.num_heads()}));
  rope_tables = detail::reset_query_key_transform(
      kGqaName, *this, options.rope(), options.qk_norm(), d_out / options.num_heads(), q_norm,
      k_norm,
      RMSNormOptions(1).eps(options.qk_norm_eps()).unit_offset(options.qk_norm_unit_offset()));
}

void GroupedQueryAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::GroupedQueryAttention(d_in=" << options.d_in()
         << ", d_out=" << options.d_out() << ", dropout=" << detail::option_text(options.dropout())
         << ", num_heads=" << options.num_heads() << ", num_kv_groups=" << options.num_kv_groups()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias())
         << ", sliding_window_size=" << detail::option_text(options.sliding_window_size())
         << ", backend=" << backend_name(options.backend())
         << ", query_block_size=" << options.query_block_size()
         << ", key_block_size=" << options.key_block_size();
  if (options.output_dim())
    stream << ", output_dim=" << *options.output_dim();
  detail::print_query_key_options(stream, options.rope(), options.qk_norm());
  if (options.qk_norm() && options.qk_norm_eps() != 1e-6)
    stream << ", qk_norm_eps=" << detail::option_text(options.qk_norm_eps());
  if (options.qk_norm() && options.qk_norm_unit_offset())
    stream << ", qk_norm_unit_offset=true";
  detail::print_score_options(stream, options.score_mod(), options.scale());
  if (options.sinks())
    stream << ", sinks=true";
  stream << ")";
}

// (b, n, d) -> (b, h, n, hd) queries; (b, g, m, hd) keys
// and values, never repeated; heads merged and projected.
functional::AttentionOutput GroupedQueryAttentionImpl::attend_inputs(const torch::Tensor& query,
                                                                     const torch::Tensor& key,
                                                                     const torch::Tensor& value,
                                                                     const Mask& mask,
                                                                     bool with_weights) {
  const auto& opt = options;
  const auto [key_input, value_input] =
      detail::key_value_inputs(kGqaName, query, key, value, {opt.d_in()}, W_query->weight);
  detail::check_rope_forward(kGqaName, rope_tables, query, key);
  const auto g = opt.num_kv_groups();
  const auto [queries, keys] = detail::QueryKeyTransform{q_norm, k_norm, rope_tables}(
      detail::split_heads(W_query(query), opt.num_heads()),
      detail::split_heads(W_key(key_input), g), int64_t{0});
  auto attended = detail::attend(queries, keys, detail::split_heads(W_value(value_input), g),
                                 settings_of(opt, sinks), is_training(), /*query_offset=*/0,
                                 with_weights, mask);
  return {out_proj(detail::merge_heads(attended.context)), attended.weights};
}

void GroupedQueryAttentionImpl::reset_parameters() {
  detail::reset_child_parameters(*this);
  if (sinks.defined()) {
    torch::NoGradGuard no_grad;
    sinks.zero_();
  }
}

KVCache GroupedQueryAttentionImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return detail::make_module_cache(kGqaName, cache_layout_of(options), /*context_length=*/0,
                                   W_query->weight, batch, capacity);
}

torch::Tensor GroupedQueryAttentionImpl::attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                                           const torch::Tensor& lengths,
                                                           const Mask& mask) {
  const auto new_lengths = detail::check_cached_call(
      kGqaName, is_training(), x, options.d_in(), /*context_length=*/0, cache,
      cache_layout_of(options), W_query->weight, mask, lengths, options.num_heads());
  detail::check_rope_cached_positions(kGqaName, rope_tables, cache, new_lengths, x.size(1));
  torch::NoGradGuard no_grad;
  return projected_step(*this, x, new_lengths, [&](const auto& q, const auto& k, const auto& v) {
    return detail::attend_cached({q_norm, k_norm, rope_tables}, q, k, v, cache,
                                 settings_of(options, sinks), mask, new_lengths);
  });
}

PagedKVCache GroupedQueryAttentionImpl::make_paged_kv_cache(int64_t num_pages,
                                                            int64_t page_size) const {
  return detail::make_module_paged_cache(cache_layout_of(options), W_query->weight, num_pages,
                                         page_size);
}

torch::Tensor GroupedQueryAttentionImpl::attend_paged_tokens(const torch::Tensor& x,
                                                             PagedKVCache& cache,
                                                             const std::vector<int64_t>& sequences,
                                                             const Mask& mask) {
  detail::check_paged_call(kGqaName, is_training(), x, options.d_in(), /*context_length=*/0, cache,
                           cache_layout_of(options), W_query->weight, sequences,
                           options.score_mod(), rope_tables, options.num_heads(), mask);
  torch::NoGradGuard no_grad;
  return projected_step(*this, x, {}, [&](const auto& q, const auto& k, const auto& v) {
    return detail::attend_paged({q_norm, k_norm, rope_tables}, q, k, v, cache, sequences,
                                settings_of(options, sinks), mask);
  });
}

}  // namespace attnkit
