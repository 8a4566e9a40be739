#pragma once

// A kernel as the planner sees it: one spec beside the kernel's code (its name, the backend it
// serves, its 16-bit policy and its decision), and the call that every decision reads. The
// planner (planner.h) only walks a table of specs; each kernel file declares its own spec
// (kernels.h lists them).
//
// A decision is a plan or the reason the kernel declines, computed once: what a kernel worked
// out to accept a call (a layout, a causal span) is what its run uses.

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "attnkit/kernel_record.h"

namespace attnkit::detail {

/// The book's scale, 1 / sqrt(head_dim).
inline double default_scale(int64_t head_dim) {
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

/// What kind of step a call is; the inference kernels serve only cached steps.
enum class StepKind {
  /// Whole sequences: a training forward (and its backward), a prefill, an encoder.
  kSequence,
  /// New queries against a KV cache's keys, at one query offset for every row (inference).
  kCached,
  /// A ragged cached step: row r's queries at their own offset, its keys ending at their own
  /// end (inference).
  kRagged,
};

/// The rows of a ragged step: query i of row r sits at key position query_offsets[r] + i and
/// sees keys before key_ends[r] ((b) int64 tensors), within `window` positions (0: no window).
struct RaggedRows {
  torch::Tensor query_offsets, key_ends;
  int64_t window = 0;
};

/// One attention call as its caller describes it.
struct AttentionCall {
  /// (b, h, n, hd) queries against (b, g, m, hd) keys and (b, g, m, hd_v) values, g | h.
  torch::Tensor query, key, value;
  /// The mask (for kRagged: on top of each row's own causal mask), score function, scale,
  /// dropout, tile sizes and the backend asked for.
  functional::AttentionOptions options;
  /// Whether options.backend() is a preference (a module's option: a problem its kernels
  /// cannot run goes to one that can) or a demand (functional::attention: refused, naming
  /// what the backend lacks).
  bool backend_is_preference = false;
  /// The weights too, (b, h, n, m): only the math core builds them.
  bool with_weights = false;
  StepKind step = StepKind::kSequence;
  /// kRagged: each row's query offset, key end and the window.
  RaggedRows ragged;
  /// The (b, n, 3 * h * hd) projection that query, key and value are the head views of, when
  /// they are (self-attention without a transform between the projection and attention).
  torch::Tensor packed_qkv;
  /// Forward and backward as two calls that keep the output and the log-sum-exp between them
  /// (the PyTorch operators: run_split_forward, run_split_backward): only kernels with a
  /// SplitKernel take it.
  bool split = false;
  /// A split call's dropout seed (>= 0 where it trains with dropout): backward redraws the
  /// masks forward drew from it.
  int64_t dropout_seed = -1;
  /// A split forward whose backward follows (the operators' autograd): its output is made as
  /// backward reads it (SplitForward::unrounded).
  bool backward_follows = false;
  /// A split forward that also gives each row's largest score (FlexAttention's max_scores):
  /// only kernels whose SplitKernel keeps_row_max take it.
  bool wants_row_max = false;
};

/// A mask as the fused kernels take it: none (causal false), or query i seeing keys up to
/// query_offset + i, and with window > 0 only the `window` keys up to there.
struct CausalSpan {
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0;  // 0: none
};

/// What the fused kernels (loop nest, SDPA, flash) take besides their tensors.
struct FusedArguments {
  CausalSpan mask;
  double dropout_p = 0.0;  // 0: none
};

/// A call as the kernels' decisions read it: the call, and what is derived from it, each made
/// at most once per call (on first use) and shared by every kernel the planner asks.
class KernelInput {
 public:
  explicit KernelInput(const AttentionCall& call) : call(call) {}

  const AttentionCall& call;

  int64_t query_tokens() const { return call.query.size(2); }
  int64_t key_tokens() const { return call.key.size(2); }
  /// The dropout probability the call trains with; 0 outside training.
  double dropout_p() const;
  /// The call's scale, or the default 1/sqrt(head_dim).
  double scale() const;
  bool has_default_scale() const;
  /// Which keys each query sees: the call's mask, joined for a ragged step by each row's
  /// causal mask over its valid keys (and window).
  const Mask& mask() const;
  /// mask() as a causal span; nullopt when it is none of: no mask, causal, sliding window.
  const std::optional<CausalSpan>& causal_span() const;
  /// Whether a CPU call's query or key holds a NaN (looked at once per call; for a stand-in,
  /// in the call it stands in for: see stands_in_for).
  bool cpu_query_or_key_has_nan() const;
  /// Makes this input a stand-in of `real`'s (uninitialised tensors of a copy's shapes): the
  /// questions about values are answered from `real`.
  void stands_in_for(const KernelInput& real) { real_ = &real; }

 private:
  mutable std::optional<Mask> mask_;
  mutable std::optional<std::optional<CausalSpan>> causal_span_;
  mutable std::optional<bool> cpu_nan_;
  const KernelInput* real_ = nullptr;
};

/// What a split call's backward reads besides the call: forward's output (b, h, n, hd_v) and
/// log-sum-exp (b, h, n), the output's gradient, and the tensors the score function reads
/// that want gradients.
struct SplitSaved {
  torch::Tensor out, lse, grad_out;
  std::vector<torch::Tensor> parameters;
};

/// What a split forward gives: the output, each row's log-sum-exp of its scaled, modified
/// scores (+inf for a row that sees no key), and where the call wants it
/// (AttentionCall::wants_row_max) each row's largest such score (-inf for none, NaN where a
/// score is NaN), (b, h, n) in the compute dtype; else undefined.
struct SplitOutputs {
  torch::Tensor out, lse, row_max;
};

/// A kernel's forward and backward as two calls, outside autograd. backward -> the gradients
/// of query, key, value, then of each SplitSaved::parameters tensor. Both run on the call in
/// its compute dtype. keeps_row_max: whether forward gives SplitOutputs::row_max.
struct SplitKernel {
  std::function<SplitOutputs(const KernelInput&)> forward;
  std::function<std::vector<torch::Tensor>(const KernelInput&, const SplitSaved&)> backward;
  bool keeps_row_max = false;
};

/// A kernel's answer to one call.
struct KernelDecision {
  /// Why the kernel cannot run the call; "" when it can.
  std::string declined;
  /// Runs the call with the plan the decision made (for a declined call, the plan as far as
  /// it got: what the mutation test makes a kernel run regardless). Always set.
  std::function<functional::AttentionOutput(const KernelInput&)> run;
  /// The plan as a split forward and backward, for kernels that have one (else empty).
  SplitKernel split = {};
};

/// A kernel as the planner sees it.
struct KernelSpec {
  /// "decode", "ragged_loop_nest", "packed_loop_nest", "loop_nest", "flash", "sdpa",
  /// "sdpa_varlen", "sdpa_masked", "chunked", "math": the name functional::KernelRecord gives.
  const char* name;
  /// The backend whose choice it serves; kAuto: every backend (the inference kernels).
  AttentionBackend backend;
  /// Whether a 16-bit CUDA call runs in its own dtype (LibTorch's CUDA kernels, which keep
  /// their statistics and accumulators in float32); false: attnkit computes it in float32 and
  /// rounds the result once.
  bool runs_16bit_cuda_in_its_dtype;
  /// Its decision on a call.
  std::function<KernelDecision(const KernelInput&)> decide;
  /// Whether it runs attention sinks (AttentionOptions::sinks); the planner declines a call
  /// with sinks for the kernels that do not.
  bool takes_sinks = false;
  /// Whether a 16-bit CPU call runs in its own dtype, its products on the CPU's matrix units
  /// (matrix_units.h), where its decision takes it; false: computed in float32.
  bool runs_16bit_cpu_in_its_dtype = false;
  /// Whether the planner passes it over for a 16-bit CPU call of at least
  /// kMatrixUnitsFromKeys keys, which the fused tile kernel runs faster on the matrix units,
  /// unless the call demands it (cpu_route_allowed): LibTorch's CPU SDPA, which computes the
  /// call in float32.
  bool yields_16bit_cpu_to_matrix_units = false;
  /// Whether a 16-bit CPU call runs on its own tensors on any CPU, each element widened to
  /// float32 as it is read and the arithmetic in float32, the result rounded once: the decode
  /// kernel, which reads each cached key and value once and has no products for matrix units
  /// (a float32 copy of the cache per step would cost more than the step).
  bool reads_16bit_cpu_in_place = false;
};

/// From this many keys a 16-bit CPU call runs faster on the matrix units (the fused tile
/// kernel) than in LibTorch's SDPA in float32. Forward+backward of a causal MHA module in
/// bfloat16 (b 8, d 256, 4 heads, 1 thread, AVX-512 BF16), SDPA against the tiles: n 128 16.0
/// against 17.6 ms, n 256 47.2 against 36.8, n 512 148.5 against 93.5 (causal n 4,096, b 1, 8
/// heads: the tiles 2.03x faster).
constexpr int64_t kMatrixUnitsFromKeys = 256;

/// Kernels in the order the planner asks them: fast paths first, a fallback that takes every
/// call last.
using KernelTable = std::vector<KernelSpec>;

// Rules that several kernels' decisions share.

/// What every fused kernel (loop nest, packed loop nest, SDPA) lacks for `input`: "" or why.
std::string fused_kernels_decline(const KernelInput& input);

/// What the SDPA routes for any mask (sdpa_varlen, sdpa_masked) lack: "" or why.
std::string sdpa_routes_decline(const KernelInput& input);

/// Why LibTorch's CPU SDPA and flash kernels decline a call whose query or key holds a NaN:
/// they break attnkit's NaN rule (docs/masks.md). "" otherwise, and where the call demands
/// them (cpu_route_allowed: a demanded kFused, a named kernel).
std::string libtorch_cpu_nan_declines(const KernelInput& input);

/// Whether a route that the CPU runs slower than the chunked kernel may take the call: a
/// demanded kFused there (docs/benchmarks.md) or a named kernel, anything on other devices.
bool cpu_route_allowed(const AttentionCall& call);

bool is_16bit(const torch::Tensor& tensor);

/// The dtype a kernel computes a call on `tensor` in (its scores, softmax statistics, lse and
/// accumulators): float32 for 16-bit inputs, else the tensor's own. The planner's one rule.
torch::ScalarType compute_dtype(const torch::Tensor& tensor);

/// A block size (AttentionOptions' query_block_size, key_block_size) as a tiled kernel uses
/// it: `size`, but at most `tokens` (the longer of the queries and keys) rounded up to even.
/// A larger block holds no more tokens, and the kernels allocate by it: key_block_size(1 << 40)
/// failed in the allocator, and a block of 2^30 on 32 tokens grew to 24 GB.
int64_t block_for(int64_t size, int64_t tokens);

/// Whether autograd would want this call's gradients: grad mode on, and the query, key, value
/// or a tensor its score function reads (score_variant_of) wants one.
bool wants_gradient(const AttentionCall& call);

}  // namespace attnkit::detail
