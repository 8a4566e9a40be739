#include "attnkit/functional.h"

#include <cmath>
#include <limits>

#include "core/attention_layout.h"
#include "core/checks.h"
#include "core/kernels.h"
#include "core/planner.h"

// This file defines the deprecated adapters (SdpaOptions, ChunkedOptions, FusedOptions).
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace attnkit::functional {

using detail::shape_string;

torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys, const torch::Device& device,
                          int64_t query_offset, c10::optional<int64_t> window_size) {
  TORCH_CHECK(num_queries >= 0 && num_keys >= 0,
              "[causal_mask] sizes must be >= 0, got num_queries = ", num_queries,
              ", num_keys = ", num_keys);
  detail::check_query_offset("[causal_mask]", query_offset);
  detail::check_window_size("[causal_mask]", window_size, /*is_causal=*/true);
  const auto ones = torch::ones({num_queries, num_keys}, torch::dtype(torch::kBool).device(device));
  // Row i is masked from column query_offset + i + 1 on.
  auto mask = ones.triu(/*diagonal=*/1 + query_offset);
  if (window_size.has_value()) {
    // ... and up to column query_offset + i - window_size.
    mask.logical_or_(ones.tril(/*diagonal=*/query_offset - *window_size));
  }
  return mask;
}

namespace {

void check_sdpa_arguments(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const SdpaOptions& options) {
  const char* fn = "[scaled_dot_product_attention]";
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), fn,
              " query, key and value must all be defined tensors");
  TORCH_CHECK(q.dim() >= 2 && k.dim() >= 2 && v.dim() >= 2, fn,
              " query, key and value must be at least 2-D (..., n, hd), got query ",
              shape_string(q), ", key ", shape_string(k), ", value ", shape_string(v));
  TORCH_CHECK(q.size(-1) == k.size(-1), fn,
              " query and key must have the same last dimension (head_dim), got query ",
              shape_string(q), " and key ", shape_string(k));
  TORCH_CHECK(k.size(-2) == v.size(-2), fn,
              " key and value must have the same number of tokens (dim -2), got key ",
              shape_string(k), " and value ", shape_string(v));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), fn,
              " query, key and value must share a dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && k.device() == v.device(), fn,
              " query, key and value must be on one device, got ", q.device(), ", ", k.device(),
              ", ", v.device());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  detail::check_window_size(fn, options.window_size(), options.is_causal());
  const auto& mask = options.attn_mask();
  if (mask.defined()) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool, fn,
                " attn_mask must be a bool tensor (true = masked), got dtype ", mask.scalar_type());
    TORCH_CHECK(mask.dim() >= 2 && mask.size(-2) == q.size(-2) && mask.size(-1) == k.size(-2), fn,
                " attn_mask must end in (num_queries, num_keys) = (", q.size(-2), ", ", k.size(-2),
                "), got shape ", shape_string(mask));
  }
}

// The causal (and window) mask of the earlier options types as a Mask.
Mask causal_option_mask(bool is_causal, int64_t query_offset,
                        const c10::optional<int64_t>& window_size) {
  if (!is_causal)
    return {};
  auto mask = Mask::causal(query_offset);
  return window_size ? mask.sliding_window(*window_size) : mask;
}

// A deprecated adapter's causal, offset, window and dropout options as AttentionOptions.
template <typename AdapterOptions>
AttentionOptions adapted_options(const AdapterOptions& options, AttentionBackend backend) {
  return AttentionOptions()
      .mask(causal_option_mask(options.is_causal(), options.query_offset(), options.window_size()))
      .dropout_p(options.dropout_p())
      .training(options.training())
      .backend(backend);
}

// An earlier entry point's (..., n, hd) inputs as the planner's call under `options`, the
// backend demanded; the context comes back in the query's shape.
torch::Tensor run_as_call(const torch::Tensor& query, const torch::Tensor& key,
                          const torch::Tensor& value, const AttentionOptions& options) {
  detail::AttentionCall call;
  call.query = detail::as_outer_heads(query);
  call.key = detail::as_outer_heads(key);
  call.value = detail::as_outer_heads(value);
  call.options = options;
  const auto out4 = detail::run_attention(call).context;
  auto shape = query.sizes().vec();
  shape.back() = out4.size(3);
  return out4.reshape(shape);
}

}  // namespace

AttentionOutput scaled_dot_product_attention_with_weights(const torch::Tensor& query,
                                                          const torch::Tensor& key,
                                                          const torch::Tensor& value,
                                                          const SdpaOptions& options) {
  check_sdpa_arguments(query, key, value, options);
  if (query.dim() >= 4 && key.dim() >= 4 && key.size(-3) < query.size(-3)) {
    // Grouped-query attention, the reference way: each key/value head repeated for the
    // query heads of its group, (..., G, m, hd) -> (..., H, m, hd).
    const auto group =
        detail::query_heads_per_kv_head("[scaled_dot_product_attention]", query, key);
    return scaled_dot_product_attention_with_weights(query, key.repeat_interleave(group, -3),
                                                     value.repeat_interleave(group, -3), options);
  }
  // The math core with the mask turned around: attn_mask and the causal mask say what is
  // hidden, the core's `allowed` what is seen.
  detail::MathMasking masking;
  if (options.attn_mask().defined())
    masking.allowed = options.attn_mask().logical_not();
  if (options.is_causal()) {
    const auto causal = causal_mask(query.size(-2), key.size(-2), query.device(),
                                    options.query_offset(), options.window_size());
    masking.allowed = masking.allowed.defined() ? masking.allowed.logical_and(causal.logical_not())
                                                : causal.logical_not();
  }
  return detail::math_attention(query, key, value, masking, options.scale(), options.dropout_p(),
                                options.training());
}

torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value, const SdpaOptions& options) {
  return scaled_dot_product_attention_with_weights(query, key, value, options).context;
}

torch::Tensor chunked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const ChunkedOptions& options) {
  const char* fn = "[chunked_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  detail::check_window_size(fn, options.window_size(), options.is_causal());
  TORCH_CHECK(options.block_size() >= 1, fn, " block_size must be >= 1, got ",
              options.block_size());
  TORCH_CHECK(options.key_block_size() >= 1, fn, " key_block_size must be >= 1, got ",
              options.key_block_size());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  return run_as_call(query, key, value,
                     adapted_options(options, AttentionBackend::kChunked)
                         .query_block_size(options.block_size())
                         .key_block_size(options.key_block_size()));
}

torch::Tensor fused_backend_attention(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, const FusedOptions& options) {
  const char* fn = "[fused_backend_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  detail::check_window_size(fn, options.window_size(), options.is_causal());
  return run_as_call(query, key, value, adapted_options(options, AttentionBackend::kFused));
}

}  // namespace attnkit::functional
