#include "attnkit/functional.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ExpandUtils.h>

#include "core/base/attention_layout.h"
#include "core/base/checks.h"
#include "core/kernels/loop_nest_attention.h"
#include "core/plan/planner.h"

// This file defines the deprecated adapters (SdpaOptions, ChunkedOptions, FusedOptions), the
// only file of attnkit that names them.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace attnkit::functional {

using detail::shape_string;

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

// Fails unless the tensors (`what` names them) are on CPU and all float32 or all float64.
void check_cpu_floating(const char* fn, const char* what,
                        const std::vector<torch::Tensor>& tensors) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().is_cpu(), fn, " runs on CPU only, got a tensor on ", t.device(),
                "; use scaled_dot_product_attention elsewhere");
  }
  const auto dtype = tensors.front().scalar_type();
  bool same = dtype == torch::kFloat || dtype == torch::kDouble;
  std::string got;
  for (const auto& t : tensors) {
    same = same && t.scalar_type() == dtype;
    got += (got.empty() ? "" : ", ") + std::string(c10::toString(t.scalar_type()));
  }
  TORCH_CHECK(same, fn, " expected ", what, " to be float32 or float64 (one dtype), got ", got);
}

void check_fused_options(const char* fn, const FusedOptions& options) {
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  detail::check_window_size(fn, options.window_size(), options.is_causal());
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
// backend demanded; the context (and with `with_weights` the weights) come back in the
// query's shape.
AttentionOutput run_as_call(const torch::Tensor& query, const torch::Tensor& key,
                            const torch::Tensor& value, const AttentionOptions& options,
                            bool with_weights = false) {
  detail::AttentionCall call;
  call.query = detail::as_outer_heads(query);
  call.key = detail::as_outer_heads(key);
  call.value = detail::as_outer_heads(value);
  call.options = options;
  call.with_weights = with_weights;
  auto out = detail::run_attention(call);
  auto shape = query.sizes().vec();
  shape.back() = out.context.size(3);
  out.context = out.context.reshape(shape);
  if (out.weights.defined()) {
    shape.back() = key.size(-2);
    out.weights = out.weights.reshape(shape);
  }
  return out;
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
    const auto group_size =
        detail::query_heads_per_kv_head("[scaled_dot_product_attention]", query, key);
    return scaled_dot_product_attention_with_weights(query, key.repeat_interleave(group_size, -3),
                                                     value.repeat_interleave(group_size, -3),
                                                     options);
  }
  // The math core through the planner, the mask turned around: attn_mask and the causal
  // mask say what is hidden, a Mask what is seen. The scores' leading dimensions are the
  // inputs' and the mask's broadcast together (a mask with more of them gives one output per
  // mask, as the book's matmuls would).
  const auto& attn_mask = options.attn_mask();
  std::vector<int64_t> lead;
  for (const auto* t : {&query, &key, &value, &attn_mask}) {
    if (!t->defined())
      continue;
    const auto own = t->sizes().slice(0, t->dim() - 2);
    bool broadcasts = true;  // from the right, each pair equal or one of them 1
    for (size_t i = 1; i <= std::min(own.size(), lead.size()); ++i) {
      const auto x = own[own.size() - i], y = lead[lead.size() - i];
      broadcasts = broadcasts && (x == y || x == 1 || y == 1);
    }
    TORCH_CHECK(broadcasts, "[scaled_dot_product_attention] the leading dimensions of query ",
                shape_string(query), ", key ", shape_string(key), ", value ", shape_string(value),
                attn_mask.defined() ? " and attn_mask " + shape_string(attn_mask) : std::string(),
                " must broadcast together");
    lead = at::infer_size(own, lead);
  }
  // (..., n, f) -> lead + (n, f)
  const auto expanded = [&lead](const torch::Tensor& t) {
    auto shape = lead;
    shape.push_back(t.size(-2));
    shape.push_back(t.size(-1));
    return t.expand(shape);
  };
  auto mask =
      causal_option_mask(options.is_causal(), options.query_offset(), options.window_size());
  if (attn_mask.defined())
    mask = mask & Mask::from_tensor(detail::as_outer_heads(expanded(attn_mask)).logical_not());
  return run_as_call(expanded(query), expanded(key), expanded(value),
                     AttentionOptions()
                         .mask(mask)
                         .scale(options.scale())
                         .dropout_p(options.dropout_p())
                         .training(options.training())
                         .backend(AttentionBackend::kMath),
                     /*with_weights=*/true);
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
                         .key_block_size(options.key_block_size()))
      .context;
}

torch::Tensor fused_backend_attention(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, const FusedOptions& options) {
  const char* fn = "[fused_backend_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  detail::check_window_size(fn, options.window_size(), options.is_causal());
  return run_as_call(query, key, value, adapted_options(options, AttentionBackend::kFused)).context;
}

torch::Tensor fused_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const FusedOptions& options) {
  const char* fn = "[fused_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  check_cpu_floating(fn, "query, key and value", {query, key, value});
  check_fused_options(fn, options);
  return run_as_call(query, key, value,
                     adapted_options(options, AttentionBackend::kFused).kernel("loop_nest"))
      .context;
}

torch::Tensor fused_packed_attention(const torch::Tensor& qkv, int64_t num_heads,
                                     const FusedOptions& options) {
  const char* fn = "[fused_packed_attention]";
  TORCH_CHECK(qkv.defined() && qkv.dim() == 3, fn, " qkv: expected (b, n, 3 * d), got ",
              qkv.defined() ? shape_string(qkv) : "an undefined tensor");
  TORCH_CHECK(num_heads >= 1 && qkv.size(2) % (3 * num_heads) == 0, fn, " qkv's last dimension ",
              qkv.size(2), " must be 3 * num_heads * head_dim, with num_heads = ", num_heads);
  TORCH_CHECK(qkv.size(1) >= 1, fn, " qkv must hold at least one token");
  check_cpu_floating(fn, "qkv", {qkv});
  check_fused_options(fn, options);
  TORCH_CHECK(options.query_offset() == 0, fn,
              " queries and keys are the same tokens, so query_offset must be 0, got ",
              options.query_offset());
  const int64_t b = qkv.size(0), n = qkv.size(1);
  const auto parts = qkv.chunk(3, -1);
  const auto heads = [&](int64_t i) {
    // (b, n, h * hd) -> (b, n, h, hd) -> (b, h, n, hd): a view of qkv
    return parts[i].view({b, n, num_heads, -1}).transpose(1, 2);
  };
  detail::AttentionCall call;
  call.query = heads(0);
  call.key = heads(1);
  call.value = heads(2);
  call.packed_qkv = qkv;
  call.options = adapted_options(options, AttentionBackend::kFused).kernel("packed_loop_nest");
  // (b, h, n, hd) -> (b, n, h, hd) -> (b, n, h * hd)
  return detail::run_attention(call).context.transpose(1, 2).reshape({b, n, -1});
}

bool fused_attention_fits(int64_t num_queries, int64_t num_keys,
                          const torch::TensorOptions& options) {
  return detail::loop_nest_fits(num_queries, num_keys, options);
}

}  // namespace attnkit::functional
