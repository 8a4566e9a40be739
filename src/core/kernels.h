#pragma once

// The kernels behind attnkit's attention, which only the planner (planner.cpp) chooses
// among: the math core (dense, autograd; math_kernel.cpp), the chunked kernel (tiles read from
// a block mask, online softmax, its own backward; chunked.cpp), the loop-nest kernel over
// split heads, a packed projection or a ragged step (loop_nest_attention.cpp), LibTorch's
// SDPA (sdpa_kernel.cpp, which holds every LibTorch-version split) and the decode step
// (decode_attention.h). Also the score function helpers. Masks and score functions are read
// in the same (b, h, q_idx, kv_idx) terms.
//
// One word, one meaning in the kernels: a *group* is the query heads that share one
// key/value head (grouped-query attention), *group_size* how many; a set of heads a kernel
// computes together is a *head batch*.

#include <functional>
#include <optional>
#include <vector>

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include "attnkit/attention.h"
#include "core/kernel_spec.h"
#include "core/score_variants.h"

namespace attnkit::detail {

/// Each kernel's spec, declared beside its code; the planner's table (planner.cpp) lists them
/// in the order it asks them.
KernelSpec decode_spec();            // decode_attention.cpp
KernelSpec ragged_loop_nest_spec();  // loop_nest_attention.cpp
KernelSpec packed_loop_nest_spec();  // loop_nest_attention.cpp
KernelSpec loop_nest_spec();         // loop_nest_attention.cpp
KernelSpec flash_spec();             // sdpa_kernel.cpp
KernelSpec sdpa_spec();              // sdpa_kernel.cpp
KernelSpec sdpa_varlen_spec();       // varlen_kernel.cpp
KernelSpec sdpa_masked_spec();       // sdpa_kernel.cpp
KernelSpec sinks_spec();             // sink_attention.cpp
KernelSpec fused_tiles_spec();       // fused_tiles.cpp
KernelSpec chunked_spec();           // chunked.cpp
KernelSpec math_spec();              // math_kernel.cpp

/// Largest n * m the loop-nest kernels take. Measured with attnkit-bench (loop nest against
/// the math core, forward+backward, 2-core x86): at head_dim 64 the loop nest wins at n = 32
/// and 64 and loses from n = 128; at head_dim 16 it still wins at n = 128.
constexpr int64_t kLoopNestMaxTile = 64 * 64;

/// Whether the loop-nest kernels take n queries and m keys of tensors with `options`: CPU,
/// float32 or float64, and n * m <= kLoopNestMaxTile.
bool loop_nest_fits(int64_t num_queries, int64_t num_keys, const torch::TensorOptions& options);

/// Keeps LibTorch's autocast off while alive. The kernels choose their own dtypes (a 16-bit
/// call is computed in float32), which autocast would cast back down; the planner runs every
/// call under one, and the kernels' own backward functions run under one too.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

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

/// The chunked kernel on (..., n, hd) inputs (4-D: (b, h, n, hd), b read as the mask's
/// batch index), with the options' mask, score function, scale and dropout. A masked call
/// reads the mask's block mask (Mask::from_block_mask) or makes one with blocks of
/// query_block_size; key tiles are at most key_block_size wide. Checks are the caller's.
torch::Tensor chunked_kernel(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value,
                             const functional::AttentionOptions& options);

/// The chunked kernel's settings for one call, shared by its forward and its backward.
struct ChunkedProblem : torch::CustomClassHolder {
  Mask mask;
  BlockMask blocks;  // defined when the mask is not none
  ScoreMod score_mod;
  double scale = 1.0;
  double dropout_p = 0.0;
  int64_t dropout_seed = -1;  // < 0: no dropout
  int64_t query_block = 128;  // the block mask's query block when there is one
  int64_t key_block = 1024;
  int64_t head_batch = 0;  // 0: plan it (forward writes its plan here, for backward)
};

/// The chunked kernel's forward without autograd, on (..., n, hd) inputs of one dtype ->
/// the output (..., n, hd_v), and in `lse` the rows' log-sum-exp of their scaled, modified
/// scores, (outer, heads, n, 1) in the inputs' dtype, +inf for a row that sees no key (so
/// that backward gives it zero weights).
torch::Tensor chunked_forward(ChunkedProblem& problem, const torch::Tensor& query,
                              const torch::Tensor& key, const torch::Tensor& value,
                              torch::Tensor* lse);

/// The chunked kernel's backward from forward's output and lse: the gradients of query, key,
/// value and then of each of `parameters` (the tensors the score function reads that want
/// gradients; zeros for one it does not reach).
std::vector<torch::Tensor> chunked_backward(const ChunkedProblem& problem,
                                            const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const torch::Tensor& out,
                                            const torch::Tensor& lse, const torch::Tensor& grad_out,
                                            const std::vector<torch::Tensor>& parameters);

/// The loop-nest kernel (CPU, float32 or float64) on (..., n, hd) inputs with autograd: the
/// arguments' causal span and dropout, scale 1/sqrt(hd). Checks are the caller's.
torch::Tensor loop_nest_attention(const torch::Tensor& query, const torch::Tensor& key,
                                  const torch::Tensor& value, const FusedArguments& arguments);

/// The loop-nest kernel on a packed (b, n, 3 * h * hd) QKV projection, read in place ->
/// (b, n, h * hd), heads merged; backward writes qkv's gradient in one piece. The queries are
/// the keys' tokens: the span's query offset is not read (0).
torch::Tensor loop_nest_packed_attention(const torch::Tensor& qkv, int64_t num_heads,
                                         const FusedArguments& arguments);

/// Whether ragged_loop_nest_attention takes these: 4-D CPU float or double tensors of one
/// dtype, g dividing h, n * m within kLoopNestMaxTile, no autograd to record.
bool ragged_loop_nest_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values);

/// The attention of a ragged multi-token step (KVCache::append_ragged's span), outside
/// autograd: query i of row r sees key j when j <= query_offsets[r] + i, j < key_ends[r] and
/// (window > 0) j > query_offsets[r] + i - window; a query that sees no key gets zeros, and
/// so do row r's padding queries, past its first key_ends[r] - query_offsets[r]. query
/// (b, h, n, hd), keys and values (b, g, m, hd[_v]) -> (b, h, n, hd_v) laid out as
/// (b, n, h, hd_v). Refuses what ragged_loop_nest_fits refuses.
torch::Tensor ragged_loop_nest_attention(const torch::Tensor& query, const torch::Tensor& keys,
                                         const torch::Tensor& values, const RaggedRows& rows);

/// Attention that falls apart into independent dense blocks, FlashAttention's variable-length
/// form: segment i is queries [q_begin, q_end) of row `batch` against its keys [k_begin,
/// k_end), causal (query q_begin + t sees keys up to k_begin + t) or not; a query in no
/// segment sees no key.
struct VarlenSegment {
  int64_t batch, q_begin, q_end, k_begin, k_end;
};
struct VarlenLayout {
  std::vector<VarlenSegment> segments;
  bool causal = false;
  bool documents = false;  // each segment a document: its queries are its keys
};

/// `mask` on `batch` rows of n queries and m keys as segments, when it is key padding whose
/// valid keys are a prefix of each row, or documents(ids) whose every document is one run of
/// tokens in its row, either alone or & causal() (offset 0, no window); else nullopt.
std::optional<VarlenLayout> varlen_layout(const Mask& mask, int64_t batch, int64_t n, int64_t m);

/// The segments' tokens packed as FlashAttention's varlen kernels take them: queries
/// (total_q, h, hd), keys (total_k, g, hd), values (total_k, g, hd_v), segment i at rows
/// [cu_q[i], cu_q[i + 1]) and [cu_k[i], cu_k[i + 1]); query_index (total_q) is each packed
/// query's row in the (b * n) tokens, for unpacking, undefined where the segments take every
/// query in order (then the packed queries are a view or a copy of the inputs, no gather; the
/// keys likewise). The offsets are on the host and, as int64 tensors, on the inputs' device
/// too (for FlashAttention's cu_seqlens): the indices and the offsets reach the device in one
/// copy.
struct PackedVarlen {
  torch::Tensor query, key, value, query_index;
  std::vector<int64_t> cu_q, cu_k;
  torch::Tensor cu_q_on_device, cu_k_on_device;
};

/// Packs (b, h, n, hd) queries and (b, g, m, hd) keys and values by `layout`.
PackedVarlen pack_varlen(const torch::Tensor& query, const torch::Tensor& key,
                         const torch::Tensor& value, const VarlenLayout& layout);

/// A packed (total_q, h, hd_v) result back to (b, h, n, hd_v) by query_index (undefined: the
/// rows are every query in order); queries in no segment get zeros. Differentiable.
torch::Tensor unpack_varlen(const torch::Tensor& packed, const torch::Tensor& query_index,
                            int64_t batch, int64_t n);

/// Attention by `layout` on LibTorch's SDPA, one dense call per segment on the packed tokens
/// (LibTorch 2.x; the CPU's stand-in for FlashAttention's varlen kernel), default scale,
/// dropout_p (0: none); a segment without keys gives zeros.
torch::Tensor sdpa_varlen_attention(const torch::Tensor& query, const torch::Tensor& key,
                                    const torch::Tensor& value, const VarlenLayout& layout,
                                    double dropout_p);

/// `layout` as FlashAttention runs it, whose causal masks align each segment's last query with
/// its last key (bottom-right), where the layout's align its first ones: a causal segment's
/// square part stays causal, and its queries past its last key, which see every key, form a
/// non-causal part. Segments without queries or keys are left out (their queries get zeros).
/// One or two layouts, none empty; none where no segment has both.
std::vector<VarlenLayout> bottom_right_parts(const VarlenLayout& layout);

/// One part's attention: its packed segments, causal bottom-right or not ->
/// (total_q, h, hd_v).
using VarlenPartKernel = std::function<torch::Tensor(const PackedVarlen&, bool causal)>;

/// Attention by `layout` through its bottom_right_parts, each packed and run by `run_part`,
/// the results unpacked together (queries in no part get zeros); differentiable.
torch::Tensor run_bottom_right_parts(const torch::Tensor& query, const torch::Tensor& key,
                                     const torch::Tensor& value, const VarlenLayout& layout,
                                     const VarlenPartKernel& run_part);

/// Attention by `layout` on LibTorch's flash kernel (flash_attention): run_bottom_right_parts,
/// one flash call per part; `scale` on the scores.
torch::Tensor flash_varlen_attention(const torch::Tensor& query, const torch::Tensor& key,
                                     const torch::Tensor& value, const VarlenLayout& layout,
                                     double scale, double dropout_p);

/// Whether this LibTorch has its own scaled_dot_product_attention (2.0 and later).
bool libtorch_has_sdpa();

/// Whether LibTorch's FlashAttention-2 kernel (a CUDA build, 2.6 and later, a GPU of sm80 or
/// later) runs on `device`: probed once per GPU.
bool flash_kernel_available(const torch::Device& device);

/// Variable-length segments as FlashAttention takes them: int32 offsets (segments + 1) on the
/// inputs' device and the longest segment; cu_q undefined: the batched form.
struct FlashSegments {
  torch::Tensor cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
};

/// LibTorch's flash kernel with autograd, in the inputs' 16-bit dtype (it keeps its
/// statistics and accumulators in float32), dropout drawn on the device. Batched: (b, h, n,
/// hd) queries and (b, g, m, hd) keys and values -> (b, h, n, hd); with segments: packed
/// (total_q, h, hd) and (total_k, g, hd) -> (total_q, h, hd). The span's causal mask and
/// window align the last query with the last key of each segment (bottom-right; its query
/// offset is not read); window > 0: each query sees itself and the window - 1 keys before it.
/// `scale` on the scores. Checks are the caller's (flash_kernel_available, g dividing h, hd a
/// multiple of 8 up to 256, equal hd for values).
torch::Tensor flash_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const FlashSegments& segments,
                              const FusedArguments& arguments, double scale);

/// LibTorch's autocast on this thread for one device type: whether it is on, and its dtype.
struct AutocastState {
  bool enabled = false;
  torch::ScalarType dtype = torch::kFloat;
};

/// The autocast state for `device_type` (kCPU and kCUDA; any other type: off).
AutocastState autocast_state(c10::DeviceType device_type);

/// Sets the autocast state for `device_type` (kCPU or kCUDA).
void set_autocast_state(c10::DeviceType device_type, const AutocastState& state);

/// LibTorch's SDPA on (b, h, n, hd) queries and (b, g, m, hd) keys and values, g dividing h,
/// scale 1/sqrt(hd), with the arguments' causal span and dropout. On LibTorch 1.13, its
/// stand-in: the chunked kernel on the CPU, the math core elsewhere. Any device and floating
/// dtype; checks are the caller's.
torch::Tensor sdpa_attention(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value, const FusedArguments& arguments);

/// LibTorch's SDPA with a dense bool mask `visible` ((b or 1, h or 1, n, m), true = may
/// attend; undefined: every key) and a float `bias` added to the scaled scores (broadcastable
/// to (b, h, n, m); undefined: none; its gradient flows) on (b, h, n, hd) queries and
/// (b, g, m, hd) keys and values, g dividing h, scale 1/sqrt(hd), dropout_p (0: none); a
/// query that sees no key gets zeros. LibTorch 2.x (on 1.13 the math core stands in). Checks
/// are the caller's.
torch::Tensor sdpa_masked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                    const torch::Tensor& value, const torch::Tensor& visible,
                                    const torch::Tensor& bias, double dropout_p);

/// The math core's dropout of the attention weights: the op behind Python's nn.Dropout, so
/// a seed draws the book's masks.
torch::Tensor attention_dropout(const torch::Tensor& weights, double dropout_p, bool training);

/// Tensors with requires_grad that `score_mod` reads (leaves of the graph it builds on a
/// probe score), which the chunked kernel hands gradients to.
std::vector<torch::Tensor> score_mod_parameters(const ScoreMod& score_mod,
                                                const torch::TensorOptions& options);

/// score_mod on a tile (..., rows, cols) with its index tensors; checks the result.
torch::Tensor apply_score_mod(const ScoreMod& score_mod, const torch::Tensor& scores,
                              const std::vector<torch::Tensor>& index);

}  // namespace attnkit::detail

namespace attnkit::functional {

/// The checks of every attention call's arguments (attention.cpp), naming `fn` in their
/// messages: defined tensors of one rank, dtype and device, heads that group, the options'
/// ranges, and the mask against the problem.
void check_attention_arguments(const torch::Tensor& query, const torch::Tensor& key,
                               const torch::Tensor& value, const AttentionOptions& options,
                               const char* fn = "[attention]");

/// Merges a part's (out, lse) into a running (out, log_weight) in place, each side weighted by
/// exp(its lse - their logaddexp): the attention over both parts' keys. log_weight is -inf
/// where no key has been seen yet (and becomes the merged lse); a part's lse is +inf for a
/// row that saw no key, which then takes nothing from it. `out` may be of a wider dtype than
/// the part's (16-bit parts merged in float32).
void merge_into(torch::Tensor& out, torch::Tensor& log_weight, const AttentionWithLse& part);

}  // namespace attnkit::functional
