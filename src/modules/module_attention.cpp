#include "modules/module_attention.h"

#include "core/checks.h"
#include "core/decode_attention.h"
#include "core/kernels.h"
#include "modules/module_helpers.h"

namespace attnkit::detail {

namespace F = attnkit::functional;

F::AttentionOutput attend(const torch::Tensor& queries, const torch::Tensor& keys,
                          const torch::Tensor& values, const AttentionSettings& settings,
                          bool training, int64_t query_offset, bool with_weights,
                          const Mask& mask) {
  Mask module_mask;
  if (settings.causal) {
    module_mask = Mask::causal(query_offset);
    if (settings.window_size.has_value())
      module_mask = module_mask.sliding_window(*settings.window_size);
  }
  auto options = F::AttentionOptions()
                     .mask(module_mask & mask)
                     .dropout_p(settings.dropout)
                     .training(training)
                     .backend(settings.backend)
                     .query_block_size(settings.chunk_size)
                     .key_block_size(settings.key_chunk_size);
  // A module set to kFused runs what the fused kernels do not take (padding, documents, a
  // mask_mod) on chunked, as kAuto would: the setting picks the fast path, it is not a demand.
  if (settings.backend == AttentionBackend::kFused &&
      !F::unsupported_reason(AttentionBackend::kFused, queries, keys, values, options).empty())
    options.backend(AttentionBackend::kChunked);
  if (with_weights || settings.backend == AttentionBackend::kMath)
    return F::attention_with_weights(queries, keys, values,
                                     options.backend(AttentionBackend::kMath));
  return {F::attention(queries, keys, values, options), {}};
}

std::pair<torch::Tensor, torch::Tensor> key_value_inputs(
    const char* module, const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const InputSpec& spec, const torch::Tensor& parameter) {
  check_forward_input(module, query, spec, parameter, "query");
  if (!key.defined()) {
    TORCH_CHECK(!value.defined(), "[", module,
                "::forward] value given without key: cross-attention takes key (and value)");
    return {query, query};
  }
  const auto& values_from = value.defined() ? value : key;
  check_forward_input(module, key, spec, parameter, "key");
  check_forward_input(module, values_from, spec, parameter, "value");
  TORCH_CHECK(key.size(0) == query.size(0) && values_from.size(0) == query.size(0), "[", module,
              "::forward] key and value must have the query's batch size ", query.size(0),
              ", got key ", shape_string(key), " and value ", shape_string(values_from));
  TORCH_CHECK(values_from.size(1) == key.size(1), "[", module,
              "::forward] key and value must have the same number of tokens, got key ",
              shape_string(key), " and value ", shape_string(values_from));
  return {key, values_from};
}

KVCache make_module_cache(const char* module, const CacheLayout& layout, int64_t context_length,
                          const torch::Tensor& parameter, int64_t batch, int64_t capacity) {
  TORCH_CHECK(batch >= 1, "[", module, "::make_kv_cache] batch must be >= 1, got ", batch);
  const auto options = parameter.options();
  if (layout.window_size > 0) {
    TORCH_CHECK(capacity >= 0, "[", module, "::make_kv_cache] capacity must be >= 0, got ",
                capacity);
    return KVCache::sliding_window(batch, layout.heads, layout.head_dim, layout.window_size,
                                   options);
  }
  if (context_length > 0) {
    TORCH_CHECK(capacity >= 0 && capacity <= context_length, "[", module,
                "::make_kv_cache] capacity must be in [1, context_length = ", context_length,
                "] (0: context_length), got ", capacity);
    capacity = capacity == 0 ? context_length : capacity;
  } else {
    TORCH_CHECK(capacity >= 1, "[", module,
                "::make_kv_cache] capacity (the most positions the cache will hold) must be "
                ">= 1, got ",
                capacity);
  }
  return layout.latent ? KVCache::latent(batch, layout.head_dim, capacity, options)
                       : KVCache(batch, layout.heads, layout.head_dim, capacity, options);
}

namespace {

// forward_with_cache(x, cache, lengths)'s checks of `lengths` and of each row's end.
std::vector<int64_t> check_ragged_lengths(const char* module, const torch::Tensor& x,
                                          const torch::Tensor& lengths, int64_t context_length,
                                          const KVCache& cache) {
  const int64_t b = x.size(0), n = x.size(1);
  TORCH_CHECK(lengths.scalar_type() == torch::kInt64 && lengths.dim() == 1 && lengths.size(0) == b,
              "[", module, "::forward_with_cache] lengths must be a (", b,
              ") int64 tensor (each row's valid new tokens), got ", shape_string(lengths), " ",
              lengths.scalar_type());
  const auto values = lengths.to(torch::kCPU).contiguous();
  const auto before_tensor = cache.lengths();
  const auto before = before_tensor.accessor<int64_t, 1>();
  std::vector<int64_t> new_lengths(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + b);
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(new_lengths[r] >= 0 && new_lengths[r] <= n, "[", module,
                "::forward_with_cache] lengths[", r, "] must be in [0, ", n, "] (x's tokens), got ",
                new_lengths[r]);
    const int64_t end = before[r] + new_lengths[r];
    TORCH_CHECK(context_length == 0 || end <= context_length, "[", module,
                "::forward_with_cache] row ", r, ": ", new_lengths[r],
                " tokens would reach position ", end, ", past context_length = ", context_length);
    TORCH_CHECK(end <= cache.max_positions(), "[", module, "::forward_with_cache] row ", r, ": ",
                new_lengths[r], " tokens would reach position ", end,
                ", past the cache's capacity ", cache.capacity(),
                "; make a larger one with make_kv_cache(batch, capacity)");
  }
  return new_lengths;
}

}  // namespace

std::vector<int64_t> check_cached_call(const char* module, bool training, const torch::Tensor& x,
                                       int64_t d_in, int64_t context_length, const KVCache& cache,
                                       const CacheLayout& layout, const torch::Tensor& parameter,
                                       const Mask& mask, const torch::Tensor& lengths) {
  TORCH_CHECK(!training, "[", module,
              "::forward_with_cache] the KV cache is for inference, but the module is in "
              "training mode: call eval() first (training runs forward over whole sequences)");
  detail::check_forward_input(module, x, {d_in}, parameter);
  TORCH_CHECK(cache.capacity() > 0, "[", module,
              "::forward_with_cache] the cache has no storage; make one with make_kv_cache");
  const auto kind = [](bool latent, int64_t window) {
    return latent       ? std::string("a latent cache")
           : window > 0 ? c10::str("a rolling cache of window_size ", window)
                        : std::string("a key/value cache");
  };
  TORCH_CHECK(cache.is_latent() == layout.latent && cache.window_size() == layout.window_size, "[",
              module, "::forward_with_cache] cache: expected ",
              kind(layout.latent, layout.window_size), ", got ",
              kind(cache.is_latent(), cache.window_size()), "; make it with make_kv_cache");
  TORCH_CHECK(cache.batch() == x.size(0) && cache.num_heads() == layout.heads &&
                  cache.head_dim() == layout.head_dim,
              "[", module, "::forward_with_cache] cache: expected (batch, ",
              layout.latent ? "1, latent_dim" : "num_heads, head_dim", ") = (", x.size(0), ", ",
              layout.heads, ", ", layout.head_dim, "), got (", cache.batch(), ", ",
              cache.num_heads(), ", ", cache.head_dim(), ")");
  TORCH_CHECK(cache.options().dtype() == parameter.dtype() &&
                  cache.options().device() == parameter.device(),
              "[", module, "::forward_with_cache] cache: expected dtype ", parameter.scalar_type(),
              " on ", parameter.device(), " (the module's parameters), got ",
              cache.options().dtype(), " on ", cache.options().device());
  TORCH_CHECK(mask.is_none() || layout.window_size == 0, "[", module,
              "::forward_with_cache] mask: a rolling cache of window_size ", layout.window_size,
              " keeps its keys in storage order, so a mask cannot name their positions; got ",
              mask.to_string(), "; masks work with the caches of modules without a window");
  const int64_t n = x.size(1);
  if (lengths.defined())
    return check_ragged_lengths(module, x, lengths, context_length, cache);
  const int64_t end = cache.size() + n;
  TORCH_CHECK(context_length == 0 || end <= context_length, "[", module,
              "::forward_with_cache] x: ", n, " tokens after the ", cache.size(),
              " the cache holds would reach position ", end,
              ", past context_length = ", context_length);
  TORCH_CHECK(n <= cache.max_positions() - cache.size(), "[", module,
              "::forward_with_cache] x: ", n, " tokens after the ", cache.size(),
              " the cache holds would pass its capacity ", cache.capacity(),
              "; make a larger one with make_kv_cache(batch, capacity)");
  return {};
}

torch::Tensor attend_cached(const QueryKeyTransform& transform, const torch::Tensor& queries,
                            const torch::Tensor& keys, const torch::Tensor& values, KVCache& cache,
                            const AttentionSettings& settings, const Mask& mask,
                            const std::vector<int64_t>& new_lengths) {
  if (new_lengths.empty()) {
    const auto [rotated_queries, rotated_keys] = transform(queries, keys, cache.size());
    const auto span = cache.append(rotated_keys, values);
    if (queries.size(2) == 1 && mask.is_none() &&
        decode_attention_fits(rotated_queries, span.keys, span.values)) {
      // The one query sits at key index query_offset and sees the keys before it, within
      // the window (a rolling cache holds no more than the window).
      const int64_t end = span.query_offset + 1;
      const int64_t begin =
          settings.window_size ? std::max<int64_t>(0, end - *settings.window_size) : 0;
      const auto rows = static_cast<size_t>(queries.size(0));
      return decode_attention(rotated_queries, span.keys, span.values,
                              default_scale(queries.size(3)), std::vector<int64_t>(rows, begin),
                              std::vector<int64_t>(rows, end));
    }
    return attend(rotated_queries, span.keys, span.values, settings, /*training=*/false,
                  span.query_offset, /*with_weights=*/false, mask)
        .context;
  }
  // Row r's token i at position starts[r] + i. A row whose padding would run past the RoPE
  // tables is rotated on its valid tokens alone (the padding is neither cached nor used).
  const auto host_starts = cache.lengths();
  const int64_t n = queries.size(2);
  const bool padding_past_tables =
      transform.rope.defined() &&
      host_starts.max().item<int64_t>() + n > transform.rope.context_length();
  torch::Tensor rotated_queries, rotated_keys;
  if (!padding_past_tables) {
    std::tie(rotated_queries, rotated_keys) =
        transform(queries, keys, host_starts.to(queries.device()));
  } else {
    rotated_queries = queries.clone();
    rotated_keys = keys.clone();
    for (size_t r = 0; r < new_lengths.size(); ++r) {
      if (new_lengths[r] == 0)
        continue;
      const auto row = static_cast<int64_t>(r);
      const auto [q, k] = transform(queries.narrow(0, row, 1).narrow(2, 0, new_lengths[r]),
                                    keys.narrow(0, row, 1).narrow(2, 0, new_lengths[r]),
                                    host_starts[row].item<int64_t>());
      rotated_queries.narrow(0, row, 1).narrow(2, 0, new_lengths[r]).copy_(q);
      rotated_keys.narrow(0, row, 1).narrow(2, 0, new_lengths[r]).copy_(k);
    }
  }
  const auto span = cache.append_ragged(rotated_keys, values, new_lengths);
  return attend_ragged(rotated_queries, span.keys, span.values, span, settings, mask);
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> decode_key_ranges(
    const KVCache::RaggedSpan& span, const c10::optional<int64_t>& window_size) {
  const auto starts = span.starts.to(torch::kCPU), ends = span.ends.to(torch::kCPU);
  const auto* start = starts.data_ptr<int64_t>();
  const auto* valid_end = ends.data_ptr<int64_t>();
  const auto rows = static_cast<size_t>(starts.size(0));
  std::vector<int64_t> begin(rows, 0), end(rows);
  for (size_t r = 0; r < rows; ++r) {
    end[r] = std::min(valid_end[r], start[r] + 1);
    if (window_size)
      begin[r] = std::max<int64_t>(0, start[r] + 1 - *window_size);
  }
  return {begin, end};
}

torch::Tensor attend_ragged(const torch::Tensor& queries, const torch::Tensor& keys,
                            const torch::Tensor& values, const KVCache::RaggedSpan& span,
                            const AttentionSettings& settings, const Mask& mask) {
  if (queries.size(2) == 1 && mask.is_none() && decode_attention_fits(queries, keys, values)) {
    const auto [begin, end] = decode_key_ranges(span, settings.window_size);
    return decode_attention(queries, keys, values, default_scale(queries.size(3)), begin, end);
  }
  if (queries.size(2) > 1 && mask.is_none()) {
    // A prefill or refill step of a ragged batch: each row's offset and end straight into the
    // CPU loop-nest kernel, where the masked path below would build dense per-row masks.
    auto context = ragged_fused_attention_if_fits(queries, keys, values, span.starts, span.ends,
                                                  settings.window_size.value_or(0));
    if (context.defined())
      return context;
  }
  // Each row's own causal (and window) mask over its valid keys, in place of the module's one
  // query offset: key j for query i of row r when j <= starts[r] + i and j < ends[r].
  auto causal = Mask::causal(span.starts);
  if (settings.window_size)
    causal = causal.sliding_window(*settings.window_size);
  const auto rows = causal & Mask::key_padding(span.ends);
  auto row_settings = settings;
  row_settings.causal = false;
  // A decode step (one query per row) scores one row per head: the math path costs no
  // quadratic memory there and has the least overhead, while the fused kernels hand a
  // per-row mask to the chunked one, tile by tile and row by row.
  if (queries.size(2) == 1)
    row_settings.backend = AttentionBackend::kMath;
  return attend(queries, keys, values, row_settings, /*training=*/false,
                /*query_offset=*/0, /*with_weights=*/false, rows & mask)
      .context;
}

RopeTables reset_query_key_transform(const char* name, torch::nn::Module& module,
                                     const c10::optional<RopeOptions>& rope, bool qk_norm,
                                     int64_t head_dim, RMSNorm& q_norm, RMSNorm& k_norm) {
  if (qk_norm) {
    q_norm = module.register_module("q_norm", RMSNorm(RMSNormOptions(head_dim)));
    k_norm = module.register_module("k_norm", RMSNorm(RMSNormOptions(head_dim)));
  }
  if (!rope)
    return {};
  TORCH_CHECK(head_dim % 2 == 0, "[", name,
              "] option rope needs an even head width (RoPE rotates pairs), got d_out / "
              "num_heads = ",
              head_dim);
  TORCH_CHECK(rope->context_length() >= 1, "[", name,
              "] option rope: context_length must be >= 1, got ", rope->context_length());
  TORCH_CHECK(rope->theta_base() > 0.0, "[", name, "] option rope: theta_base must be > 0, got ",
              rope->theta_base());
  return RopeTables(*rope, head_dim);
}

void print_query_key_options(std::ostream& stream, const c10::optional<RopeOptions>& rope,
                             bool qk_norm) {
  if (rope) {
    stream << ", rope=(context_length=" << rope->context_length()
           << ", theta_base=" << option_text(rope->theta_base()) << ", layout="
           << (rope->layout() == RopeLayout::kSplitHalf ? "split_half" : "interleaved");
    if (const auto& config = rope->freq_config()) {
      stream << ", freq_config=(factor=" << option_text(config->factor())
             << ", low_freq_factor=" << option_text(config->low_freq_factor())
             << ", high_freq_factor=" << option_text(config->high_freq_factor())
             << ", original_context_length=" << config->original_context_length() << ")";
    }
    stream << ")";
  }
  if (qk_norm)
    stream << ", qk_norm=true";
}

void check_rope_forward(const char* name, const RopeTables& rope, const torch::Tensor& query,
                        const torch::Tensor& key) {
  if (!rope.defined())
    return;
  TORCH_CHECK(!key.defined(), "[", name,
              "::forward] key: RoPE rotates queries and keys by their positions in one "
              "sequence, so a module with the rope option does self-attention only; got key ",
              shape_string(key));
  check_rope_positions(name, "forward] query", rope, 0, query.size(1));
}

void check_rope_positions(const char* name, const char* where, const RopeTables& rope,
                          int64_t start, int64_t n) {
  if (!rope.defined())
    return;
  TORCH_CHECK(start + n <= rope.context_length(), "[", name, "::", where, ": ", n,
              " tokens from position ", start, " would reach position ", start + n,
              ", past rope.context_length = ", rope.context_length(), " (the RoPE tables' length)");
}

void check_rope_cached_positions(const char* name, const RopeTables& rope, const KVCache& cache,
                                 const std::vector<int64_t>& new_lengths, int64_t n) {
  if (new_lengths.empty() || !rope.defined()) {
    check_rope_positions(name, "forward_with_cache] x", rope, cache.size(), n);
    return;
  }
  const auto starts = cache.lengths();
  const auto start = starts.accessor<int64_t, 1>();
  for (size_t r = 0; r < new_lengths.size(); ++r) {
    const int64_t end = start[r] + new_lengths[r];
    TORCH_CHECK(end <= rope.context_length(), "[", name, "::forward_with_cache] row ", r, ": ",
                new_lengths[r], " tokens from position ", start[r], " would reach position ", end,
                ", past rope.context_length = ", rope.context_length(),
                " (the RoPE tables' length)");
  }
}

}  // namespace attnkit::detail
