#pragma once

// Attention that falls apart into dense segments, FlashAttention's variable-length form
// (varlen_kernel.cpp): the layout read from a mask, packing, and SDPA or flash per part.

#include <functional>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "attnkit/mask.h"
#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec sdpa_varlen_spec();

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

}  // namespace attnkit::detail
