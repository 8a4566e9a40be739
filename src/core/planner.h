#pragma once

// The planner: every attention call of the library, from functional::attention and from the
// modules (training, prefill, a cached decode step, a ragged step, MLA's absorbed decode),
// is described as an AttentionCall and handed to run_attention, which picks the kernel from
// one table (planner.cpp) and runs it. Callers describe; they never choose.
//
// The table is in MLX's style: fast paths first, each with a predicate that names what it
// lacks, and one fallback that runs everything (the math core).

#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"

namespace attnkit::detail {

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
  /// kRagged: query i of row r sits at key position query_offsets[r] + i and sees keys
  /// before key_ends[r] ((b) int64 tensors), within `window` positions (0: no window).
  torch::Tensor query_offsets, key_ends;
  int64_t window = 0;
  /// The (b, n, 3 * h * hd) projection that query, key and value are the head views of, when
  /// they are (self-attention without a transform between the projection and attention).
  torch::Tensor packed_qkv;
};

/// The kernels, in the order the planner tries them.
enum class Kernel {
  kDecode,          // one query per row against a cache, read in place (CPU)
  kRaggedLoopNest,  // a ragged multi-token step in one loop nest (CPU, small)
  kPackedLoopNest,  // the loop nest on a packed QKV projection (CPU, small, LibTorch 1.x)
  kLoopNest,        // the loop nest on split heads (CPU, small, LibTorch 1.x)
  kFlash,           // LibTorch's flash kernel: windows, segments (CUDA, 16-bit, 2.6+)
  kSdpa,            // LibTorch's SDPA (its stand-in on 1.13)
  kSdpaVarlen,      // key padding or packed documents as dense segments on SDPA (2.x)
  kSdpaMasked,      // LibTorch's SDPA with the call's mask made dense (2.x)
  kChunked,         // tiles from a block mask, online softmax: every mask and score_mod
  kMath,            // the dense math core: everything, and the weights
};

/// A kernel as the planner sees it: which backend it serves and what it cannot run.
struct KernelSpec {
  Kernel kernel;
  /// "decode", "ragged_loop_nest", "packed_loop_nest", "loop_nest", "flash", "sdpa", "sdpa_varlen",
  /// "sdpa_masked", "chunked", "math".
  const char* name;
  /// The backend whose choice it serves; kAuto: every backend (the inference kernels).
  AttentionBackend backend;
  /// What it lacks to run `call` ("" when it can).
  std::string (*lacks)(const AttentionCall& call);
};

/// Every kernel, fast paths first, the math core (which lacks nothing) last.
const std::vector<KernelSpec>& kernel_table();

/// The kernel run_attention runs for `call` (for a 16-bit call computed in float32, the kernel
/// of its float32 copy). A demanded backend that cannot run the call is a
/// c10::Error that names the backend and what it lacks; a preferred one gives way to the
/// first kernel of the table that can.
const KernelSpec& plan_attention(const AttentionCall& call);

/// Plans and runs `call` -> context (b, h, n, hd_v) and, with `with_weights`, the weights, in
/// the inputs' dtype. bfloat16 and float16 are computed in float32 (scores, softmax
/// statistics, accumulators, gradients) and rounded once, except where LibTorch's CUDA SDPA
/// runs the call (its kernels accumulate in float32). Under LibTorch's autocast the inputs
/// are first cast to the autocast dtype (attention_dtype), and the kernels run with autocast
/// off.
functional::AttentionOutput run_attention(const AttentionCall& call);

/// The dtype a query, key or value runs attention in: under LibTorch's autocast for its
/// device, the autocast dtype (float64 keeps its own, as PyTorch's autocast leaves it); else
/// its own.
torch::ScalarType attention_dtype(const torch::Tensor& tensor);

/// functional::attention's checks of the call's inputs and options (defined with them, in
/// attention.cpp), then run_attention: the modules' entry.
functional::AttentionOutput run_checked_attention(const AttentionCall& call);

/// Why `backend` cannot run `call` ("" when one of its kernels can, or for kAuto): what its
/// most general kernel lacks.
std::string backend_lacks(AttentionBackend backend, const AttentionCall& call);

/// Test hook for the planner's mutation test: while one is alive, `kernel` claims every call
/// (its predicate says it lacks nothing). Not thread-safe; tests only.
class KernelClaimsEverything {
 public:
  explicit KernelClaimsEverything(Kernel kernel);
  ~KernelClaimsEverything();
  KernelClaimsEverything(const KernelClaimsEverything&) = delete;
  KernelClaimsEverything& operator=(const KernelClaimsEverything&) = delete;
};

}  // namespace attnkit::detail
