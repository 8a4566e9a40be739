#pragma once

/// The earlier entry points `scaled_dot_product_attention`, `chunked_attention`,
/// `fused_attention` and `fused_backend_attention` with their option structs `SdpaOptions`,
/// `ChunkedOptions` and `FusedOptions`: deprecated shims over the one core, `attention(q, k,
/// v, AttentionOptions)` (attnkit/attention.h), through the planner like every call. Each
/// option struct's deprecation message names its replacement; docs/masks.md maps their
/// fields, docs/modules.md lists each shim's replacement. Nothing inside attnkit includes
/// this header. `causal_mask` (attnkit/attention.h) and the notebooks' teaching steps
/// (attnkit/book_steps.h) are included here, so code that found them here still compiles.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/book_steps.h"

namespace attnkit::functional {

// The adapters' declarations name their own deprecated types; a caller is warned where it
// names them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

/// Options for `scaled_dot_product_attention`. Deprecated: use
/// `attention_with_weights(q, k, v, AttentionOptions().mask(Mask::causal()).backend(kMath))`.
/// Example: `SdpaOptions().is_causal(true).dropout_p(0.1).training(true)`.
struct [[deprecated(
    "use functional::attention / attention_with_weights with AttentionOptions: attn_mask "
    "becomes mask(Mask::from_tensor(attn_mask.logical_not())), is_causal + query_offset + "
    "window_size become mask(Mask::causal(offset).sliding_window(w)), and backend(kMath) "
    "keeps the book's math")]] SdpaOptions {
  /// Bool mask broadcastable to (..., n, m); `true` marks a key a query must not see.
  /// A row that masks every key gets all-zero weights (never NaN).
  TORCH_ARG(torch::Tensor, attn_mask) = {};
  /// Apply the causal mask `causal_mask(n, m, device, query_offset)` (in addition to
  /// `attn_mask`, if any).
  TORCH_ARG(bool, is_causal) = false;
  /// With `is_causal`: the key position of query 0 (see `causal_mask`); 0 aligns the mask
  /// top-left, m - n bottom-right (decoding). Must be >= 0.
  TORCH_ARG(int64_t, query_offset) = 0;
  /// With `is_causal`: sliding-window attention, query i sees only keys j with
  /// 0 <= query_offset + i - j < window_size (see `causal_mask`). Unset: every earlier key.
  /// Must be >= 1, and needs `is_causal`.
  TORCH_ARG(c10::optional<int64_t>, window_size) = c10::nullopt;
  /// Dropout probability on the attention weights, in [0, 1); used only when `training`.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Whether dropout is active.
  TORCH_ARG(bool, training) = false;
  /// Score multiplier; when unset the scores are divided by sqrt(head_dim), as in the book.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
};

/// The one attention core of attnkit, the book's computation:
/// `dropout(softmax(masked_fill(q k^T, mask, -inf) / sqrt(hd))) @ v`
/// for q (..., n, hd), k (..., m, hd), v (..., m, hd_v). Returns the context and the weights.
///
/// Grouped-query attention: 4-D (b, heads, n, hd) and larger keys and values may have fewer
/// heads (dimension -3) than the queries, G dividing the queries' H; query head h then uses
/// key/value head h / (H / G), the order of `repeat_interleave` (G = 1 is multi-query attention).
/// Every attention function of this header accepts that layout; the fast ones never materialise the
/// repeated heads. Example: `scaled_dot_product_attention_with_weights(q, k, v,
/// SdpaOptions().is_causal(true))`.
AttentionOutput scaled_dot_product_attention_with_weights(const torch::Tensor& query,
                                                          const torch::Tensor& key,
                                                          const torch::Tensor& value,
                                                          const SdpaOptions& options = {});

/// Same as `scaled_dot_product_attention_with_weights`, returning only the context (..., n, hd_v).
/// Example: `scaled_dot_product_attention(q, k, v, SdpaOptions().is_causal(true))`.
torch::Tensor scaled_dot_product_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value,
                                           const SdpaOptions& options = {});

/// Options for `chunked_attention`. Deprecated: use `attention(q, k, v, AttentionOptions()
/// .mask(Mask::causal()).backend(AttentionBackend::kChunked).query_block_size(64))`.
/// Example: `ChunkedOptions().is_causal(true).block_size(64)`.
struct [[deprecated(
    "use functional::attention with AttentionOptions().backend(AttentionBackend::kChunked): "
    "is_causal + query_offset + window_size become mask(Mask::causal(offset).sliding_window(w)), "
    "block_size becomes query_block_size")]] ChunkedOptions {
  /// Causal mask `causal_mask(n, m, device, query_offset)`; key blocks above it are skipped.
  TORCH_ARG(bool, is_causal) = false;
  /// With `is_causal`: the key position of query 0 (see `causal_mask`); 0 aligns the mask
  /// top-left, m - n bottom-right (decoding). Must be >= 0.
  TORCH_ARG(int64_t, query_offset) = 0;
  /// With `is_causal`: sliding-window attention, query i sees only keys j with
  /// 0 <= query_offset + i - j < window_size (see `causal_mask`). Unset: every earlier key.
  /// Must be >= 1, and needs `is_causal`.
  TORCH_ARG(c10::optional<int64_t>, window_size) = c10::nullopt;
  /// Dropout probability on the attention weights, in [0, 1); used only when `training`.
  /// Same distribution as the math path, not the same random draws.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Whether dropout is active.
  TORCH_ARG(bool, training) = false;
  /// Query tokens per block.
  TORCH_ARG(int64_t, block_size) = 128;
  /// Key tokens per block: the online softmax visits ceil(m / key_block_size) key blocks
  /// per query block; memory per head grows with block_size * key_block_size.
  TORCH_ARG(int64_t, key_block_size) = 1024;
};

/// Memory-efficient attention equal to `scaled_dot_product_attention` (scale 1/sqrt(hd)):
/// queries and keys in blocks with an online softmax, and a backward pass that recomputes
/// each block from the saved log-sum-exp, so memory grows linearly in num_tokens.
/// q (..., n, hd), k (..., m, hd), v (..., m, hd_v) -> (..., n, hd_v).
/// Example: `chunked_attention(q, k, v, ChunkedOptions().is_causal(true))`.
torch::Tensor chunked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const ChunkedOptions& options = {});

/// Options for `fused_attention`, `fused_packed_attention` and `fused_backend_attention`.
/// Deprecated: use `attention(q, k, v, AttentionOptions().mask(Mask::causal())
/// .backend(AttentionBackend::kFused))`.
/// Example: `FusedOptions().is_causal(true).dropout_p(0.1).training(true)`.
struct [[deprecated(
    "use functional::attention with AttentionOptions().backend(AttentionBackend::kFused): "
    "is_causal + query_offset + window_size become "
    "mask(Mask::causal(offset).sliding_window(w))")]] FusedOptions {
  /// Causal mask `causal_mask(n, m, device, query_offset)`.
  TORCH_ARG(bool, is_causal) = false;
  /// With `is_causal`: the key position of query 0 (see `causal_mask`); 0 aligns the mask
  /// top-left, m - n bottom-right (decoding). Must be >= 0.
  TORCH_ARG(int64_t, query_offset) = 0;
  /// With `is_causal`: sliding-window attention, query i sees only keys j with
  /// 0 <= query_offset + i - j < window_size (see `causal_mask`). Unset: every earlier key.
  /// Must be >= 1, and needs `is_causal`.
  TORCH_ARG(c10::optional<int64_t>, window_size) = c10::nullopt;
  /// Dropout probability on the attention weights, in [0, 1); used only when `training`.
  /// The mask is drawn as the math path draws it, so a seed gives the same mask.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Whether dropout is active.
  TORCH_ARG(bool, training) = false;
};

/// Attention equal to `scaled_dot_product_attention` (scale 1/sqrt(hd)) computed on CPU in
/// one loop nest per (batch, head) slice, forward and backward, with no intermediate tensor
/// but the (..., n, m) weights that backward needs. Fast while a slice's weights stay in
/// cache (the toy sizes of attnkit-train); for long sequences the BLAS-based paths win.
/// CPU, float32 or float64. q (..., n, hd), k (..., m, hd), v (..., m, hd_v) -> (..., n, hd_v).
/// Example: `fused_attention(q, k, v, FusedOptions().is_causal(true))`.
torch::Tensor fused_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const FusedOptions& options = {});

/// `fused_attention` on packed projections, the output of one QKV GEMM:
/// qkv (b, n, 3 * h * hd), queries then keys then values, each (b, n, h * hd) with heads
/// side by side -> context (b, n, h * hd), heads merged. Backward writes the gradient of qkv
/// in one piece instead of three that autograd would concatenate. n queries see n keys, so
/// `query_offset` must be 0.
/// Example: `fused_packed_attention(qkv_projection(x), 12, FusedOptions().is_causal(true))`.
torch::Tensor fused_packed_attention(const torch::Tensor& qkv, int64_t num_heads,
                                     const FusedOptions& options = {});

/// Largest n * m for which the fused backend of the modules uses `fused_attention` on
/// LibTorch 1.x: the loop-nest kernel's limit, which the planner keeps beside that kernel
/// (src/core/kernels/kernels.h, where its measurement is told).
constexpr int64_t kFusedAttentionMaxTile = 64 * 64;

/// Whether the modules' fused backend takes `fused_attention` for n queries and m keys of
/// tensors with `options`: CPU, float32 or float64, and n * m <= kFusedAttentionMaxTile.
bool fused_attention_fits(int64_t num_queries, int64_t num_keys,
                          const torch::TensorOptions& options);

/// The attention of the modules' `kFused` backend on this LibTorch, equal to
/// `scaled_dot_product_attention` (scale 1/sqrt(hd), causal mask with `query_offset`).
/// LibTorch >= 2.0: LibTorch's own `at::scaled_dot_product_attention` (flash or
/// memory-efficient kernels on CUDA, a flash kernel on CPU, which from 2.5 on runs with the
/// BLAS on one thread when LibTorch has several: docs/threads.md). LibTorch 1.13, which has
/// none: `fused_attention` where `fused_attention_fits`, else `chunked_attention` (default
/// blocks) on CPU and the math core elsewhere. Any device and floating dtype. Dropout masks
/// come from the global generator, so a seed repeats them; only `fused_attention` and the
/// math core draw the math path's masks, the others the same distribution.
/// q (..., n, hd), k (..., m, hd), v (..., m, hd_v) -> (..., n, hd_v).
/// Example: `fused_backend_attention(q, k, v, FusedOptions().is_causal(true))`.
torch::Tensor fused_backend_attention(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, const FusedOptions& options = {});

#pragma GCC diagnostic pop

}  // namespace attnkit::functional
