#pragma once

// The math core (math_kernel.cpp): dense scores, softmax, dropout and weighted sum with
// LibTorch's autograd. It takes every call, so the planner asks it last.

#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec math_spec();

/// What the math core applies between the scores and the softmax.
struct MathMasking {
  /// Bool, broadcastable to the scores (..., n, m), true = may attend; undefined: all.
  torch::Tensor allowed;
  /// Applied to the scaled scores with `index` (b, h, q_idx, kv_idx) tensors; may be empty.
  ScoreMod score_mod;
  std::vector<torch::Tensor> index;
  /// Floating, broadcastable to the scores: added after score_mod; undefined: none.
  torch::Tensor bias;
  /// (h) attention sinks of 4-D scores (AttentionOptions::sinks); undefined: none.
  torch::Tensor sinks;
};

/// `dropout(softmax(masked(score_mod(scale * q k^T)))) @ v` with autograd, for q (..., n, hd),
/// k (..., m, hd), v (..., m, hd_v) with equal heads (GQA callers repeat k and v). A row
/// that sees no key gets zero weights. Unset scale: divide by sqrt(hd) (the book's op).
functional::AttentionOutput math_attention(const torch::Tensor& query, const torch::Tensor& key,
                                           const torch::Tensor& value, const MathMasking& masking,
                                           c10::optional<double> scale, double dropout_p,
                                           bool training);

/// The math core's dropout of the attention weights: the op behind Python's nn.Dropout, so
/// a seed draws the book's masks.
torch::Tensor attention_dropout(const torch::Tensor& weights, double dropout_p, bool training);

}  // namespace attnkit::detail
