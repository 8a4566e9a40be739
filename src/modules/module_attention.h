#pragma once

// What every multi-head module (MultiHeadAttention, MultiHeadAttentionCombinedQKV,
// GroupedQueryAttention, MultiHeadLatentAttention) does between its projections: attention
// over split heads by the chosen backend, and the KV-cache bookkeeping of forward_with_cache.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/functional.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"
#include "core/checks.h"

namespace attnkit::detail {

/// The attention options a module hands to the core.
struct AttentionSettings {
  bool causal = true;
  c10::optional<int64_t> window_size;
  double dropout = 0.0;
  AttentionBackend backend = AttentionBackend::kMath;
  int64_t chunk_size = 128;
  int64_t key_chunk_size = 1024;
};

/// Queries (b, h, n, hd) against keys and values (b, g, m, hd) with g dividing h, query i at
/// key position query_offset + i -> context (b, h, n, hd), by `settings.backend`, under the
/// module's causal/window mask and `mask` together; with
/// `with_weights` (or the math backend) the math core, which also returns the weights
/// (b, h, n, m).
functional::AttentionOutput attend(const torch::Tensor& queries, const torch::Tensor& keys,
                                   const torch::Tensor& values, const AttentionSettings& settings,
                                   bool training, int64_t query_offset = 0,
                                   bool with_weights = false, const Mask& mask = {});

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
/// and device, positions past context_length (0: no limit) or the cache's capacity, and a
/// mask on a rolling cache (which holds its keys in storage order, not by position).
void check_cached_call(const char* module, bool training, const torch::Tensor& x, int64_t d_in,
                       int64_t context_length, const KVCache& cache, const CacheLayout& layout,
                       const torch::Tensor& parameter, const Mask& mask = {});

}  // namespace attnkit::detail
