#pragma once

/// The data of an attention call: its options and its outputs. The entry points that take and
/// return them are in attnkit/attention.h.

#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/block_mask.h"
#include "attnkit/mask.h"
#include "attnkit/options.h"
#include "attnkit/score_mod.h"

namespace attnkit::functional {

/// Options of `attention`.
/// Example: `AttentionOptions().mask(Mask::causal()).score_mod(score_mods::softcap(30))`.
struct AttentionOptions {
  /// Which keys each query may see; default: all of them.
  TORCH_ARG(Mask, mask) = {};
  /// The mask judged once for this shape (`create_block_mask`): made once per step and reused
  /// by every layer, forward and backward. Its mask is the call's mask (leave `mask` unset).
  /// Without one, a call with a mask makes its own.
  TORCH_ARG(BlockMask, block_mask) = {};
  /// Applied to the scaled scores; default: none.
  TORCH_ARG(ScoreMod, score_mod) = {};
  /// Score multiplier; unset: 1 / sqrt(head_dim).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Attention sinks (GPT-OSS): one logit per query head, (heads), that takes part in every
  /// row's softmax with no value, so a row's weights sum to less than 1: weight j is
  /// exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k)). Gradients reach it. Undefined: none. The
  /// math core, the decode kernel and the chunked family (the fused tile kernel's split
  /// forward and backward, memory linear in n) run it; the planner routes a call with sinks
  /// to them.
  TORCH_ARG(torch::Tensor, sinks) = {};
  /// Dropout probability on the attention weights, in [0, 1); used only when `training`.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Whether dropout is active.
  TORCH_ARG(bool, training) = false;
  /// Which kernel computes it; `kAuto` picks one that supports the problem.
  TORCH_ARG(AttentionBackend, backend) = AttentionBackend::kAuto;
  /// Query tokens per tile of the chunked backend, and the block size of the block mask a
  /// masked call makes (a given `block_mask` brings its own). Both block sizes are clamped to
  /// the longer of the queries and keys (rounded up to even): a longer block holds no more.
  TORCH_ARG(int64_t, query_block_size) = 128;
  /// Key tokens per tile of the chunked backend at most: adjacent non-empty key blocks are
  /// computed together up to this width.
  TORCH_ARG(int64_t, key_block_size) = 1024;
  /// The kernel that must compute it, by the name `KernelRecord` reports ("loop_nest",
  /// "chunked", "math", ...; docs/backends.md lists them); empty (the default): the planner
  /// picks among `backend`'s kernels. A named kernel runs even where the planner would leave
  /// the call to a faster one (the loop nest beyond its tile size, say), and is refused,
  /// with its reason, where it cannot compute the call; `backend` is then not read. For
  /// benchmarks, tests and comparisons of one kernel with another.
  TORCH_ARG(std::string, kernel) = "";
};

/// Context vectors together with the attention weights that produced them
/// (weights after dropout, as multiplied into the values).
struct AttentionOutput {
  /// (..., n, hd_v)
  torch::Tensor context;
  /// (..., n, m)
  torch::Tensor weights;
};

/// An attention call's output with each row's log-sum-exp: what a schedule of its own (the
/// keys in shards, merged by `merge_attention`; ring attention) needs from each piece.
struct AttentionWithLse {
  /// (b, h, n, hd_v), in the inputs' dtype.
  torch::Tensor out;
  /// (b, h, n): log sum_j exp(s_ij) over each row's scaled, modified, unmasked scores, in the
  /// dtype the kernel computed in (float32 for 16-bit inputs); +inf for a row that sees no key
  /// (whose `out` is zeros).
  torch::Tensor lse;
  /// For 16-bit inputs computed with float32 accumulators, `out` before its rounding
  /// (float32), where a backward will follow: `attention_forward` makes it when the inputs
  /// (or the score function's tensors) want gradients under grad mode, and `merge_attention`
  /// merges it. `attention_backward` reads it for D = rowsum(dO * O), which the rounded output
  /// would put off (a per-head bias's gradient, 0 in exact arithmetic, about 1e-2 off in
  /// bfloat16). Undefined otherwise: backward then reads `out`.
  torch::Tensor out_for_backward = {};
};

/// The gradients `attention_backward` returns.
struct AttentionGradients {
  torch::Tensor query, key, value;
  /// Of each tensor the score function reads that wants a gradient (a relative-position
  /// bias table, a ScoreGraph's tensors), in the order `ScoreGraph::bind` took them.
  std::vector<torch::Tensor> score_tensors;
};

}  // namespace attnkit::functional
