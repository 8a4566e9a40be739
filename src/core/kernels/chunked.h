#pragma once

// The chunked kernel (chunked.cpp): tiles read from a block mask, online softmax, its own
// backward.

#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "core/kernels/tile_problem.h"
#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec chunked_spec();

/// The chunked kernel on (..., n, hd) inputs (4-D: (b, h, n, hd), b read as the mask's
/// batch index), with the options' mask, score function, scale and dropout. A masked call
/// reads the mask's block mask (Mask::from_block_mask) or makes one with blocks of
/// query_block_size; key tiles are at most key_block_size wide. Checks are the caller's.
torch::Tensor chunked_kernel(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value,
                             const functional::AttentionOptions& options);

/// The chunked kernel's settings for one call (tile_problem.h): the score function as LibTorch
/// ops on a tile.
struct ChunkedProblem : TileProblem {
  ScoreMod score_mod;
  int64_t head_batch = 0;  // 0: plan it (forward writes its plan here, for backward)
};

/// The chunked kernel's forward without autograd, on (..., n, hd) inputs of one dtype ->
/// the output (..., n, hd_v), and in `lse` the rows' log-sum-exp of their scaled, modified
/// scores, (outer, heads, n, 1) in the inputs' dtype, +inf for a row that sees no key (so
/// that backward gives it zero weights).
torch::Tensor chunked_forward(ChunkedProblem& problem, const torch::Tensor& query,
                              const torch::Tensor& key, const torch::Tensor& value,
                              torch::Tensor* lse);

/// The chunked kernel's backward from forward's output and lse: the gradients of query, key,
/// value and then of each of `parameters` (the tensors the score function reads that want
/// gradients; zeros for one it does not reach).
std::vector<torch::Tensor> chunked_backward(const ChunkedProblem& problem,
                                            const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const torch::Tensor& out,
                                            const torch::Tensor& lse, const torch::Tensor& grad_out,
                                            const std::vector<torch::Tensor>& parameters);

}  // namespace attnkit::detail
