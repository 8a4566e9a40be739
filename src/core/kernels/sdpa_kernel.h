#pragma once

// LibTorch's own attention kernels (sdpa_kernel.cpp, which holds every LibTorch-version split
// but brgemm's): SDPA, SDPA with a dense mask, and the flash kernel.

#include <torch/torch.h>

#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec flash_spec();
KernelSpec sdpa_spec();
KernelSpec sdpa_masked_spec();

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

}  // namespace attnkit::detail
