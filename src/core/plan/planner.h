#pragma once

// The planner: every attention call of the library, from functional::attention and from the
// modules (training, prefill, a cached decode step, a ragged step, MLA's absorbed decode),
// is described as an AttentionCall and handed to run_attention, which asks the kernels of one
// table (kernel_table(), fast paths first) in turn and runs the first that takes the call.
// Callers describe; they never choose. Each kernel's spec (kernel_spec.h) sits beside its code;
// this is only the walk, the 16-bit and autocast policy, and the kernel record.

#include <string>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

/// Every kernel, fast paths first, the math core (which takes every call) last.
const KernelTable& kernel_table();

/// The kernel run_attention runs for `call` (for a 16-bit call computed in float32, the kernel
/// of its float32 copy). A demanded backend that cannot run the call is a c10::Error that
/// names the backend and what it lacks; a preferred one gives way to the first kernel of the
/// table that takes the call.
const KernelSpec& plan_attention(const AttentionCall& call,
                                 const KernelTable& table = kernel_table());

/// Plans and runs `call` -> context (b, h, n, hd_v) and, with `with_weights`, the weights, in
/// the inputs' dtype. bfloat16 and float16 are computed in float32 (scores, softmax
/// statistics, accumulators, gradients) and rounded once, except where the kernel's spec runs
/// them in their own dtype (LibTorch's CUDA kernels accumulate in float32). Under LibTorch's
/// autocast the inputs are first cast to the autocast dtype (attention_dtype), and the kernels
/// run with autocast off. `table`: the kernels to walk (tests pass mutants).
functional::AttentionOutput run_attention(const AttentionCall& call,
                                          const KernelTable& table = kernel_table());

/// A split call's forward (call.split): the output (b, h, n, hd_v) in the inputs' dtype and
/// the rows' log-sum-exp (b, h, n) in the compute dtype (float32 for 16-bit inputs), +inf for
/// a row that sees no key; `kernel` is the kernel that ran it. The dtype, autocast and kernel
/// record policy is run_attention's. `unrounded`: for 16-bit inputs the output before its
/// rounding (float32), which the backward's D = rowsum(dO * O) wants; else undefined.
/// `row_max`: for a call that wants it (AttentionCall::wants_row_max), SplitOutputs::row_max.
struct SplitForward {
  torch::Tensor out, lse;
  const char* kernel;
  torch::Tensor unrounded;
  torch::Tensor row_max;
};
SplitForward run_split_forward(const AttentionCall& call,
                               const KernelTable& table = kernel_table());

/// "" when a kernel of `table` runs `call` (a split call) as a split call, else why not.
std::string split_call_lacks(const AttentionCall& call, const KernelTable& table = kernel_table());

/// A split call's backward from its forward's output and lse (saved.parameters: the tensors
/// the call's score function reads that want gradients): the gradients of query, key, value
/// and then of each parameter, each in its tensor's dtype. The planner makes the same choice
/// as for the forward of the same call.
std::vector<torch::Tensor> run_split_backward(const AttentionCall& call, const SplitSaved& saved,
                                              const KernelTable& table = kernel_table());

/// The dtype a query, key or value runs attention in: under LibTorch's autocast for its
/// device, the autocast dtype (float64 keeps its own, as PyTorch's autocast leaves it); else
/// its own.
torch::ScalarType attention_dtype(const torch::Tensor& tensor);

/// functional::attention's checks of the call's inputs and options (defined with them, in
/// attention.cpp), then run_attention: the modules' entry.
functional::AttentionOutput run_checked_attention(const AttentionCall& call);

/// Why `backend` cannot run `call` ("" when one of its kernels can, or for kAuto): what its
/// most general kernel (the last of the table that serves it) lacks.
std::string backend_lacks(AttentionBackend backend, const AttentionCall& call,
                          const KernelTable& table = kernel_table());

}  // namespace attnkit::detail
