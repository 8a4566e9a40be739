#pragma once

// Score functions as values. The ready-made ones (score_mods::softcap, alibi,
// relative_position_bias, and the ScoreGraphs that match them) are these structs inside a
// ScoreMod, so a kernel can read which function it holds (ScoreMod::target<T>()) and evaluate
// it in its own loops (the fused tile kernel, fused_tiles.cpp), while every other kernel calls
// it as a function of tensors.

#include <cstdint>
#include <optional>
#include <variant>

#include <torch/torch.h>

#include "attnkit/attention.h"

namespace attnkit::detail {

/// ALiBi's bias, slopes[h] * (kv_idx - q_idx), slopes of shape (heads).
struct AlibiBias {
  torch::Tensor slopes;
};

/// A relative-position bias, table[h, clamp(kv_idx - q_idx, -D, D) + D], table of shape
/// (heads or 1, 2 D + 1).
struct RelativeBias {
  torch::Tensor table;
  int64_t max_distance;
};

/// A score function that adds a bias to the score, `score + bias(score, b, h, q_idx,
/// kv_idx)`, the bias in score's dtype (score is read for its dtype and device only): so that
/// the planner can hand the bias to LibTorch's SDPA as a float mask. `form` names the bias
/// where it is one a kernel evaluates itself (monostate: a general one).
struct AdditiveScore {
  ScoreMod bias;
  std::variant<std::monostate, AlibiBias, RelativeBias> form = {};
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const {
    return score + bias(score, b, h, q_idx, kv_idx);
  }
};

/// Soft-capping, cap * tanh(score / cap).
struct SoftcapScore {
  double cap;
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor&, const torch::Tensor&,
                           const torch::Tensor&, const torch::Tensor&) const {
    return torch::tanh(score / cap) * cap;
  }
};

/// A score function as the fused tile kernel evaluates it.
struct ScoreVariant {
  enum class Kind { kNone, kSoftcap, kAlibi, kRelativeBias };
  Kind kind = Kind::kNone;
  double cap = 0.0;          // kSoftcap
  torch::Tensor table;       // kAlibi: the slopes; kRelativeBias: the table
  int64_t max_distance = 0;  // kRelativeBias
};

/// The variant a score function is (kNone for none); nullopt for any other function.
std::optional<ScoreVariant> score_variant_of(const ScoreMod& score_mod);

}  // namespace attnkit::detail
