#pragma once

// A linear layer on one row or a few (decode steps): each weight row read once for all of
// them (few_rows_linear.cpp).

#include <torch/torch.h>

namespace attnkit::detail {

/// Most rows few_rows_linear_if_fits takes.
constexpr int64_t kFewRowsMax = 16;

/// x W^T + bias for x (..., in) of 1 to kFewRowsMax rows, W (out, in), bias (out) or
/// undefined, by a kernel that streams each weight row once and multiplies it with every row
/// of x held in cache. A decode step is bound by reading the weights: for one row this reads
/// them at 1.3-1.6x the speed of OpenBLAS's GEMV on one thread (GPT-2 small), and a few rows
/// share one read. An undefined tensor where it does not apply: not CPU float32, autograd to
/// record, more rows, or a CPU without AVX2 and FMA.
torch::Tensor few_rows_linear_if_fits(const torch::Tensor& x, const torch::Tensor& weight,
                                      const torch::Tensor& bias);

}  // namespace attnkit::detail
