#pragma once

// C++ function score functions (ScoreMod) as the kernels call them on a tile (score_mods.cpp).

#include <vector>

#include <torch/torch.h>

#include "attnkit/score_mod.h"

namespace attnkit::detail {

/// Tensors with requires_grad that `score_mod` reads (leaves of the graph it builds on a
/// probe score), which the chunked kernel hands gradients to.
std::vector<torch::Tensor> score_mod_parameters(const ScoreMod& score_mod,
                                                const torch::TensorOptions& options);

/// score_mod on a tile (..., rows, cols) with its index tensors; checks the result.
torch::Tensor apply_score_mod(const ScoreMod& score_mod, const torch::Tensor& scores,
                              const std::vector<torch::Tensor>& index);

}  // namespace attnkit::detail
