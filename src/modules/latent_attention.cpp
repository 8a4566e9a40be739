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

// The up-projections absorbed into the query and the output (DeepSeek-V2's decode form):
// head i's score of latent c is q_i . (W_UK_i c + b_UK_i), whose bias term is the same for
// every key and so leaves the softmax unchanged (unless a score function transforms the
// scores: see bias_column); its output is W_UV_i (sum_j p_j c_j) + b_UV_i, as the weights sum
// to 1. A query then reads the latents in place instead of recomputing every cached key and
// value each step.

// Queries (b, h, n, hd) -> their images in latent space (b, h, n, latent): q_i W_UK_i.
torch::Tensor absorbed_queries(const MultiHeadLatentAttentionImpl& module,
                               const torch::Tensor& queries) {
  const auto h = module.options.num_heads();
  const auto hd = module.options.d_out() / h;
  return torch::matmul(queries, module.W_UK->weight.view({h, hd, module.latent_dim()}));
}

// Weighted sums of latents (b, h, n, latent) -> the heads' contexts (b, h, n, hd). W_UV's
// bias is weighted by the sum of the weights, `weight_sums` (b, h, n, 1): 0 for a query a
// mask leaves no key, whose context is zeros; undefined: 1.
torch::Tensor up_projected_context(const MultiHeadLatentAttentionImpl& module,
                                   const torch::Tensor& context_latents,
                                   const torch::Tensor& weight_sums = {}) {
  const auto h = module.options.num_heads();
  const auto hd = module.options.d_out() / h;
  auto context = torch::matmul(
      context_latents,
      module.W_UV->weight.view({h, hd, module.latent_dim()}).transpose(1, 2));  // (b, h, n, hd)
  if (module.W_UV->bias.defined()) {
    const auto bias = module.W_UV->bias.view({h, 1, hd});
    context = context + (weight_sums.defined() ? weight_sums * bias : bias);
  }
  return context;
}

// The settings of attention in latent space: the scale of the heads' width, not the latents'.
detail::ModuleAttention latent_settings_of(const MultiHeadLatentAttentionImpl& module) {
  auto settings = settings_of(module.options);
  settings.options.scale(module.options.scale().value_or(
      detail::default_scale(module.options.d_out() / module.options.num_heads())));
  return settings;
}

// Whether paged latents carry a column of ones (with qkv_bias), and absorbed queries their
// bias term q_i . b_UK_i there: the exact scores, for a score function (a softcap) would not
// leave the bias term out of the softmax; and the column's weighted sum is the weights' sum,
// by which W_UV's bias counts (0 for a query a mask leaves no key).
bool bias_column(const MultiHeadLatentAttentionImpl& module) {
  return module.W_UK->bias.defined();
}

detail::CacheLayout paged_layout_of(const MultiHeadLatentAttentionImpl& module) {
  return {1, module.latent_dim() + (bias_column(module) ? 1 : 0), 0, /*latent=*/true};
}

// A decode step's heads (b, h, 1, hd) from queries (b, h, 1, hd) and latents (b, m, latent):
// with `rows` (a ragged append's span) row r sees latents [0, rows->ends[r]) up to its own
// position, else every latent.
torch::Tensor attend_latents(MultiHeadLatentAttentionImpl& module, const torch::Tensor& queries,
                             const torch::Tensor& latents, const KVCache::RaggedSpan* rows) {
  const auto keys = latents.unsqueeze(1);  // (b, 1, m, latent): one key/value head
  const auto context_latents =
      detail::attend_step(absorbed_queries(module, queries), keys, keys, latent_settings_of(module),
                          /*query_offset=*/latents.size(1) - 1, /*mask=*/{}, rows);
  return up_projected_context(module, context_latents);
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

PagedKVCache MultiHeadLatentAttentionImpl::make_paged_kv_cache(int64_t num_pages,
                                                               int64_t page_size) const {
  return detail::make_module_paged_cache(paged_layout_of(*this), W_query->weight, num_pages,
                                         page_size);
}

torch::Tensor MultiHeadLatentAttentionImpl::attend_paged_tokens(
    const torch::Tensor& x, PagedKVCache& cache, const std::vector<int64_t>& sequences,
    const Mask& mask) {
  const auto h = options.num_heads();
  detail::check_paged_call(kMlaName, is_training(), x, options.d_in(), /*context_length=*/0, cache,
                           paged_layout_of(*this), W_query->weight, sequences, options.score_mod(),
                           /*rope=*/{}, h, mask);
  torch::NoGradGuard no_grad;
  const auto queries = detail::split_heads(W_query(x), h);  // (b, h, n, hd)
  auto latents = W_DKV(x);                                  // (b, n, latent)
  auto query_latents = absorbed_queries(*this, queries);    // (b, h, n, latent)
  if (bias_column(*this)) {
    // [c, 1] . [q_i W_UK_i, q_i . b_UK_i] = q_i . (W_UK_i c + b_UK_i): head i's exact score.
    latents = torch::cat({latents, torch::ones_like(latents.narrow(2, 0, 1))}, 2);
    const auto hd = options.d_out() / h;
    const auto bias_terms = (queries * W_UK->bias.view({h, 1, hd})).sum(-1, true);  // (b,h,n,1)
    query_latents = torch::cat({query_latents, bias_terms}, 3);
  }
  for (size_t r = 0; r < sequences.size(); ++r)
    cache.append(sequences[r], latents[static_cast<int64_t>(r)].unsqueeze(0));  // (1, n, width)
  const auto context_latents =
      paged_attention(query_latents, cache.view(sequences),
                      detail::paged_options_of(latent_settings_of(*this), mask));
  const auto latent = latent_dim();
  const auto context = up_projected_context(
      *this, context_latents.narrow(3, 0, latent),
      bias_column(*this) ? context_latents.narrow(3, latent, 1) : torch::Tensor());
  return out_proj(detail::merge_heads(context));
}

torch::Tensor MultiHeadLatentAttentionImpl::attend_new_tokens(const torch::Tensor& x,
                                                              KVCache& cache,
                                                              const torch::Tensor& lengths,
                                                              const Mask& mask) {
  const auto new_lengths = detail::check_cached_call(
      kMlaName, is_training(), x, options.d_in(), /*context_length=*/0, cache,
      {1, latent_dim(), 0, /*latent=*/true}, W_query->weight, mask, lengths, options.num_heads());
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
