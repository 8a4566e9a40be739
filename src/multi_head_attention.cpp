#include "attnkit/multi_head_attention.h"

#include <vector>

#include <torch/version.h>

#include "checks.h"
#include "module_helpers.h"

namespace attnkit {

namespace F = attnkit::functional;

namespace {

void check_multi_head_options(const char* name, const MultiHeadAttentionOptions& options) {
  detail::check_positive_option(name, "d_in", options.d_in());
  detail::check_positive_option(name, "d_out", options.d_out());
  detail::check_positive_option(name, "context_length", options.context_length());
  detail::check_positive_option(name, "num_heads", options.num_heads());
  detail::check_dropout_option(name, options.dropout());
  detail::check_positive_option(name, "chunk_size", options.chunk_size());
  detail::check_positive_option(name, "key_chunk_size", options.key_chunk_size());
  TORCH_CHECK(options.d_out() % options.num_heads() == 0, "[", name,
              "] option d_out must be divisible by num_heads, got d_out = ", options.d_out(),
              ", num_heads = ", options.num_heads());
}

void print_multi_head_options(std::ostream& stream, const char* name,
                              const MultiHeadAttentionOptions& options) {
  stream << "attnkit::" << name << "(d_in=" << options.d_in() << ", d_out=" << options.d_out()
         << ", context_length=" << options.context_length()
         << ", dropout=" << detail::option_text(options.dropout())
         << ", num_heads=" << options.num_heads()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias())
         << ", causal=" << detail::option_text(options.causal())
         << ", backend=" << backend_name(options.backend())
         << ", chunk_size=" << options.chunk_size()
         << ", key_chunk_size=" << options.key_chunk_size() << ")";
}

// The book's path: attention over split heads (b, h, n, hd) with the `mask` buffer, then
// heads merged and projected; also returns the weights.
F::AttentionOutput attend_heads(const torch::Tensor& queries, const torch::Tensor& keys,
                                const torch::Tensor& values, const MultiHeadAttentionOptions& opt,
                                const torch::Tensor& mask_buffer, bool training,
                                torch::nn::Linear& out_proj) {
  auto sdpa = F::SdpaOptions().dropout_p(opt.dropout()).training(training);
  if (opt.causal()) {
    sdpa.attn_mask(detail::mask_for(mask_buffer, queries.size(2)));
  }
  auto attended = F::scaled_dot_product_attention_with_weights(queries, keys, values, sdpa);
  return {out_proj(detail::merge_heads(attended.context)), attended.weights};
}

// Seed 001's layout: (b, n, 3 * d_out) -> 3 x (b, h, n, hd).
std::vector<torch::Tensor> split_combined_qkv(const torch::Tensor& qkv_out, int64_t num_heads) {
  const auto b = qkv_out.size(0);
  const auto n = qkv_out.size(1);
  const auto head_width = qkv_out.size(2) / num_heads;  // 3 * hd
  // (b, n, 3 * d_out) -> (b, n, h, 3 * hd) -> (b, h, n, 3 * hd)
  return qkv_out.view({b, n, num_heads, head_width}).permute({0, 2, 1, 3}).chunk(3, -1);
}

// The module's causal and dropout options for the fused backend.
F::FusedOptions fused_options(const MultiHeadAttentionOptions& opt, bool training) {
  return F::FusedOptions().is_causal(opt.causal()).dropout_p(opt.dropout()).training(training);
}

// The fused and chunked backends' attention over split heads: (b, h, n, hd) x (b, h, m, hd)
// -> (b, h, n, hd); query i at key position query_offset + i.
torch::Tensor fast_attention(const torch::Tensor& queries, const torch::Tensor& keys,
                             const torch::Tensor& values, const MultiHeadAttentionOptions& opt,
                             bool training, int64_t query_offset = 0) {
  if (opt.backend() == AttentionBackend::kChunked) {
    return F::chunked_attention(queries, keys, values,
                                F::ChunkedOptions()
                                    .is_causal(opt.causal())
                                    .query_offset(query_offset)
                                    .dropout_p(opt.dropout())
                                    .training(training)
                                    .block_size(opt.chunk_size())
                                    .key_block_size(opt.key_chunk_size()));
  }
  return F::fused_backend_attention(queries, keys, values,
                                    fused_options(opt, training).query_offset(query_offset));
}

KVCache make_cache_for(const char* name, const MultiHeadAttentionOptions& opt,
                       const torch::Tensor& parameter, int64_t batch, int64_t capacity) {
  TORCH_CHECK(batch >= 1, "[", name, "::make_kv_cache] batch must be >= 1, got ", batch);
  TORCH_CHECK(capacity >= 0 && capacity <= opt.context_length(), "[", name,
              "::make_kv_cache] capacity must be in [1, context_length = ", opt.context_length(),
              "] (0: context_length), got ", capacity);
  const auto h = opt.num_heads();
  return KVCache(batch, h, opt.d_out() / h, capacity == 0 ? opt.context_length() : capacity,
                 parameter.options());
}

// Everything that can be wrong with a forward_with_cache call, checked before anything is
// computed or written to the cache.
void check_cached_call(const char* name, const MultiHeadAttentionOptions& opt, bool training,
                       const torch::Tensor& x, const KVCache& cache,
                       const torch::Tensor& parameter) {
  TORCH_CHECK(!training, "[", name,
              "::forward_with_cache] the KV cache is for inference, but the module is in "
              "training mode: call eval() first (training runs forward over whole sequences)");
  TORCH_CHECK(opt.causal(), "[", name,
              "::forward_with_cache] needs causal attention: with causal = false every token "
              "also attends to later ones, which a cache of earlier tokens cannot give");
  detail::check_forward_input(name, x, {opt.d_in()}, parameter);
  const auto h = opt.num_heads();
  const auto hd = opt.d_out() / h;
  TORCH_CHECK(cache.capacity() > 0, "[", name,
              "::forward_with_cache] the cache has no storage; make one with make_kv_cache");
  TORCH_CHECK(cache.batch() == x.size(0) && cache.num_heads() == h && cache.head_dim() == hd, "[",
              name, "::forward_with_cache] cache: expected (batch, num_heads, head_dim) = (",
              x.size(0), ", ", h, ", ", hd, "), got (", cache.batch(), ", ", cache.num_heads(),
              ", ", cache.head_dim(), ")");
  TORCH_CHECK(cache.options().dtype() == parameter.dtype() &&
                  cache.options().device() == parameter.device(),
              "[", name, "::forward_with_cache] cache: expected dtype ", parameter.scalar_type(),
              " on ", parameter.device(), " (the module's parameters), got ",
              cache.options().dtype(), " on ", cache.options().device());
  const int64_t n = x.size(1);
  const int64_t end = cache.size() + n;
  TORCH_CHECK(end <= opt.context_length(), "[", name, "::forward_with_cache] x: ", n,
              " tokens after the ", cache.size(), " the cache holds would reach position ", end,
              ", past context_length = ", opt.context_length());
  TORCH_CHECK(end <= cache.capacity(), "[", name, "::forward_with_cache] x: ", n,
              " tokens after the ", cache.size(), " the cache holds would pass its capacity ",
              cache.capacity(), "; make a larger one with make_kv_cache(batch, capacity)");
}

// The cached step after the projections: keys and values (b, h, n, hd) appended, queries
// (b, h, n, hd) at positions [start, start + n) against all keys held, heads merged and
// projected -> (b, n, d_out).
torch::Tensor attend_with_cache(const torch::Tensor& queries, const torch::Tensor& keys,
                                const torch::Tensor& values, const MultiHeadAttentionOptions& opt,
                                const torch::Tensor& mask_buffer, KVCache& cache,
                                torch::nn::Linear& out_proj) {
  const int64_t start = cache.size();
  const int64_t n = queries.size(2);
  const auto [all_keys, all_values] = cache.append(keys, values);
  torch::Tensor context;
  if (opt.backend() == AttentionBackend::kMath) {
    // As the book's bonus code: rows [start, start + n) and keys [0, start + n) of `mask`.
    const auto mask =
        mask_buffer.slice(0, start, start + n).slice(1, 0, start + n).to(torch::kBool);
    context = F::scaled_dot_product_attention(queries, all_keys, all_values,
                                              F::SdpaOptions().attn_mask(mask));
  } else {
    context = fast_attention(queries, all_keys, all_values, opt, /*training=*/false, start);
  }
  return out_proj(detail::merge_heads(context));
}

}  // namespace

std::string backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kMath:
      return "math";
    case AttentionBackend::kFused:
      return "fused";
    case AttentionBackend::kChunked:
      return "chunked";
  }
  return "unknown";
}

AttentionBackend parse_backend(const std::string& name) {
  if (name == "math")
    return AttentionBackend::kMath;
  if (name == "fused")
    return AttentionBackend::kFused;
  TORCH_CHECK(name == "chunked", "[parse_backend] unknown backend '", name,
              "'; expected math, fused or chunked");
  return AttentionBackend::kChunked;
}

// ---- MultiHeadAttentionWrapper ------------------------------------------------------------

MultiHeadAttentionWrapperImpl::MultiHeadAttentionWrapperImpl(
    const MultiHeadAttentionWrapperOptions& options)
    : options(options) {
  reset();
}

void MultiHeadAttentionWrapperImpl::reset() {
  const char* name = "MultiHeadAttentionWrapper";
  detail::check_positive_option(name, "num_heads", options.num_heads());
  // The heads validate the remaining options (and name themselves in the message).
  heads = register_module("heads", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_heads(); ++i) {
    heads->push_back(
        CausalAttention(CausalAttentionOptions(options.d_in(), options.d_out(),
                                               options.context_length(), options.dropout())
                            .qkv_bias(options.qkv_bias())));
  }
}

void MultiHeadAttentionWrapperImpl::reset_parameters() {
  for (auto& head : *heads) {
    head->as<CausalAttentionImpl>()->reset_parameters();
  }
}

void MultiHeadAttentionWrapperImpl::pretty_print(std::ostream& stream) const {
  stream << "attnkit::MultiHeadAttentionWrapper(d_in=" << options.d_in()
         << ", d_out=" << options.d_out() << ", context_length=" << options.context_length()
         << ", dropout=" << detail::option_text(options.dropout())
         << ", num_heads=" << options.num_heads()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias()) << ")";
}

F::AttentionOutput MultiHeadAttentionWrapperImpl::forward_with_weights(const torch::Tensor& x) {
  std::vector<torch::Tensor> contexts;
  std::vector<torch::Tensor> weights;
  for (auto& head : *heads) {
    auto out = head->as<CausalAttentionImpl>()->forward_with_weights(x);
    contexts.push_back(out.context);
    weights.push_back(out.weights);
  }
  // h x (b, n, d_out) -> (b, n, h * d_out); h x (b, n, n) -> (b, h, n, n)
  return {torch::cat(contexts, -1), torch::stack(weights, 1)};
}

torch::Tensor MultiHeadAttentionWrapperImpl::forward(const torch::Tensor& x) {
  return forward_with_weights(x).context;
}

// ---- MultiHeadAttention -----------------------------------------------------------------

MultiHeadAttentionImpl::MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options)
    : options(options) {
  reset();
}

void MultiHeadAttentionImpl::reset() {
  check_multi_head_options("MultiHeadAttention", options);
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  const auto projection = torch::nn::LinearOptions(d_in, d_out).bias(options.qkv_bias());
  // Creation order fixes the random draws: query, key, value, out_proj, as in Python.
  W_query = register_module("W_query", torch::nn::Linear(projection));
  W_key = register_module("W_key", torch::nn::Linear(projection));
  W_value = register_module("W_value", torch::nn::Linear(projection));
  out_proj = register_module("out_proj", torch::nn::Linear(d_out, d_out));
  mask = register_buffer("mask", detail::causal_mask_buffer(options.context_length()));
}

void MultiHeadAttentionImpl::reset_parameters() {
  W_query->reset_parameters();
  W_key->reset_parameters();
  W_value->reset_parameters();
  out_proj->reset_parameters();
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  print_multi_head_options(stream, "MultiHeadAttention", options);
}

F::AttentionOutput MultiHeadAttentionImpl::forward_with_weights(const torch::Tensor& x) {
  detail::check_forward_input("MultiHeadAttention", x, {options.d_in(), options.context_length()},
                              W_query->weight);
  const auto h = options.num_heads();
  return attend_heads(detail::split_heads(W_query(x), h), detail::split_heads(W_key(x), h),
                      detail::split_heads(W_value(x), h), options, mask, is_training(), out_proj);
}

KVCache MultiHeadAttentionImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return make_cache_for("MultiHeadAttention", options, W_query->weight, batch, capacity);
}

torch::Tensor MultiHeadAttentionImpl::forward_with_cache(const torch::Tensor& x, KVCache& cache) {
  check_cached_call("MultiHeadAttention", options, is_training(), x, cache, W_query->weight);
  torch::NoGradGuard no_grad;
  // Three projections, not forward()'s one GEMM over concatenated weights: per decoded
  // token that concatenation would copy all three weight matrices.
  const auto h = options.num_heads();
  return attend_with_cache(detail::split_heads(W_query(x), h), detail::split_heads(W_key(x), h),
                           detail::split_heads(W_value(x), h), options, mask, cache, out_proj);
}

torch::Tensor MultiHeadAttentionImpl::forward(const torch::Tensor& x) {
  if (options.backend() == AttentionBackend::kMath) {
    return forward_with_weights(x).context;
  }
  detail::check_forward_input("MultiHeadAttention", x, {options.d_in(), options.context_length()},
                              W_query->weight);
  // One GEMM for Q, K and V: the three weights stacked into (3 * d_out, d_in).
  const auto weight = torch::cat({W_query->weight, W_key->weight, W_value->weight});
  const auto bias = options.qkv_bias() ? torch::cat({W_query->bias, W_key->bias, W_value->bias})
                                       : torch::Tensor();
  const auto qkv = torch::nn::functional::linear(x, weight, bias);  // (b, n, 3 * d_out)
  const auto h = options.num_heads();
#if TORCH_VERSION_MAJOR < 2
  const auto n = x.size(1);
  if (options.backend() == AttentionBackend::kFused &&
      F::fused_attention_fits(n, n, qkv.options())) {
    // The kernel reads the packed projection in place and returns the heads merged.
    return out_proj(F::fused_packed_attention(qkv, h, fused_options(options, is_training())));
  }
#endif
  const auto qkv_parts = qkv.chunk(3, -1);
  const auto queries = detail::split_heads(qkv_parts[0], h);
  const auto keys = detail::split_heads(qkv_parts[1], h);
  const auto values = detail::split_heads(qkv_parts[2], h);
  const auto context = fast_attention(queries, keys, values, options, is_training());
  return out_proj(detail::merge_heads(context));
}

// ---- MultiHeadAttentionCombinedQKV ------------------------------------------------------

MultiHeadAttentionCombinedQKVImpl::MultiHeadAttentionCombinedQKVImpl(
    const MultiHeadAttentionCombinedQKVOptions& options)
    : options(options) {
  reset();
}

void MultiHeadAttentionCombinedQKVImpl::reset() {
  check_multi_head_options("MultiHeadAttentionCombinedQKV", options);
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  qkv = register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(d_in, 3 * d_out).bias(options.qkv_bias())));
  out_proj = register_module("out_proj", torch::nn::Linear(d_out, d_out));
  mask = register_buffer("mask", detail::causal_mask_buffer(options.context_length()));
}

void MultiHeadAttentionCombinedQKVImpl::reset_parameters() {
  qkv->reset_parameters();
  out_proj->reset_parameters();
}

void MultiHeadAttentionCombinedQKVImpl::pretty_print(std::ostream& stream) const {
  print_multi_head_options(stream, "MultiHeadAttentionCombinedQKV", options);
}

F::AttentionOutput MultiHeadAttentionCombinedQKVImpl::forward_with_weights(const torch::Tensor& x) {
  detail::check_forward_input("MultiHeadAttentionCombinedQKV", x,
                              {options.d_in(), options.context_length()}, qkv->weight);
  const auto q_k_v = split_combined_qkv(qkv(x), options.num_heads());
  return attend_heads(q_k_v[0], q_k_v[1], q_k_v[2], options, mask, is_training(), out_proj);
}

KVCache MultiHeadAttentionCombinedQKVImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return make_cache_for("MultiHeadAttentionCombinedQKV", options, qkv->weight, batch, capacity);
}

torch::Tensor MultiHeadAttentionCombinedQKVImpl::forward_with_cache(const torch::Tensor& x,
                                                                    KVCache& cache) {
  check_cached_call("MultiHeadAttentionCombinedQKV", options, is_training(), x, cache, qkv->weight);
  torch::NoGradGuard no_grad;
  const auto q_k_v = split_combined_qkv(qkv(x), options.num_heads());
  return attend_with_cache(q_k_v[0], q_k_v[1], q_k_v[2], options, mask, cache, out_proj);
}

torch::Tensor MultiHeadAttentionCombinedQKVImpl::forward(const torch::Tensor& x) {
  if (options.backend() == AttentionBackend::kMath) {
    return forward_with_weights(x).context;
  }
  detail::check_forward_input("MultiHeadAttentionCombinedQKV", x,
                              {options.d_in(), options.context_length()}, qkv->weight);
  const auto q_k_v = split_combined_qkv(qkv(x), options.num_heads());
  const auto context = fast_attention(q_k_v[0], q_k_v[1], q_k_v[2], options, is_training());
  return out_proj(detail::merge_heads(context));
}

void MultiHeadAttentionCombinedQKVImpl::copy_weights_from(const MultiHeadAttentionImpl& mha) {
  const auto& o = mha.options;
  const auto describe = [](const MultiHeadAttentionOptions& opt) {
    return c10::str("d_in = ", opt.d_in(), ", d_out = ", opt.d_out(),
                    ", num_heads = ", opt.num_heads(),
                    ", qkv_bias = ", opt.qkv_bias() ? "true" : "false");
  };
  TORCH_CHECK(o.d_in() == options.d_in() && o.d_out() == options.d_out() &&
                  o.num_heads() == options.num_heads() && o.qkv_bias() == options.qkv_bias(),
              "[MultiHeadAttentionCombinedQKV::copy_weights_from] mha: expected ",
              describe(options), "; got ", describe(o));
  const auto h = options.num_heads();
  const auto interleave = [h](const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v) {
    // 3 x (h * hd, ...) -> (3, h, hd, ...) -> (h, 3, hd, ...) -> (h * 3 * hd, ...)
    return torch::stack({q, k, v}).unflatten(1, {h, q.size(0) / h}).transpose(0, 1).flatten(0, 2);
  };
  torch::NoGradGuard no_grad;
  qkv->weight.copy_(interleave(mha.W_query->weight, mha.W_key->weight, mha.W_value->weight));
  if (options.qkv_bias()) {
    qkv->bias.copy_(interleave(mha.W_query->bias, mha.W_key->bias, mha.W_value->bias));
  }
  out_proj->weight.copy_(mha.out_proj->weight);
  out_proj->bias.copy_(mha.out_proj->bias);
}

}  // namespace attnkit
