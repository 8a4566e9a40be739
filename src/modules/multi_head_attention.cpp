#include "attnkit/multi_head_attention.h"

#include <tuple>
#include <vector>

#include "core/base/checks.h"
#include "modules/module_attention.h"
#include "modules/module_helpers.h"

namespace attnkit {

namespace F = attnkit::functional;

namespace {

constexpr const char* kName = "MultiHeadAttention";

// reset()'s checks, for MultiHeadAttention and the combined variant.
void check_options(const char* name, const MultiHeadAttentionOptions& options) {
  detail::check_multi_head_options(name, options);
  detail::check_positive_option(name, "context_length", options.context_length());
  detail::check_window_option(name, options.sliding_window_size(), options.causal());
}

void print_multi_head_options(std::ostream& stream, const char* name,
                              const MultiHeadAttentionOptions& options) {
  stream << "attnkit::" << name << "(d_in=" << options.d_in() << ", d_out=" << options.d_out()
         << ", context_length=" << options.context_length()
         << ", dropout=" << detail::option_text(options.dropout())
         << ", num_heads=" << options.num_heads()
         << ", qkv_bias=" << detail::option_text(options.qkv_bias())
         << ", causal=" << detail::option_text(options.causal())
         << ", sliding_window_size=" << detail::option_text(options.sliding_window_size())
         << ", backend=" << backend_name(options.backend())
         << ", query_block_size=" << options.query_block_size()
         << ", key_block_size=" << options.key_block_size();
  detail::print_query_key_options(stream, options.rope(), options.qk_norm());
  detail::print_score_options(stream, options.score_mod(), options.scale());
  stream << ")";
}

// The book's `mask` buffer, as the Python constructor registers it (float32 there, and in the
// parameters' dtype after the model's `.to(dtype)`): triu(ones(L, L), diagonal=1); past
// kLongestContextWithSavedMask, a note in its place.
std::vector<std::pair<std::string, torch::Tensor>> python_mask_state(
    const MultiHeadAttentionOptions& options, const torch::Tensor& parameter) {
  const auto length = options.context_length();
  if (length <= kLongestContextWithSavedMask)
    return {{"mask", torch::triu(torch::ones({length, length}, parameter.options()), 1)}};
  const std::string note = c10::str(
      "attnkit did not save the book's mask buffer (triu(ones(", length, ", ", length, "), 1), ",
      length * length, " values) of this context_length above ", kLongestContextWithSavedMask,
      ": the Python module makes its own; load with strict=False, or drop this key");
  auto text = torch::empty({static_cast<int64_t>(note.size())}, torch::kUInt8);
  std::copy(note.begin(), note.end(), text.data_ptr<uint8_t>());
  return {{"mask_omitted", text}};
}

// The settings the attention core gets from the module's options.
detail::ModuleAttention settings_of(const MultiHeadAttentionOptions& opt) {
  return detail::module_attention_of(opt, opt.causal(), opt.sliding_window_size());
}

// Seed 001's layout: (b, n, 3 * d_out) -> 3 x (b, h, n, hd).
std::vector<torch::Tensor> split_combined_qkv(const torch::Tensor& qkv_out, int64_t num_heads) {
  const auto b = qkv_out.size(0);
  const auto n = qkv_out.size(1);
  const auto head_width = qkv_out.size(2) / num_heads;  // 3 * hd
  // (b, n, 3 * d_out) -> (b, n, h, 3 * hd) -> (b, h, n, 3 * hd)
  return qkv_out.view({b, n, num_heads, head_width}).permute({0, 2, 1, 3}).chunk(3, -1);
}

detail::CacheLayout cache_layout_of(const MultiHeadAttentionOptions& opt) {
  const auto h = opt.num_heads();
  return {h, opt.d_out() / h, opt.sliding_window_size().value_or(0), /*latent=*/false};
}

// forward_with_cache's checks (returning the ragged lengths, empty without `lengths`), then
// its step after the projections: heads (b, h, n, hd) through detail::attend_cached, merged
// and projected -> (b, n, d_out).
std::vector<int64_t> check_cached_mha_call(const char* name, const MultiHeadAttentionOptions& opt,
                                           bool training, const torch::Tensor& x,
                                           const KVCache& cache, const torch::Tensor& parameter,
                                           const Mask& mask, const torch::Tensor& lengths,
                                           const detail::RopeTables& rope) {
  TORCH_CHECK(opt.causal(), "[", name,
              "::forward_with_cache] needs causal attention: with causal = false every token "
              "also attends to later ones, which a cache of earlier tokens cannot give");
  auto new_lengths =
      detail::check_cached_call(name, training, x, opt.d_in(), opt.context_length(), cache,
                                cache_layout_of(opt), parameter, mask, lengths, opt.num_heads());
  detail::check_rope_cached_positions(name, rope, cache, new_lengths, x.size(1));
  return new_lengths;
}

// The paged call's checks, as check_cached_mha_call's.
void check_paged_mha_call(const char* name, const MultiHeadAttentionOptions& opt, bool training,
                          const torch::Tensor& x, const PagedKVCache& cache,
                          const torch::Tensor& parameter, const std::vector<int64_t>& sequences,
                          const detail::RopeTables& rope, const Mask& mask) {
  TORCH_CHECK(opt.causal(), "[", name,
              "::forward_with_cache] needs causal attention: with causal = false every token "
              "also attends to later ones, which a cache of earlier tokens cannot give");
  detail::check_paged_call(name, training, x, opt.d_in(), opt.context_length(), cache,
                           cache_layout_of(opt), parameter, sequences, opt.score_mod(), rope,
                           opt.num_heads(), mask);
}

// The attention of a step on `cache` (contiguous), or on `sequences` of a paged one.
detail::AttendHeads on_cache(const MultiHeadAttentionOptions& opt,
                             const detail::QueryKeyTransform& transform, KVCache& cache,
                             const Mask& mask, const std::vector<int64_t>& new_lengths) {
  return [&opt, transform, &cache, &mask, &new_lengths](const auto& q, const auto& k,
                                                        const auto& v) {
    return detail::attend_cached(transform, q, k, v, cache, settings_of(opt), mask, new_lengths);
  };
}
detail::AttendHeads on_paged_cache(const MultiHeadAttentionOptions& opt,
                                   const detail::QueryKeyTransform& transform, PagedKVCache& cache,
                                   const std::vector<int64_t>& sequences, const Mask& mask) {
  return [&opt, transform, &cache, &sequences, &mask](const auto& q, const auto& k, const auto& v) {
    return detail::attend_paged(transform, q, k, v, cache, sequences, settings_of(opt), mask);
  };
}

}  // namespace

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
  check_options(kName, options);
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  const auto projection = torch::nn::LinearOptions(d_in, d_out).bias(options.qkv_bias());
  // Creation order fixes the random draws: query, key, value, out_proj, as in Python.
  W_query = register_module("W_query", torch::nn::Linear(projection));
  W_key = register_module("W_key", torch::nn::Linear(projection));
  W_value = register_module("W_value", torch::nn::Linear(projection));
  out_proj = register_module("out_proj", torch::nn::Linear(d_out, d_out));
  rope_tables =
      detail::reset_query_key_transform(kName, *this, options.rope(), options.qk_norm(),
                                        options.d_out() / options.num_heads(), q_norm, k_norm);
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  print_multi_head_options(stream, kName, options);
}

std::vector<std::pair<std::string, torch::Tensor>> MultiHeadAttentionImpl::python_only_state()
    const {
  return python_mask_state(options, W_query->weight);
}

F::AttentionOutput MultiHeadAttentionImpl::attend_inputs(const torch::Tensor& query,
                                                         const torch::Tensor& key,
                                                         const torch::Tensor& value,
                                                         const Mask& mask, bool with_weights) {
  const auto [key_input, value_input] = detail::key_value_inputs(
      kName, query, key, value, {options.d_in(), options.context_length()}, W_query->weight);
  detail::check_rope_forward(kName, rope_tables, query, key);
  const auto h = options.num_heads();
  const detail::QueryKeyTransform transform{q_norm, k_norm, rope_tables};
  torch::Tensor queries, keys, values, packed_qkv;
  if (key.defined() || with_weights || options.backend() == AttentionBackend::kMath) {
    // Three projections, as Python makes them (kMath reproduces its numbers); cross-attention
    // projects two inputs.
    queries = detail::split_heads(W_query(query), h);
    keys = detail::split_heads(W_key(key_input), h);
    values = detail::split_heads(W_value(value_input), h);
  } else {
    // One GEMM for Q, K and V: the three weights stacked into (3 * d_out, d_in).
    const auto weight = torch::cat({W_query->weight, W_key->weight, W_value->weight});
    const auto bias = options.qkv_bias() ? torch::cat({W_query->bias, W_key->bias, W_value->bias})
                                         : torch::Tensor();
    const auto qkv = torch::nn::functional::linear(query, weight, bias);  // (b, n, 3 * d_out)
    const auto parts = qkv.chunk(3, -1);
    queries = detail::split_heads(parts[0], h);
    keys = detail::split_heads(parts[1], h);
    values = detail::split_heads(parts[2], h);
    // Without a transform, the heads are views of qkv, which a kernel may read in place.
    if (!transform.active())
      packed_qkv = qkv;
  }
  std::tie(queries, keys) = transform(queries, keys, int64_t{0});
  auto attended = detail::attend(queries, keys, values, settings_of(options), is_training(),
                                 /*query_offset=*/0, with_weights, mask, packed_qkv);
  return {out_proj(detail::merge_heads(attended.context)), attended.weights};
}

KVCache MultiHeadAttentionImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return detail::make_module_cache(kName, cache_layout_of(options), options.context_length(),
                                   W_query->weight, batch, capacity);
}

namespace {

// A cached step: x (b, n, d_in) projected to query, key and value heads (on the valid tokens
// alone where `new_lengths` makes that pay), `attend_heads`, then the heads merged and
// projected -> (b, n, d_out).
torch::Tensor cached_step(MultiHeadAttentionImpl& m, const torch::Tensor& x,
                          const std::vector<int64_t>& new_lengths,
                          const detail::AttendHeads& attend_heads) {
  // Three projections, not forward()'s one GEMM over concatenated weights: per decoded
  // token that concatenation would copy all three weight matrices.
  const auto h = m.options.num_heads();
  const detail::ValidTokens tokens(x, new_lengths);
  const auto context = attend_heads(detail::split_heads(detail::project(m.W_query, x, tokens), h),
                                    detail::split_heads(detail::project(m.W_key, x, tokens), h),
                                    detail::split_heads(detail::project(m.W_value, x, tokens), h));
  return detail::project(m.out_proj, detail::merge_heads(context), tokens);
}

// cached_step for the combined projection.
torch::Tensor cached_step(MultiHeadAttentionCombinedQKVImpl& m, const torch::Tensor& x,
                          const std::vector<int64_t>& new_lengths,
                          const detail::AttendHeads& attend_heads) {
  const detail::ValidTokens tokens(x, new_lengths);
  const auto q_k_v = split_combined_qkv(detail::project(m.qkv, x, tokens), m.options.num_heads());
  const auto context = attend_heads(q_k_v[0], q_k_v[1], q_k_v[2]);
  return detail::project(m.out_proj, detail::merge_heads(context), tokens);
}

}  // namespace

torch::Tensor MultiHeadAttentionImpl::attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                                        const torch::Tensor& lengths,
                                                        const Mask& mask) {
  const auto new_lengths = check_cached_mha_call(kName, options, is_training(), x, cache,
                                                 W_query->weight, mask, lengths, rope_tables);
  torch::NoGradGuard no_grad;
  return cached_step(*this, x, new_lengths,
                     on_cache(options, {q_norm, k_norm, rope_tables}, cache, mask, new_lengths));
}

PagedKVCache MultiHeadAttentionImpl::make_paged_kv_cache(int64_t num_pages,
                                                         int64_t page_size) const {
  return detail::make_module_paged_cache(cache_layout_of(options), W_query->weight, num_pages,
                                         page_size);
}

torch::Tensor MultiHeadAttentionImpl::attend_paged_tokens(const torch::Tensor& x,
                                                          PagedKVCache& cache,
                                                          const std::vector<int64_t>& sequences,
                                                          const Mask& mask) {
  check_paged_mha_call(kName, options, is_training(), x, cache, W_query->weight, sequences,
                       rope_tables, mask);
  torch::NoGradGuard no_grad;
  return cached_step(
      *this, x, {}, on_paged_cache(options, {q_norm, k_norm, rope_tables}, cache, sequences, mask));
}

// ---- MultiHeadAttentionCombinedQKV ------------------------------------------------------

namespace {

constexpr const char* kCombinedName = "MultiHeadAttentionCombinedQKV";

// forward's checks (self-attention only), then 3 x (b, h, n, hd) from the one projection,
// queries and keys normed and rotated as the options say.
std::vector<torch::Tensor> combined_qkv_heads(MultiHeadAttentionCombinedQKVImpl& module,
                                              const torch::Tensor& query, const torch::Tensor& key,
                                              const torch::Tensor& value) {
  const auto shape_or_none = [](const torch::Tensor& t) {
    return t.defined() ? detail::shape_string(t) : std::string("none");
  };
  TORCH_CHECK(!key.defined() && !value.defined(), "[", kCombinedName,
              "::forward] key/value: this module projects queries, keys and values from one "
              "input with one matrix, so it does self-attention only; got key ",
              shape_or_none(key), " and value ", shape_or_none(value),
              ". MultiHeadAttention does cross-attention");
  detail::check_forward_input(kCombinedName, query,
                              {module.options.d_in(), module.options.context_length()},
                              module.qkv->weight, "query");
  detail::check_rope_forward(kCombinedName, module.rope_tables, query, key);
  auto q_k_v = split_combined_qkv(module.qkv(query), module.options.num_heads());
  std::tie(q_k_v[0], q_k_v[1]) = detail::QueryKeyTransform{
      module.q_norm, module.k_norm, module.rope_tables}(q_k_v[0], q_k_v[1], int64_t{0});
  return q_k_v;
}

}  // namespace

MultiHeadAttentionCombinedQKVImpl::MultiHeadAttentionCombinedQKVImpl(
    const MultiHeadAttentionCombinedQKVOptions& options)
    : options(options) {
  reset();
}

void MultiHeadAttentionCombinedQKVImpl::reset() {
  check_options(kCombinedName, options);
  const auto d_in = options.d_in();
  const auto d_out = options.d_out();
  qkv = register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(d_in, 3 * d_out).bias(options.qkv_bias())));
  out_proj = register_module("out_proj", torch::nn::Linear(d_out, d_out));
  rope_tables =
      detail::reset_query_key_transform(kCombinedName, *this, options.rope(), options.qk_norm(),
                                        options.d_out() / options.num_heads(), q_norm, k_norm);
}

void MultiHeadAttentionCombinedQKVImpl::pretty_print(std::ostream& stream) const {
  print_multi_head_options(stream, kCombinedName, options);
}

std::vector<std::pair<std::string, torch::Tensor>>
MultiHeadAttentionCombinedQKVImpl::python_only_state() const {
  return python_mask_state(options, qkv->weight);
}

F::AttentionOutput MultiHeadAttentionCombinedQKVImpl::attend_inputs(const torch::Tensor& query,
                                                                    const torch::Tensor& key,
                                                                    const torch::Tensor& value,
                                                                    const Mask& mask,
                                                                    bool with_weights) {
  const auto q_k_v = combined_qkv_heads(*this, query, key, value);
  auto attended = detail::attend(q_k_v[0], q_k_v[1], q_k_v[2], settings_of(options), is_training(),
                                 /*query_offset=*/0, with_weights, mask);
  return {out_proj(detail::merge_heads(attended.context)), attended.weights};
}

KVCache MultiHeadAttentionCombinedQKVImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  return detail::make_module_cache(kCombinedName, cache_layout_of(options),
                                   options.context_length(), qkv->weight, batch, capacity);
}

torch::Tensor MultiHeadAttentionCombinedQKVImpl::attend_new_tokens(const torch::Tensor& x,
                                                                   KVCache& cache,
                                                                   const torch::Tensor& lengths,
                                                                   const Mask& mask) {
  const auto new_lengths = check_cached_mha_call(kCombinedName, options, is_training(), x, cache,
                                                 qkv->weight, mask, lengths, rope_tables);
  torch::NoGradGuard no_grad;
  return cached_step(*this, x, new_lengths,
                     on_cache(options, {q_norm, k_norm, rope_tables}, cache, mask, new_lengths));
}

PagedKVCache MultiHeadAttentionCombinedQKVImpl::make_paged_kv_cache(int64_t num_pages,
                                                                    int64_t page_size) const {
  return detail::make_module_paged_cache(cache_layout_of(options), qkv->weight, num_pages,
                                         page_size);
}

torch::Tensor MultiHeadAttentionCombinedQKVImpl::attend_paged_tokens(
    const torch::Tensor& x, PagedKVCache& cache, const std::vector<int64_t>& sequences,
    const Mask& mask) {
  check_paged_mha_call(kCombinedName, options, is_training(), x, cache, qkv->weight, sequences,
                       rope_tables, mask);
  torch::NoGradGuard no_grad;
  return cached_step(
      *this, x, {}, on_paged_cache(options, {q_norm, k_norm, rope_tables}, cache, sequences, mask));
}

void MultiHeadAttentionCombinedQKVImpl::copy_weights_from(const MultiHeadAttentionImpl& mha) {
  const auto& o = mha.options;
  const auto describe = [](const MultiHeadAttentionOptions& opt) {
    return c10::str("d_in = ", opt.d_in(), ", d_out = ", opt.d_out(),
                    ", num_heads = ", opt.num_heads(),
                    ", qkv_bias = ", opt.qkv_bias() ? "true" : "false",
                    opt.qk_norm() ? ", qk_norm = true" : "");
  };
  TORCH_CHECK(o.d_in() == options.d_in() && o.d_out() == options.d_out() &&
                  o.num_heads() == options.num_heads() && o.qkv_bias() == options.qkv_bias() &&
                  o.qk_norm() == options.qk_norm(),
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
  if (options.qk_norm()) {
    q_norm->weight.copy_(mha.q_norm->weight);
    k_norm->weight.copy_(mha.k_norm->weight);
  }
}

}  // namespace attnkit
