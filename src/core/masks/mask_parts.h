#pragma once

// A mask's structure, as the kernels that take structured masks read it: the parts of an
// `&` of masks (causal, key padding, documents), so that a kernel decides what it can run
// without knowing how mask.cpp represents a mask.

#include <optional>
#include <vector>

#include <torch/torch.h>

#include "attnkit/mask.h"

namespace attnkit::detail {

/// One part of a mask that is an `&` of parts.
struct MaskPart {
  enum class Kind { kCausal, kKeyPadding, kDocuments, kOther };
  Kind kind = Kind::kOther;
  /// kCausal: query i sits at key position `offset` + i (`per_row`: at a per-row offset
  /// instead); `window` 0: no sliding window.
  int64_t offset = 0;
  int64_t window = 0;
  bool per_row = false;
  /// kKeyPadding: per row, the number of valid keys when they are a prefix of the row's keys,
  /// else -1; `keys`: the width of the (B, m) boolean form, -1 for lengths (which fit any m).
  std::vector<int64_t> valid_prefix;
  int64_t keys = -1;
  /// kDocuments: the ids on the host, row-major, `id_rows` rows (0: one (n) row shared by
  /// every batch entry) of `id_length`. Valid while the mask lives.
  const int64_t* ids = nullptr;
  int64_t id_rows = 0;
  int64_t id_length = 0;
};

/// FlexAttention's partial tiles as a mask: `slots` (B or 1, H or 1, nq, nk) int64 name each
/// (q_block, kv_block) block's tile in `bits` (P, q_block, kv_block) bool, -1 for a full block
/// and -2 for an empty one. A kernel's tile that is one block of one head reads a view of its
/// bits (with `slots` on the host), any other tile is gathered entry by entry.
Mask packed_tiles_mask(const torch::Tensor& slots, const torch::Tensor& bits, int64_t q_block,
                       int64_t kv_block);

/// The parts of `mask` joined by `&`, one part for a mask that is no `&`; nullopt for no mask
/// or one with a `|`.
std::optional<std::vector<MaskPart>> and_parts(const Mask& mask);

}  // namespace attnkit::detail
