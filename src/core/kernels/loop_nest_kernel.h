#pragma once

// attnkit's loop-nest attention kernel (loop_nest_kernel.cpp): one loop nest per (batch,
// head) slice for the scores, the causal/window mask, the softmax, dropout and the weighted
// sum, and one more for the three gradients. The autograd functions and entry points that
// use it are in loop_nest_attention.cpp.

#include <cstdint>
#include <utility>

#include <torch/torch.h>

namespace attnkit::detail::loop_nest {

/// Per outer row b of a ragged batch (causal, inference): its queries' key offset, its keys'
/// end, and its valid queries: the first key_ends[b] - query_offsets[b] rows, the rest padding.
struct RowBounds {
  const int64_t* query_offsets;
  const int64_t* key_ends;
};

/// (..., n, f) -> (outer, heads, n, f) with a unit-stride last dimension (a view when it can be).
torch::Tensor unit_stride_slices(const torch::Tensor& t);

/// An uninitialised (outer, heads, n, f) tensor laid out as (outer, n, heads, f): the layout
/// a projection split into heads has, so merging the heads back (or the backward of the
/// split) needs no copy.
torch::Tensor empty_heads_interleaved(int64_t outer, int64_t heads, int64_t n, int64_t f,
                                      const torch::TensorOptions& options);

/// Runs the forward kernel on (outer, heads, n, f) views with unit-stride rows, writing out4
/// (n, dv per slice); returns the weights (outer, heads, n, m) and the scaled dropout mask
/// (undefined without dropout) that backward needs. With `rows` (no weights returned, no
/// dropout), each outer row takes its query offset and key end from there instead of
/// query_offset, and its padding queries get zeros.
std::pair<torch::Tensor, torch::Tensor> run_forward(const torch::Tensor& q4,
                                                    const torch::Tensor& k4,
                                                    const torch::Tensor& v4, torch::Tensor& out4,
                                                    bool causal, int64_t query_offset,
                                                    int64_t window, double dropout_p,
                                                    const RowBounds* rows = nullptr);

/// Runs the backward kernel: fills grad_q4, grad_k4 and grad_v4 ((outer, heads, rows, f)
/// views with unit-stride rows, all three with the query heads) from grad_out4 and what
/// run_forward returned.
void run_backward(const torch::Tensor& q4, const torch::Tensor& k4, const torch::Tensor& v4,
                  const torch::Tensor& grad_out4, const torch::Tensor& weights,
                  const torch::Tensor& keep, bool causal, int64_t query_offset, int64_t window,
                  torch::Tensor& grad_q4, torch::Tensor& grad_k4, torch::Tensor& grad_v4);

/// Per-query-head key or value gradients (outer, heads, m, f) -> (outer, kv_heads, m, f),
/// summed over each group's query heads.
torch::Tensor sum_over_groups(const torch::Tensor& grad4, int64_t kv_heads);

}  // namespace attnkit::detail::loop_nest
