#pragma once

/// The one attention core: `attnkit::functional::attention(q, k, v, AttentionOptions)`, with
/// a mask (`attnkit::Mask`), a score function (FlexAttention's `score_mod`), a scale,
/// dropout and a backend (docs/masks.md). Every attnkit module hands its attention here.

#include <functional>
#include <string>

#include <torch/torch.h>

#include "attnkit/block_mask.h"
#include "attnkit/mask.h"
#include "attnkit/options.h"
#include "attnkit/score_mod.h"

namespace attnkit::detail {
struct KernelRecordAccess;
}  // namespace attnkit::detail

namespace attnkit {

/// Whether this LibTorch multiplies float16 matrices on the CPU (2.x does; 1.13 does not, so
/// its float16 modules need a GPU). attnkit's attention core computes 16-bit inputs in
/// float32 either way. Probed once.
bool cpu_multiplies_float16();

/// Ready-made score functions.
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

namespace functional {

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

/// Causal mask as a bool tensor of shape (num_queries, num_keys): `true` where a query would
/// see a later key. Query i sits at key position `query_offset + i` and sees keys
/// j <= query_offset + i: offset 0 aligns the mask top-left, as
/// `torch.triu(torch.ones(n, m), diagonal=1).bool()`; offset m - n aligns it bottom-right,
/// as queries at the end of a longer key sequence (a decode step against a KV cache) need.
/// With `window_size` W (sliding-window attention) query i also does not see keys more than
/// W - 1 positions before it: it sees keys j with 0 <= query_offset + i - j < W.
/// Example: `causal_mask(6, 6)`; `causal_mask(1, 10, torch::kCPU, 9)` masks nothing;
/// `causal_mask(6, 6, torch::kCPU, 0, 2)` lets each query see itself and its predecessor.
torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys,
                          const torch::Device& device = torch::kCPU, int64_t query_offset = 0,
                          c10::optional<int64_t> window_size = c10::nullopt);

/// Context vectors together with the attention weights that produced them
/// (weights after dropout, as multiplied into the values).
struct AttentionOutput {
  /// (..., n, hd_v)
  torch::Tensor context;
  /// (..., n, m)
  torch::Tensor weights;
};

/// `dropout(softmax(mask(score_mod(scale * q k^T)))) @ v` for query (b, h, n, hd),
/// key (b, g, m, hd) and value (b, g, m, hd_v), g dividing h (grouped-query attention: query
/// head i uses key/value head i / (h / g)); 3-D (b, n, hd) and 2-D (n, hd) inputs have one
/// head. A query that sees no key gets zeros. Returns (b, h, n, hd_v) (or the input's rank).
/// Example: `attention(q, k, v, AttentionOptions().mask(Mask::causal()))`.
torch::Tensor attention(const torch::Tensor& query, const torch::Tensor& key,
                        const torch::Tensor& value, const AttentionOptions& options = {});

/// `attention`, also returning the weights (b, h, n, m): the math backend, which builds them
/// (`kAuto` and `kMath` only).
/// Example: `attention_with_weights(q, k, v, AttentionOptions().mask(Mask::causal()))`.
AttentionOutput attention_with_weights(const torch::Tensor& query, const torch::Tensor& key,
                                       const torch::Tensor& value,
                                       const AttentionOptions& options = {});

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

/// `attention`'s forward as a call of its own, outside autograd: the output and each row's
/// log-sum-exp, for 4-D query (b, h, n, hd), key (b, g, m, hd) and value (b, g, m, hd_v). The
/// kernels that have a separate forward and backward run it (the fused tile kernel on the CPU:
/// any mask, block mask and named or graph score function; LibTorch's CPU flash kernel);
/// `options.backend` is not read. Refused: dropout, sinks, C++ function score functions, and
/// devices without such a kernel (CUDA). Example:
/// `auto [out, lse] = attention_forward(q, k, v, AttentionOptions().mask(Mask::causal()));`
AttentionWithLse attention_forward(const torch::Tensor& query, const torch::Tensor& key,
                                   const torch::Tensor& value,
                                   const AttentionOptions& options = {});

/// The backward of `attention_forward` from its output and lse and the output's gradient
/// (b, h, n, hd_v): the gradients of query, key and value (and of the score function's
/// tensors that want one). Given the output and lse of a whole row (a merge of key shards),
/// a call over one shard of the keys gives that shard's key and value gradients and its share
/// of the query's, which add up over the shards. Outside autograd.
AttentionGradients attention_backward(const torch::Tensor& query, const torch::Tensor& key,
                                      const torch::Tensor& value, const AttentionWithLse& forward,
                                      const torch::Tensor& grad_out,
                                      const AttentionOptions& options = {});

/// The attention of each query over the union of the parts' keys, from its attention over
/// each part (the same queries, the keys in disjoint shards): outputs weighted by
/// exp(lse_part - lse), lse = log sum exp(lse_part). A row that sees no key in a part (lse
/// +inf there) takes nothing from it. Example: `merge_attention({first, second})`.
AttentionWithLse merge_attention(const std::vector<AttentionWithLse>& parts);

/// Why `backend` cannot run this problem ("" when it can): the fused backend has no score
/// functions and only the default scale; it takes causal and sliding-window masks, and on
/// LibTorch 2.x any other mask as SDPA's dense bool mask (up to 128 MiB of bools).
/// Example: `unsupported_reason(AttentionBackend::kFused, q, k, v, options)`.
std::string unsupported_reason(AttentionBackend backend, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value,
                               const AttentionOptions& options);

/// The backend `attention` runs: `options.backend()` unless it is `kAuto`, which takes the
/// fused backend where it supports the problem, else the chunked one.
AttentionBackend choose_backend(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const AttentionOptions& options);

/// One attention call as the planner ran it.
struct KernelRun {
  /// The kernel: "decode", "ragged_loop_nest", "packed_loop_nest", "loop_nest", "flash",
  /// "sdpa" (LibTorch's SDPA; on 1.13 its stand-in, docs/backends.md), "sdpa_varlen",
  /// "sdpa_masked", "chunked" or "math".
  std::string kernel;
  /// The dtype it computed in: a 16-bit call's own where its kernel runs it so (LibTorch's
  /// CUDA kernels; the fused tile kernel on a CPU with matrix units; the decode kernel, which
  /// reads 16-bit caches in place), else float32; the inputs' for other calls (under autocast,
  /// the autocast dtype's).
  c10::ScalarType computed_in;
  /// The inputs' device.
  c10::Device device;
  /// For a 16-bit call, how its products ran and why: "BFloat16 products on AVX-512 BF16
  /// (oneDNN's brgemm), float32 accumulation", "BFloat16 read in place, float32 arithmetic"
  /// (the decode kernel), or "float32: " and the reason (a CPU without
  /// AMX or AVX-512 BF16/FP16, a LibTorch without brgemm, ...); empty for other calls.
  std::string sixteen_bit;
};

/// The planner's record: while one is alive, every attention call that this thread makes
/// (`attention`, the modules, decode steps) is appended to it, so a test or a tool can check
/// which route ran. Records nest: each sees the calls made while it is the innermost.
/// Example: `KernelRecord record; mha(x); EXPECT_EQ(record.runs().at(0).kernel, "chunked");`
class KernelRecord {
 public:
  KernelRecord();
  ~KernelRecord();
  KernelRecord(const KernelRecord&) = delete;
  KernelRecord& operator=(const KernelRecord&) = delete;
  const std::vector<KernelRun>& runs() const { return runs_; }

 private:
  friend struct detail::KernelRecordAccess;  // the planner appends
  std::vector<KernelRun> runs_;
  KernelRecord* outer_;
};

}  // namespace functional
}  // namespace attnkit
