#pragma once

/// Ready-made score functions (FlexAttention's score_mod) for `AttentionOptions::score_mod`:
/// values the kernels recognise and run in their own loops (docs/masks.md).

#include <torch/torch.h>

#include "attnkit/score_mod.h"

namespace attnkit {

namespace score_mods {

/// ALiBi: adds slopes[h] * (kv_idx - q_idx), slopes of shape (heads), as FlexAttention's
/// example. Example: `score_mods::alibi(score_mods::alibi_slopes(12))`.
ScoreMod alibi(const torch::Tensor& slopes);

/// The ALiBi paper's slopes for `heads` heads: 2^(-8 i / heads) for i = 1..heads (float32).
torch::Tensor alibi_slopes(int64_t heads);

/// Soft-capping (Gemma 2): cap * tanh(score / cap), cap > 0.
/// Example: `score_mods::softcap(50.0)`.
ScoreMod softcap(double cap);

/// A learnable relative-position bias: adds bias[h, clamp(kv_idx - q_idx, -D, D) + D] for
/// a bias of shape (heads, 2 D + 1) (or (1, 2 D + 1), shared by the heads). The bias trains
/// like any parameter: gradients reach it on every backend.
/// Example: `auto bias = torch::zeros({12, 2 * 64 + 1}, torch::requires_grad());
/// score_mods::relative_position_bias(bias)`.
ScoreMod relative_position_bias(const torch::Tensor& bias);

}  // namespace score_mods

}  // namespace attnkit
