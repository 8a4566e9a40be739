#pragma once

// Score functions as values. The ready-made ones (score_mods::softcap, alibi,
// relative_position_bias, and the ScoreGraphs that match them) are these structs inside a
// ScoreMod, so a kernel can read which function it holds (ScoreMod::target<T>()) and evaluate
// it in its own loops (the fused tile kernel: row_variants.h), while every other kernel calls
// it as a function of tensors.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "attnkit/score_graph.h"
#include "attnkit/score_mods.h"

namespace attnkit::detail {

/// ALiBi's bias, slopes[h] * (kv_idx - q_idx), slopes of shape (heads); as a function of
/// tensors, the bias in score's dtype.
struct AlibiBias {
  torch::Tensor slopes;
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const;
};

/// A relative-position bias, table[h, clamp(kv_idx - q_idx, -D, D) + D], table of shape
/// (heads or 1, 2 D + 1); as a function of tensors, the bias in score's dtype.
struct RelativeBias {
  torch::Tensor table;
  int64_t max_distance;
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const;
};

/// A ScoreGraph with its captured tensors (ScoreGraph::bind): a function of tensors for the
/// kernels that call one, a graph for the fused tile kernel to compile
/// (core/scores/score_program.h).
struct GraphScore {
  std::shared_ptr<const ScoreGraph> graph;
  std::vector<torch::Tensor> tensors;
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const {
    return graph->evaluate(score, b, h, q_idx, kv_idx, tensors);
  }
};

/// A score function that adds a bias to the score, `score + bias(score, b, h, q_idx,
/// kv_idx)`, the bias in score's dtype (score is read for its dtype and device only): so that
/// the planner can hand the bias to LibTorch's SDPA as a float mask. `form` names the bias
/// where it is one a kernel evaluates itself (a GraphScore: any other graph; monostate: a
/// C++ function).
using BiasForm = std::variant<std::monostate, AlibiBias, RelativeBias, GraphScore>;
struct AdditiveScore {
  ScoreMod bias;
  BiasForm form = {};
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

/// A score function that reads positions in a longer sequence than the call's: q_idx counted
/// from `offsets` (a scalar, or (b): row b's start) instead of the call's first query, and
/// kv_idx from `key_offsets` (likewise; undefined: 0) (score_mod_at_positions). A module's
/// cached step shifts its queries, and a rolling cache's keys too; a context-parallel pair of
/// pieces both. The fused tile kernel evaluates it with scalar offsets (its variant's
/// offsets); the chunked kernel and the math core call it.
struct PositionedScore {
  ScoreMod score_mod;
  torch::Tensor offsets;
  torch::Tensor key_offsets;
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const;
};

/// Whether the score function may read q_idx or kv_idx: false for none and for a softcap,
/// true for anything else (a C++ function may read them, so it is taken to).
bool score_reads_positions(const ScoreMod& score_mod);

/// `score_mod` with q_idx counted from `offsets` instead of 0, and kv_idx from `key_offsets`
/// (undefined: 0): each a scalar, one offset for every row, or a (b) int64 tensor, row b's
/// starting at offsets[b]. Position-free score functions are returned as they are, so that
/// kernels still read their variant.
ScoreMod score_mod_at_positions(const ScoreMod& score_mod, const torch::Tensor& offsets,
                                const torch::Tensor& key_offsets = {});

/// `score_mod` with q_idx counted from `query_offset` and kv_idx from `key_offset`: a call
/// over a piece of a longer sequence's queries and keys (context parallelism).
ScoreMod score_mod_at_positions(const ScoreMod& score_mod, int64_t query_offset,
                                int64_t key_offset);

}  // namespace attnkit::detail
