#pragma once

// The kernels behind attnkit's attention, for the core and the module glue: the math core
// (dense, autograd), the chunked kernel (tiles read from a block mask, online softmax, its
// own backward), the packed and ragged fused kernels (fused_attention.cpp), and the score
// function helpers. Masks and score functions are read in the same (b, h, q_idx, kv_idx)
// terms.

#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/functional.h"

namespace attnkit::detail {

/// What the math core applies between the scores and the softmax.
struct MathMasking {
  /// Bool, broadcastable to the scores (..., n, m), true = may attend; undefined: all.
  torch::Tensor allowed;
  /// Applied to the scaled scores with `index` (b, h, q_idx, kv_idx) tensors; may be empty.
  ScoreMod score_mod;
  std::vector<torch::Tensor> index;
};

/// `dropout(softmax(masked(score_mod(scale * q k^T)))) @ v` with autograd, for q (..., n, hd),
/// k (..., m, hd), v (..., m, hd_v) with equal heads (GQA callers repeat k and v). A row
/// that sees no key gets zero weights. Unset scale: divide by sqrt(hd) (the book's op).
functional::AttentionOutput math_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value, const MathMasking& masking,
                                           c10::optional<double> scale, double dropout_p,
                                           bool training);

/// The chunked kernel on (..., n, hd) inputs (4-D: (b, h, n, hd), b read as the mask's
/// batch index), with the options' mask, score function, scale and dropout. A masked call
/// reads the mask's block mask (Mask::from_block_mask) or makes one with blocks of
/// query_block_size; key tiles are at most key_block_size wide. Checks are the caller's.
torch::Tensor chunked_kernel(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value,
                             const functional::AttentionOptions& options);

/// MultiHeadAttention's kFused path on its packed (b, n, 3 * d_out) QKV projection, heads
/// merged: (b, n, d_out). LibTorch 1.x only, where attnkit's CPU kernel reads the projection
/// in place for short sequences; elsewhere, or past that kernel's size, an undefined tensor
/// (the caller splits the heads). Defined in fused_attention.cpp, which holds every
/// LibTorch-version split.
torch::Tensor packed_fused_attention_if_fits(const torch::Tensor& qkv, int64_t num_heads,
                                             const functional::FusedOptions& options);

/// The attention of a ragged multi-token step (KVCache::append_ragged's span) by attnkit's
/// CPU loop-nest kernel, outside autograd: query i of row r sees key j when
/// j <= query_offsets[r] + i, j < key_ends[r] and (window > 0) j > query_offsets[r] + i -
/// window; a query that sees no key gets zeros, and so do row r's padding queries, past its
/// first key_ends[r] - query_offsets[r] (the valid tokens). query (b, h, n, hd), keys and values
/// (b, g, m, hd[_v]) with g dividing h; returns (b, h, n, hd_v) laid out as (b, n, h, hd_v).
/// An undefined tensor where the kernel does not take them (not CPU float/double, autograd
/// to record, n * m past its tile): the caller's masked path serves those.
torch::Tensor ragged_fused_attention_if_fits(const torch::Tensor& query, const torch::Tensor& keys,
                                             const torch::Tensor& values,
                                             const torch::Tensor& query_offsets,
                                             const torch::Tensor& key_ends, int64_t window);

/// Tensors with requires_grad that `score_mod` reads (leaves of the graph it builds on a
/// probe score), which the chunked kernel hands gradients to.
std::vector<torch::Tensor> score_mod_parameters(const ScoreMod& score_mod,
                                                const torch::TensorOptions& options);

/// score_mod on a tile (..., rows, cols) with its index tensors; checks the result.
torch::Tensor apply_score_mod(const ScoreMod& score_mod, const torch::Tensor& scores,
                              const std::vector<torch::Tensor>& index);

}  // namespace attnkit::detail
