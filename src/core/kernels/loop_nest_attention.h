#pragma once

// The loop-nest kernel's entries with autograd: split heads, a packed projection, a ragged
// step (loop_nest_attention.cpp; the loop nest itself: loop_nest_kernel.h).

#include <torch/torch.h>

#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec ragged_loop_nest_spec();
KernelSpec packed_loop_nest_spec();
KernelSpec loop_nest_spec();

/// Largest n * m the loop-nest kernels take. Measured with attnkit-bench (loop nest against
/// the math core, forward+backward, 2-core x86): at head_dim 64 the loop nest wins at n = 32
/// and 64 and loses from n = 128; at head_dim 16 it still wins at n = 128.
constexpr int64_t kLoopNestMaxTile = 64 * 64;

/// Whether the loop-nest kernels take n queries and m keys of tensors with `options`: CPU,
/// float32 or float64, and n * m <= kLoopNestMaxTile.
bool loop_nest_fits(int64_t num_queries, int64_t num_keys, const torch::TensorOptions& options);

/// The loop-nest kernel (CPU, float32 or float64) on (..., n, hd) inputs with autograd: the
/// arguments' causal span and dropout, scale 1/sqrt(hd). Checks are the caller's.
torch::Tensor loop_nest_attention(const torch::Tensor& query, const torch::Tensor& key,
                                  const torch::Tensor& value, const FusedArguments& arguments);

/// The loop-nest kernel on a packed (b, n, 3 * h * hd) QKV projection, read in place ->
/// (b, n, h * hd), heads merged; backward writes qkv's gradient in one piece. The queries are
/// the keys' tokens: the span's query offset is not read (0).
torch::Tensor loop_nest_packed_attention(const torch::Tensor& qkv, int64_t num_heads,
                                         const FusedArguments& arguments);

/// Whether ragged_loop_nest_attention takes these: 4-D CPU float or double tensors of one
/// dtype, g dividing h, n * m within kLoopNestMaxTile, no autograd to record.
bool ragged_loop_nest_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values);

/// The attention of a ragged multi-token step (KVCache::append_ragged's span), outside
/// autograd: query i of row r sees key j when j <= query_offsets[r] + i, j < key_ends[r] and
/// (window > 0) j > query_offsets[r] + i - window; a query that sees no key gets zeros, and
/// so do row r's padding queries, past its first key_ends[r] - query_offsets[r]. query
/// (b, h, n, hd), keys and values (b, g, m, hd[_v]) -> (b, h, n, hd_v) laid out as
/// (b, n, h, hd_v). Refuses what ragged_loop_nest_fits refuses.
torch::Tensor ragged_loop_nest_attention(const torch::Tensor& query, const torch::Tensor& keys,
                                         const torch::Tensor& values, const RaggedRows& rows);

}  // namespace attnkit::detail
