#pragma once

/// `attnkit::ScoreMod`, FlexAttention's score function, on its own so that the modules'
/// options (attnkit/options.h) can hold one without the attention core's header.

#include <functional>

#include <ATen/core/Tensor.h>

namespace attnkit {

/// FlexAttention's `score_mod(score, b, h, q_idx, kv_idx) -> score`: applied to the scaled
/// scores of a tile before the mask and the softmax. `score` has the broadcast shape of the
/// index tensors (as for `MaskMod`); the result must have score's shape and dtype.
/// Gradients flow through it into q and k, and into the tensors it reads (a bias table).
/// In a module's options, q_idx and kv_idx are positions in the sequence, also in cached
/// calls. Example: `[](auto s, auto, auto, auto q, auto kv) { return s - (q - kv).abs(); }`.
using ScoreMod = std::function<torch::Tensor(const torch::Tensor& score, const torch::Tensor& b,
                                             const torch::Tensor& h, const torch::Tensor& q_idx,
                                             const torch::Tensor& kv_idx)>;

}  // namespace attnkit
