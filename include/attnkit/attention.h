#pragma once

/// The one attention core's entry points: `attnkit::functional::attention(q, k, v,
/// AttentionOptions)`, with a mask (`attnkit::Mask`), a score function (FlexAttention's
/// `score_mod`), a scale, dropout and a backend (docs/masks.md). Every attnkit module hands its
/// attention here. The types they take and return: attnkit/attention_types.h; ready-made score
/// functions: attnkit/score_mods.h; which kernel ran: attnkit/kernel_record.h; whether the CPU
/// multiplies float16 (cpu_multiplies_float16): attnkit/autocast.h; causal_mask: attnkit/mask.h.

#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "attnkit/autocast.h"
#include "attnkit/kernel_record.h"
#include "attnkit/score_mods.h"

namespace attnkit::functional {

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

}  // namespace attnkit::functional
