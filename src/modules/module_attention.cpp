#include "modules/module_attention.h"

#include "attnkit/cached_attention.h"
#include "core/base/checks.h"
#include "core/masks/mask_node.h"
#include "core/plan/planner.h"
#include "core/scores/row_variants.h"
#include "core/scores/score_variants.h"
#include "modules/module_helpers.h"

namespace attnkit::detail {

namespace F = attnkit::functional;

namespace {

// The module's own causal (and window) mask for queries at key position query_offset + i.
Mask module_mask(const ModuleAttention& settings, int64_t query_offset) {
  if (!settings.causal)
    return {};
  const auto causal = Mask::causal(query_offset);
  return settings.window_size ? causal.sliding_window(*settings.window_size) : causal;
}

// A module's call: its options with the call's mask and mode, its backend a preference.
AttentionCall module_call(const torch::Tensor& queries, const torch::Tensor& keys,
                          const torch::Tensor& values, const ModuleAttention& settings,
                          bool training, const Mask& mask) {
  AttentionCall call;
  call.query = queries;
  call.key = keys;
  call.value = values;
  call.options = settings.options;
  call.options.mask(mask).training(training);
  // The module's backend picks the fast path; a problem it cannot run (padding, documents,
  // a mask_mod on kFused) runs where it can, as kAuto would.
  call.backend_is_preference = true;
  return call;
}

const char* const kScope = "[ContextParallelScope]";

// detail::attend inside a ContextParallelScope: the module's mask and `mask` are the whole
// sequence's, and this rank's queries attend to every rank's keys.
F::AttentionOutput attend_context_parallel(const torch::Tensor& queries, const torch::Tensor& keys,
                                           const torch::Tensor& values,
                                           const ModuleAttention& settings, bool training,
                                           int64_t query_offset, bool with_weights,
                                           const Mask& mask, const ContextParallelScope& scope) {
  TORCH_CHECK(!with_weights, kScope,
              " attention weights are not computed by a context-parallel call "
              "(forward_with_weights); call it outside the scope");
  TORCH_CHECK(query_offset == 0, kScope, " a module's call at query offset ", query_offset,
              ": only whole-sequence calls run context-parallel");
  const auto shard = scope.shards().shard_length();
  TORCH_CHECK(queries.size(2) == shard, kScope, " a module's input must be this rank's shard of ",
              shard, " tokens (a sequence of ", scope.shards().length(), " over ",
              scope.shards().ranks(), " ranks), got ", queries.size(2), " tokens");
  auto options = settings.options;
  options.mask(module_mask(settings, 0) & mask).training(training);
  return {F::context_parallel_attention(queries, keys, values, scope.exchange(), options,
                                        scope.options()),
          torch::Tensor()};
}

}  // namespace

torch::Tensor rotate_shard(const RopeTables& rope, const torch::Tensor& heads,
                           const ContextParallelScope& scope) {
  const auto& shards = scope.shards();
  TORCH_CHECK(heads.size(2) == shards.shard_length(), kScope,
              " a module's input must be this rank's shard of ", shards.shard_length(),
              " tokens, got ", heads.size(2));
  std::vector<torch::Tensor> rotated;
  for (const auto& chunk : shards.chunks(scope.exchange().rank()))
    rotated.push_back(rope.rotate(heads.narrow(2, chunk.local_start, chunk.length), chunk.start));
  return torch::cat(rotated, 2);  // (b, h, s, hd)
}

F::AttentionOutput attend(const torch::Tensor& queries, const torch::Tensor& keys,
                          const torch::Tensor& values, const ModuleAttention& settings,
                          bool training, int64_t query_offset, bool with_weights, const Mask& mask,
                          const torch::Tensor& packed_qkv) {
  if (const auto* scope = ContextParallelScope::current()) {
    return attend_context_parallel(queries, keys, values, settings, training, query_offset,
                                   with_weights, mask, *scope);
  }
  auto call = module_call(queries, keys, values, settings, training,
                          module_mask(settings, query_offset) & mask);
  call.with_weights = with_weights;
  call.packed_qkv = packed_qkv;
  return run_checked_attention(call);
}

torch::Tensor attend_step(const torch::Tensor& queries, const torch::Tensor& keys,
                          const torch::Tensor& values, const ModuleAttention& settings,
                          int64_t query_offset, const Mask& mask, const KVCache::RaggedSpan* rows,
                          const std::vector<int64_t>& key_positions) {
  // The kernels count q_idx from the call's first query and kv_idx from its first key; the
  // module's mask and score function read positions in the sequence.
  const auto& score_mod = settings.options.score_mod();
  if (rows == nullptr) {
    const int64_t key_position = key_positions.empty() ? 0 : key_positions.front();
    const int64_t query_position = query_offset + key_position;
    const int64_t end = key_position + keys.size(2);
    auto call = module_call(queries, keys, values, settings, /*training=*/false,
                            module_mask(settings, query_offset) &
                                mask_at_positions(mask, {query_position}, {key_position}, end));
    call.step = StepKind::kCached;
    call.options.score_mod(score_mod_at_positions(score_mod, query_position, key_position));
    return run_checked_attention(call).context;
  }
  // Each row's own causal (and window) mask over its valid keys replaces the module's one
  // query offset; the planner adds it.
  const bool shifted_keys = !key_positions.empty();
  torch::Tensor key_offsets;
  if (shifted_keys)
    key_offsets = torch::tensor(key_positions, torch::kInt64).to(rows->starts.device());
  const auto query_offsets = shifted_keys ? rows->starts + key_offsets : rows->starts;
  Mask positioned_mask;
  if (!mask.is_none()) {
    const auto starts = query_offsets.cpu(), ends = rows->ends.cpu();
    std::vector<int64_t> query_positions, key_starts;
    int64_t end = 0;
    for (int64_t r = 0; r < starts.size(0); ++r) {
      const int64_t key_position = shifted_keys ? key_positions[static_cast<size_t>(r)] : 0;
      query_positions.push_back(starts[r].item<int64_t>());
      key_starts.push_back(key_position);
      end = std::max(end, key_position + ends[r].item<int64_t>());
    }
    positioned_mask = mask_at_positions(mask, query_positions, key_starts, end, /*ragged=*/true);
  }
  auto call = module_call(queries, keys, values, settings, /*training=*/false, positioned_mask);
  call.options.score_mod(score_mod_at_positions(score_mod, query_offsets, key_offsets));
  call.step = StepKind::kRagged;
  call.ragged.query_offsets = rows->starts;
  call.ragged.key_ends = rows->ends;
  call.ragged.window = settings.window_size.value_or(0);
  return run_checked_attention(call).context;
}

std::pair<torch::Tensor, torch::Tensor> key_value_inputs(
    const char* module, const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const InputSpec& spec, const torch::Tensor& parameter) {
  check_forward_input(module, query, spec, parameter, "query");
  TORCH_CHECK(!key.defined() || ContextParallelScope::current() == nullptr, "[", module,
              "::forward] cross-attention inside a ContextParallelScope is not offered: the "
              "scope shards one sequence's self-attention");
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
                                       const Mask& mask, const torch::Tensor& lengths,
                                       int64_t query_heads) {
  TORCH_CHECK(ContextParallelScope::current() == nullptr, "[", module,
              "::forward_with_cache] a KV cache holds one process's whole sequence: call it "
              "outside the ContextParallelScope");
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
  const int64_t n = x.size(1);
  // The mask, at the positions of the sequences: of a problem of [0, longest row's end), or
  // of the whole sequence it was made for.
  const auto check_mask = [&](int64_t end) {
    if (!mask.is_none()) {
      const auto [queries, keys] = positions_problem(mask, end);
      mask.check(c10::str("[", module, "::forward_with_cache]").c_str(), x.size(0), query_heads,
                 queries, keys, x.device());
    }
  };
  if (lengths.defined()) {
    auto new_lengths = check_ragged_lengths(module, x, lengths, context_length, cache);
    const auto before = cache.lengths();
    int64_t longest = 0;
    for (int64_t r = 0; r < x.size(0); ++r)
      longest = std::max(longest, before[r].item<int64_t>() + new_lengths[static_cast<size_t>(r)]);
    check_mask(longest);
    return new_lengths;
  }
  const int64_t end = cache.size() + n;
  TORCH_CHECK(context_length == 0 || end <= context_length, "[", module,
              "::forward_with_cache] x: ", n, " tokens after the ", cache.size(),
              " the cache holds would reach position ", end,
              ", past context_length = ", context_length);
  TORCH_CHECK(n <= cache.max_positions() - cache.size(), "[", module,
              "::forward_with_cache] x: ", n, " tokens after the ", cache.size(),
              " the cache holds would pass its capacity ", cache.capacity(),
              "; make a larger one with make_kv_cache(batch, capacity)");
  check_mask(end);
  return {};
}

torch::Tensor attend_cached(const QueryKeyTransform& transform, const torch::Tensor& queries,
                            const torch::Tensor& keys, const torch::Tensor& values, KVCache& cache,
                            const ModuleAttention& settings, const Mask& mask,
                            const std::vector<int64_t>& new_lengths) {
  // A mask or a score function reads positions: a rolling cache's one-token step then
  // returns its keys in position order too.
  const bool reads_positions =
      !mask.is_none() || score_reads_positions(settings.options.score_mod());
  if (new_lengths.empty()) {
    const int64_t start = cache.size();
    const auto [rotated_queries, rotated_keys] = transform(queries, keys, start);
    const auto span = cache.append(rotated_keys, values, /*position_order=*/reads_positions);
    return attend_step(rotated_queries, span.keys, span.values, settings, span.query_offset, mask,
                       /*rows=*/nullptr, {start - span.query_offset});
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
  // Row r's key index j is position j, or in a rolling cache its first held position + j.
  std::vector<int64_t> key_positions;
  if (reads_positions && cache.window_size() > 0) {
    const auto span_starts = span.starts.cpu();
    for (int64_t r = 0; r < span_starts.size(0); ++r)
      key_positions.push_back(host_starts[r].item<int64_t>() - span_starts[r].item<int64_t>());
  }
  return attend_step(rotated_queries, span.keys, span.values, settings, /*query_offset=*/0, mask,
                     &span, key_positions);
}

void check_paged_call(const char* module, bool training, const torch::Tensor& x, int64_t d_in,
                      int64_t context_length, const PagedKVCache& cache, const CacheLayout& layout,
                      const torch::Tensor& parameter, const std::vector<int64_t>& sequences,
                      const ScoreMod& score_mod, const RopeTables& rope, int64_t query_heads,
                      const Mask& mask) {
  const std::string fn = c10::str("[", module, "::forward_with_cache]");
  TORCH_CHECK(ContextParallelScope::current() == nullptr, fn,
              " a KV cache holds one process's whole sequence: call it outside the "
              "ContextParallelScope");
  TORCH_CHECK(!training, fn,
              " the KV cache is for inference, but the module is in training mode: call eval() "
              "first (training runs forward over whole sequences)");
  detail::check_forward_input(module, x, {d_in}, parameter);
  TORCH_CHECK(cache.holds_latents() == layout.latent, fn, " cache: expected a pool of ",
              layout.latent ? "latents" : "keys and values", ", got one of ",
              cache.holds_latents() ? "latents" : "keys and values",
              "; make it with make_paged_kv_cache");
  TORCH_CHECK(cache.num_heads() == layout.heads && cache.head_dim() == layout.head_dim, fn,
              " cache: expected pages of (num_heads, head_dim) = (", layout.heads, ", ",
              layout.head_dim, "), got (", cache.num_heads(), ", ", cache.head_dim(),
              "); make it with make_paged_kv_cache");
  TORCH_CHECK(cache.key_pages().dtype() == parameter.dtype() &&
                  cache.key_pages().device() == parameter.device(),
              fn, " cache: expected dtype ", parameter.scalar_type(), " on ", parameter.device(),
              " (the module's parameters), got ", cache.key_pages().scalar_type(), " on ",
              cache.key_pages().device());
  if (score_mod)  // what paged_attention would refuse after the append
    cpu_forward_score_variant(fn.c_str(), score_mod, query_heads);
  TORCH_CHECK(static_cast<int64_t>(sequences.size()) == x.size(0), fn,
              " sequences: expected one per row of x (", x.size(0), "), got ", sequences.size());
  const int64_t n = x.size(1);
  int64_t pages = 0, longest = 0;
  for (size_t r = 0; r < sequences.size(); ++r) {
    for (size_t before = 0; before < r; ++before) {
      TORCH_CHECK(sequences[before] != sequences[r], fn, " sequences must be distinct, got ",
                  sequences[r], " at rows ", before, " and ", r);
    }
    const int64_t start = cache.length(sequences[r]);  // refuses a released or unknown id
    TORCH_CHECK(context_length == 0 || start + n <= context_length, fn, " row ", r, ": ", n,
                " tokens after the ", start, " that sequence ", sequences[r],
                " holds would pass context_length ", context_length);
    check_rope_positions(module, "forward_with_cache] x", rope, start, n);
    pages += cache.pages_needed(sequences[r], n);
    longest = std::max(longest, start + n);
  }
  if (!mask.is_none()) {  // at the positions the step reads, or the sequence's it was made for
    const auto [queries, keys] = positions_problem(mask, longest);
    mask.check(fn.c_str(), x.size(0), query_heads, queries, keys, x.device());
  }
  TORCH_CHECK(pages <= cache.free_pages(), fn, " the pool is full: this step needs ", pages,
              " free pages, and ", cache.free_pages(), " of ", cache.num_pages(),
              " are free; release finished sequences, or wait");
}

PagedKVCache make_module_paged_cache(const CacheLayout& layout, const torch::Tensor& parameter,
                                     int64_t num_pages, int64_t page_size) {
  const auto options = torch::TensorOptions().dtype(parameter.dtype()).device(parameter.device());
  if (layout.latent)
    return PagedKVCache::latents(num_pages, page_size, layout.head_dim, options);
  return PagedKVCache(num_pages, page_size, layout.heads, layout.head_dim, options);
}

PagedAttentionOptions paged_options_of(const ModuleAttention& settings, const Mask& mask) {
  const auto& options = settings.options;
  // A softcap goes to the kernel's own; another score function row by row, at the positions
  // of each sequence.
  const auto* softcap = options.score_mod().target<SoftcapScore>();
  return PagedAttentionOptions()
      .scale(options.scale())
      .softcap(softcap ? softcap->cap : 0.0)
      .score_mod(softcap ? ScoreMod() : options.score_mod())
      .window(settings.window_size.value_or(0))
      .sinks(options.sinks())
      .mask(mask);
}

torch::Tensor attend_paged(const QueryKeyTransform& transform, const torch::Tensor& queries,
                           const torch::Tensor& keys, const torch::Tensor& values,
                           PagedKVCache& cache, const std::vector<int64_t>& sequences,
                           const ModuleAttention& settings, const Mask& mask) {
  const auto b = static_cast<int64_t>(sequences.size());
  const int64_t n = queries.size(2);
  std::vector<int64_t> starts;
  for (const int64_t sequence : sequences)
    starts.push_back(cache.length(sequence));
  const auto [rotated_queries, rotated_keys] =
      transform(queries, keys, torch::tensor(starts, torch::kInt64).to(queries.device()));
  for (int64_t r = 0; r < b; ++r)
    cache.append(sequences[static_cast<size_t>(r)], rotated_keys[r], values[r]);
  const int64_t window = settings.window_size.value_or(0);
  const auto context =
      paged_attention(rotated_queries, cache.view(sequences), paged_options_of(settings, mask));
  if (window > 0) {
    // The next query, at position start + n, reads from start + n - window + 1 on.
    for (int64_t r = 0; r < b; ++r) {
      const auto row = static_cast<size_t>(r);
      cache.drop_before(sequences[row], std::max<int64_t>(0, starts[row] + n - window + 1));
    }
  }
  return context;
}

}  // namespace attnkit::detail

namespace attnkit {

PagedKVCache CachedAttentionLayer::make_paged_kv_cache(int64_t, int64_t) const {
  TORCH_CHECK(false,
              "[make_paged_kv_cache] this layer has no paged cache (a layer of your own "
              "overrides make_paged_kv_cache and attend_paged_tokens)");
}

torch::Tensor CachedAttentionLayer::attend_paged_tokens(const torch::Tensor&, PagedKVCache&,
                                                        const std::vector<int64_t>&, const Mask&) {
  TORCH_CHECK(false,
              "[forward_with_cache] this layer takes no paged cache (a layer of your own "
              "overrides attend_paged_tokens)");
}

}  // namespace attnkit

namespace attnkit::detail {

void reset_child_parameters(torch::nn::Module& module) {
  for (const auto& child : module.children()) {
    if (auto* linear = child->as<torch::nn::Linear>())
      linear->reset_parameters();
    else if (auto* norm = child->as<RMSNorm>())
      norm->reset_parameters();
  }
}

RopeTables reset_query_key_transform(const char* name, torch::nn::Module& module,
                                     const c10::optional<RopeOptions>& rope, bool qk_norm,
                                     int64_t head_dim, RMSNorm& q_norm, RMSNorm& k_norm,
                                     const RMSNormOptions& norm_options) {
  if (qk_norm) {
    const auto options = RMSNormOptions(norm_options).dim(head_dim);
    q_norm = module.register_module("q_norm", RMSNorm(options));
    k_norm = module.register_module("k_norm", RMSNorm(options));
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

void print_score_options(std::ostream& stream, const ScoreMod& score_mod,
                         const c10::optional<double>& scale) {
  if (score_mod) {
    const auto* softcap = score_mod.target<SoftcapScore>();
    stream << ", score_mod="
           << (softcap ? c10::str("softcap(", option_text(softcap->cap), ")") : "function");
  }
  if (scale)
    stream << ", scale=" << option_text(*scale);
}

void check_rope_forward(const char* name, const RopeTables& rope, const torch::Tensor& query,
                        const torch::Tensor& key) {
  if (!rope.defined())
    return;
  TORCH_CHECK(!key.defined(), "[", name,
              "::forward] key: RoPE rotates queries and keys by their positions in one "
              "sequence, so a module with the rope option does self-attention only; got key ",
              shape_string(key));
  // Inside a ContextParallelScope the query is a shard, and positions reach the whole length.
  const auto* scope = ContextParallelScope::current();
  check_rope_positions(name, "forward] query", rope, 0,
                       scope != nullptr ? scope->shards().length() : query.size(1));
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
