#pragma once

// FlexAttention's block lists, as the operators take them, to attnkit's Mask (block_lists.cpp).

#include <torch/torch.h>

#include "attnkit/mask.h"

namespace attnkit::ops {

/// The operators' name in their errors.
inline constexpr const char* kOp = "[attnkit::flex_attention]";

/// The mask of block lists (FlexAttention's kv_num_blocks, kv_indices, full_kv_num_blocks,
/// full_kv_indices) and their partial tiles' bits on inputs q (B, H, n, hd) and k: none
/// without lists, Mask::causal() where they say causal (whatever the block sizes), else the
/// lists themselves. partial_tiles: bool (P, q_block_size, kv_block_size), a tile per partial
/// block the lists name in their order, or (B, H, nq, nk, q_block_size, kv_block_size), a
/// tile per slot of kv_indices (unused slots dropped). Checked, naming the argument.
Mask block_lists_mask(const torch::Tensor& q, const torch::Tensor& k,
                      const c10::optional<torch::Tensor>& kv_num_blocks,
                      const c10::optional<torch::Tensor>& kv_indices,
                      const c10::optional<torch::Tensor>& full_kv_num_blocks,
                      const c10::optional<torch::Tensor>& full_kv_indices,
                      const c10::optional<torch::Tensor>& partial_tiles, int64_t q_block_size,
                      int64_t kv_block_size);

}  // namespace attnkit::ops
