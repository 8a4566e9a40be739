#include "attnkit/latent_attention.h"

#include <algorithm>

#include "core/base/checks.h"
#include "core/plan/kernel_spec.h"
#include "modules/module_attention.h"
#include "modules/module_helpers.h"

namespace attnkit {

namespace {

constexpr const char* kMlaName = "MultiHeadLatentAttention";

detail::ModuleAttention settings_of(const MultiHeadLatentAttentionOptions& opt) {
  return detail::module_attention_of(opt, /*causal=*/true, /*window_size=*/c10::nullopt);
}

// A decode step's heads (b, h, 1, hd) from queries (b, h, 1, hd) and latents (b, m, latent):
// with `rows` (a ragged append's span) row r sees latents [0, rows->ends[r]) up to its own
// position, else every latent.
torch::Tensor attend_latents(MultiHeadLatentAttentionImpl& module, const torch::Tensor& queries,
                             const torch::Tensor& latents, const KVCache::RaggedSpan* rows) {
  // The up-projections absorbed into the query and the output (DeepSeek-V2's decode form):
  // head i's score of latent c is q_i . (W_UK_i c + b_UK_i), whose bias term is the same for
  // every key and so leaves the softmax unchanged; its output is W_UV_i (sum_j p_j c_j) +
  // b_UV_i, as the weights sum to 1. One query then reads the latents in place instead of
  // recomputing every cached key and value each step.
  const auto h = module.options.num_heads();
  const auto hd = module.options.d_out() / h, latent = module.latent_dim();
  const auto keys = latents.unsqueeze(1);  // (b, 1, m, latent): one key/value head
  const auto up_keys = module.W_UK->weight.view({h, hd, latent});
  const auto query_latents = torch::matmul(queries, up_keys);  // (b, h, 1, latent)
  // The scale of the heads' width, not the latents'.
  auto settings = settings_of(module.options);
  settings.options.scale(module.options.scale().value_or(detail::default_scale(hd)));
  const auto context_latents = detail::attend_step(query_latents, keys, keys, settings,
                                                   /*query_offset=*/latents.size(1) - 1,
                                                   /*mask=*/{}, rows);
  auto context = torch::matmul(
      context_latents, module.W_UV->weight.view({h, hd, latent}).transpose(1, 2));  // (b, h, 1, hd)
  if (module.W_UV->bias.defined())
    context = context + module.W_UV->bias.view({h, 1, hd});
  return context;
}

}  // namespace

MultiHeadLatentAttentionImpl::MultiHeadLatentAttentionImpl(
    const MultiHeadLatentAttentionOptions& options)
    : options(options) {
  reset();
}

int64_t MultiHeadLatentAttentionImpl::latent_dim() const {
  return options.latent_dim().value_or(std::max<int64_t>(16, options.d_out() / 8));
}

void MultiHeadLatentAttentionImpl::reset() {
  detail::check_multi_head_options(kMlaName, options);
  if (options.latent_dim().has_value())
    detail::check_positive_option(kMlaName, "latent_dim", *options.latent_dim());
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  const auto latent = latent_dim();
  const auto linear = [bias = options.qkv_bias()](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  // Creation order fixes the random draws: as in Python.
  W_query = register_module("W_query", linear(d_in, d_out));
  W_DKV = register_module("W_DKV", linear(d_in, latent));
  W_UK = register_module("W_UK", linear(latent, d_out));
  W_UV = register_module("W_UV", linear(latent, d_out));
  out_proj = register_module("out_proj", torch::nn::Linear(d_out, d_out));
}

void MultiHeadLatentAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::MultiHeadLatentAttention(d_in=" << options.d_in()
         << ", d_out=" << options.d_out() << ", dropout=" << detail::option_text(options.dropout())
         << ", num_heads=" << options.num_heads()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias())
         << ", latent_dim=" << latent_dim() << ", backend=" << backend_name(options.backend())
         << ", query_block_size=" << options.query_block_size()
         << ", key_block_size=" << options.key_block_size();
  detail::print_score_options(stream, options.score_mod(), options.scale());
  stream << ")";
}

// Keys and values up-projected from the latents
// (b, m, latent_dim) of their inputs (one set when they are the same tensor).
functional::AttentionOutput MultiHeadLatentAttentionImpl::attend_inputs(const torch::Tensor& query,
                                                                        const torch::Tensor& key,
                                                                        const torch::Tensor& value,
                                                                        const Mask& mask,
                                                                        bool with_weights) {
  const auto& opt = options;
  const auto [key_input, value_input] =
      detail::key_value_inputs(kMlaName, query, key, value, {opt.d_in()}, W_query->weight);
  const auto h = opt.num_heads();
  const auto key_latents = W_DKV(key_input);
  const auto value_latents = value_input.is_same(key_input) ? key_latents : W_DKV(value_input);
  auto attended = detail::attend(detail::split_heads(W_query(query), h),
                                 detail::split_heads(W_UK(key_latents), h),
                                 detail::split_heads(W_UV(value_latents), h), settings_of(opt),
                                 is_training(), /*query_offset=*/0, with_weights, mask);
  return {out_proj(detail::merge_heads(attended.context)), attended.weights};
}

KVCache MultiHeadLatentAttentionImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return detail::make_module_cache(kMlaName, {1, latent_dim(), 0, /*latent=*/true},
                                   /*context_length=*/0, W_query->weight, batch, capacity);
}

torch::Tensor MultiHeadLatentAttentionImpl::attend_new_tokens(const torch::Tensor& x,
                                                              KVCache& cache,
                                                              const torch::Tensor& lengths,
                                                              const Mask& mask) {
  const auto new_lengths = detail::check_cached_call(
      kMlaName, is_training(), x, options.d_in(), /*context_length=*/0, cache,
      {1, latent_dim(), 0, /*latent=*/true}, W_query->weight, mask, lengths);
  torch::NoGradGuard no_grad;
  const auto h = options.num_heads();
  const detail::ValidTokens tokens(x, new_lengths);
  const auto queries = detail::split_heads(detail::project(W_query, x, tokens), h);
  const auto new_latents = detail::project(W_DKV, x, tokens);  // (b, n, latent_dim)
  // The absorbed form drops W_UK's bias term, a per-row constant: a score function (a
  // softcap) would not leave it out of the softmax.
  const bool decode_step =
      x.size(1) == 1 && mask.is_none() && !(options.score_mod() && W_UK->bias.defined());
  if (!new_lengths.empty()) {
    const auto span = cache.append_latent_ragged(new_latents, new_lengths);  // (b, m, latent)
    if (decode_step) {
      const auto context = attend_latents(*this, queries, span.keys, &span);
      return detail::project(out_proj, detail::merge_heads(context));
    }
    const auto context = detail::attend_step(queries, detail::split_heads(W_UK(span.keys), h),
                                             detail::split_heads(W_UV(span.keys), h),
                                             settings_of(options), /*query_offset=*/0, mask, &span);
    return detail::project(out_proj, detail::merge_heads(context), tokens);
  }
  const int64_t start = cache.size();
  const auto latents = cache.append_latent(new_latents);  // (b, start + n, latent_dim)
  if (decode_step) {
    const auto context = attend_latents(*this, queries, latents, /*rows=*/nullptr);
    return detail::project(out_proj, detail::merge_heads(context));
  }
  const auto context =
      detail::attend_step(queries, detail::split_heads(W_UK(latents), h),
                          detail::split_heads(W_UV(latents), h), settings_of(options), start, mask);
  return out_proj(detail::merge_heads(context));
}

}  // namespace attnkit
