#pragma once

// What every multi-head module (MultiHeadAttention, MultiHeadAttentionCombinedQKV,
// GroupedQueryAttention, MultiHeadLatentAttention) does between its projections: attention
// over split heads by the chosen backend, and the KV-cache bookkeeping of forward_with_cache.

#include <cmath>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/context_parallel.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/rms_norm.h"
#include "attnkit/rope.h"
#include "core/base/checks.h"

namespace attnkit::detail {

/// What a module hands to the core: the shape of its own mask (causal, and a window; each call
/// brings its query offset) and the options of every call, as AttentionOptions (dropout,
/// backend, block sizes, scale). Each call sets `mask` and `training`; the backend is a
/// preference.
struct ModuleAttention {
  bool causal = true;
  c10::optional<int64_t> window_size;
  functional::AttentionOptions options;
};

/// A module's ModuleAttention from its options (dropout, backend, query_block_size,
/// key_block_size, score_mod, scale) and the shape of its mask.
template <typename ModuleOptions>
ModuleAttention module_attention_of(const ModuleOptions& opt, bool causal,
                                    c10::optional<int64_t> window_size) {
  return {causal, window_size,
          functional::AttentionOptions()
              .dropout_p(opt.dropout())
              .backend(opt.backend())
              .query_block_size(opt.query_block_size())
              .key_block_size(opt.key_block_size())
              .score_mod(opt.score_mod())
              .scale(opt.scale())};
}

/// Queries (b, h, n, hd) against keys and values (b, g, m, hd) with g dividing h, query i at
/// key position query_offset + i -> context (b, h, n, hd), described to the planner under the
/// module's causal/window mask and `mask` together, `settings.options.backend()` a preference; with
/// `with_weights` also the weights (b, h, n, m) (the math core). `packed_qkv`: the (b, n,
/// 3 * h * hd) projection the three are views of, where they are.
functional::AttentionOutput attend(const torch::Tensor& queries, const torch::Tensor& keys,
                                   const torch::Tensor& values, const ModuleAttention& settings,
                                   bool training, int64_t query_offset = 0,
                                   bool with_weights = false, const Mask& mask = {},
                                   const torch::Tensor& packed_qkv = {});

/// A cached step's attention (inference): new queries (b, h, n, hd) against the cache's keys
/// and values (b, g, m, hd). Without `rows`, query i sits at key position query_offset + i
/// under the module's mask and `mask`; with `rows` (a ragged append's span), row r's queries
/// sit at rows->starts[r] and see its keys before rows->ends[r], and `mask`.
/// `mask` and the score function read positions in the sequence: key index j of row r is
/// position key_positions[r] + j (one entry: every row; empty: j), a rolling cache's keys
/// in position order.
torch::Tensor attend_step(const torch::Tensor& queries, const torch::Tensor& keys,
                          const torch::Tensor& values, const ModuleAttention& settings,
                          int64_t query_offset, const Mask& mask,
                          const KVCache::RaggedSpan* rows = nullptr,
                          const std::vector<int64_t>& key_positions = {});

/// reset()'s checks of the options every multi-head module has: d_in, d_out and num_heads
/// >= 1 with num_heads dividing d_out, dropout in [0, 1), the block sizes >= 1, and a scale,
/// when set, finite and > 0.
template <typename Options>
void check_multi_head_options(const char* module, const Options& opt) {
  check_positive_option(module, "d_in", opt.d_in());
  check_positive_option(module, "d_out", opt.d_out());
  check_positive_option(module, "num_heads", opt.num_heads());
  check_dropout_option(module, opt.dropout());
  check_positive_option(module, "query_block_size", opt.query_block_size());
  check_positive_option(module, "key_block_size", opt.key_block_size());
  TORCH_CHECK(opt.d_out() % opt.num_heads() == 0, "[", module,
              "] option d_out must be divisible by num_heads, got d_out = ", opt.d_out(),
              ", num_heads = ", opt.num_heads());
  TORCH_CHECK(!opt.scale() || (std::isfinite(*opt.scale()) && *opt.scale() > 0.0), "[", module,
              "] option scale must be finite and > 0 (unset: 1 / sqrt(head width)), got ",
              opt.scale().value_or(0.0));
}

/// The inputs of the keys and values of forward(query, key, value): query itself for
/// self-attention (key and value undefined), else key and value (value defaults to key),
/// each checked as query is, with query's batch.
std::pair<torch::Tensor, torch::Tensor> key_value_inputs(
    const char* module, const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const InputSpec& spec, const torch::Tensor& parameter);

/// The cache a module needs: key/value heads and width, a rolling window, or latents.
struct CacheLayout {
  int64_t heads;
  int64_t head_dim;
  int64_t window_size = 0;  // > 0: a rolling cache of that many positions
  bool latent = false;      // a latent cache of head_dim wide latents
};

/// A module's make_kv_cache: `batch` sequences; `capacity` positions (0: context_length,
/// which must then be > 0), ignored by a rolling cache; in `parameter`'s dtype and device.
KVCache make_module_cache(const char* module, const CacheLayout& layout, int64_t context_length,
                          const torch::Tensor& parameter, int64_t batch, int64_t capacity);

/// Everything that can be wrong with a forward_with_cache call, checked before anything is
/// computed or written: training mode, the input x (b, n, d_in), the cache's layout, dtype
/// and device, positions past context_length (0: no limit) or the cache's capacity, and
/// `mask` against query_heads heads and the positions [0, longest row's end) of the step.
/// With `lengths` defined (forward_with_cache(x, cache, lengths)): a (b) int64 tensor, each in
/// [0, n], and each row's end within context_length and the capacity (any cache kind).
/// Returns the lengths as numbers (empty without `lengths`).
std::vector<int64_t> check_cached_call(const char* module, bool training, const torch::Tensor& x,
                                       int64_t d_in, int64_t context_length, const KVCache& cache,
                                       const CacheLayout& layout, const torch::Tensor& parameter,
                                       const Mask& mask, const torch::Tensor& lengths,
                                       int64_t query_heads);

/// Heads (b, h, s, hd) of this rank's shard in `scope`, each chunk rotated at its start in
/// the whole sequence.
torch::Tensor rotate_shard(const RopeTables& rope, const torch::Tensor& heads,
                           const ContextParallelScope& scope);

/// What a module with QK-norm or RoPE does to its heads between the projections and
/// attention. `q_norm`/`k_norm` are empty holders without qk_norm, `rope` undefined without
/// rope.
struct QueryKeyTransform {
  const RMSNorm& q_norm;
  const RMSNorm& k_norm;
  const RopeTables& rope;

  bool active() const { return !q_norm.is_empty() || rope.defined(); }
  /// Query heads (b, h, n, hd) and key heads (b, g, m, hd) normed, then rotated with token i
  /// at position `positions` + i (an int64_t, or an int64 scalar or (b) tensor). Inside a
  /// ContextParallelScope the heads are this rank's shard, each token rotated at its position
  /// in the whole sequence (cached calls, which pass other positions, are refused there).
  template <typename Positions>
  std::pair<torch::Tensor, torch::Tensor> operator()(torch::Tensor queries, torch::Tensor keys,
                                                     const Positions& positions) const {
    if (!q_norm.is_empty()) {
      queries = q_norm.ptr()->forward(queries);
      keys = k_norm.ptr()->forward(keys);
    }
    if (rope.defined()) {
      if (const auto* scope = ContextParallelScope::current()) {
        queries = rotate_shard(rope, queries, *scope);
        keys = rotate_shard(rope, keys, *scope);
      } else {
        queries = rope.rotate(queries, positions);
        keys = rope.rotate(keys, positions);
      }
    }
    return {queries, keys};
  }
};

/// What a cached step does with the projected heads: query heads (b, h, n, hd), key and value
/// heads (b, g, n, hd) -> context (b, h, n, hd); attend_cached or attend_paged, bound to a cache.
using AttendHeads =
    std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

/// forward_with_cache's step after the projections, for the modules with a key/value cache:
/// the new tokens' query heads (b, h, n, hd) and key and value heads (b, g, n, hd) normed and
/// rotated at their positions, appended, and attended under the module's settings and `mask`
/// -> context (b, h, n, hd). `new_lengths` empty: every row adds n tokens (KVCache::append);
/// else row r adds its first new_lengths[r] (KVCache::append_ragged), the rest padding.
torch::Tensor attend_cached(const QueryKeyTransform& transform, const torch::Tensor& queries,
                            const torch::Tensor& keys, const torch::Tensor& values, KVCache& cache,
                            const ModuleAttention& settings, const Mask& mask,
                            const std::vector<int64_t>& new_lengths);

/// The checks of forward_with_cache(x, PagedKVCache&, sequences), before anything is written:
/// eval mode, x (b, n, d_in), one distinct live sequence per row, the pool's heads, head width,
/// dtype and device (`layout`, `parameter`), positions within context_length (0: no limit)
/// and the RoPE tables, room in the pool for every row's n positions, a score_mod that fits
/// query_heads heads on the CPU (cpu_forward_score_variant), and `mask` against query_heads
/// heads and the positions the step reads.
void check_paged_call(const char* module, bool training, const torch::Tensor& x, int64_t d_in,
                      int64_t context_length, const PagedKVCache& cache, const CacheLayout& layout,
                      const torch::Tensor& parameter, const std::vector<int64_t>& sequences,
                      const ScoreMod& score_mod, const RopeTables& rope, int64_t query_heads,
                      const Mask& mask);

/// A module's make_paged_kv_cache: num_pages pages of page_size positions of `layout`'s heads
/// (a latent layout: a pool of latents), in `parameter`'s dtype and device.
PagedKVCache make_module_paged_cache(const CacheLayout& layout, const torch::Tensor& parameter,
                                     int64_t num_pages, int64_t page_size);

/// paged_attention's options for a module's step: its scale, score_mod (a softcap as the
/// kernel's own), window and sinks, and `mask`.
PagedAttentionOptions paged_options_of(const ModuleAttention& settings, const Mask& mask);

/// attend_cached's paged step: the new tokens' query heads (b, h, n, hd) and key and value
/// heads (b, g, n, hd), row r the next n tokens of sequences[r], normed and rotated at their
/// positions, appended to the pool, and attended by paged_attention under the module's
/// causal mask, window, scale, softcap and sinks -> context (b, h, n, hd). With a window, the
/// pages that no later query reads go back to the pool (PagedKVCache::drop_before).
torch::Tensor attend_paged(const QueryKeyTransform& transform, const torch::Tensor& queries,
                           const torch::Tensor& keys, const torch::Tensor& values,
                           PagedKVCache& cache, const std::vector<int64_t>& sequences,
                           const ModuleAttention& settings, const Mask& mask = {});

/// A module's reset() for its rope and qk_norm options: refuses an odd head width with RoPE
/// and a rope context_length < 1; returns the tables (undefined without rope) and registers
/// `q_norm` and `k_norm` (RMSNorm over head_dim, with `norm_options`' eps and unit_offset) on
/// `module` with qk_norm.
RopeTables reset_query_key_transform(const char* name, torch::nn::Module& module,
                                     const c10::optional<RopeOptions>& rope, bool qk_norm,
                                     int64_t head_dim, RMSNorm& q_norm, RMSNorm& k_norm,
                                     const RMSNormOptions& norm_options = RMSNormOptions(1));

/// pretty_print's text for the rope and qk_norm options, each only when set:
/// `, rope=(context_length=4096, theta_base=10000, layout=split_half), qk_norm=true`.
void print_query_key_options(std::ostream& stream, const c10::optional<RopeOptions>& rope,
                             bool qk_norm);

/// pretty_print's text for the score_mod and scale options, each only when set:
/// `, score_mod=softcap(50), scale=0.0625` (a function that is not a ready-made one prints as
/// `function`).
void print_score_options(std::ostream& stream, const ScoreMod& score_mod,
                         const c10::optional<double>& scale);

/// forward's check for a module with RoPE: self-attention (key undefined) of at most the
/// tables' context_length tokens.
void check_rope_forward(const char* name, const RopeTables& rope, const torch::Tensor& query,
                        const torch::Tensor& key);

/// The check for a module with RoPE that positions [start, start + n) are within the tables;
/// `where` is the message's "function] argument", e.g. "forward_with_cache] x".
void check_rope_positions(const char* name, const char* where, const RopeTables& rope,
                          int64_t start, int64_t n);

/// forward_with_cache's check: the new tokens at the cache's positions, or with
/// `new_lengths` (a ragged call) each row's valid tokens at that row's positions.
void check_rope_cached_positions(const char* name, const RopeTables& rope, const KVCache& cache,
                                 const std::vector<int64_t>& new_lengths, int64_t n);

}  // namespace attnkit::detail
