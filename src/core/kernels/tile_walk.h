#pragma once

// The walk over a block mask's tiles that every tiled CPU kernel takes, forward and backward
// alike (chunked.cpp, fused_tiles.cpp): for one query block of some heads, the key tiles to
// compute, each full (nothing to mask) or partial (its mask entries evaluated); empty blocks
// are skipped. "heads" here are query heads of one (batch, head range) slice.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attnkit/block_mask.h"
#include "attnkit/mask.h"
#include "core/base/attention_layout.h"

namespace attnkit::detail {

// A key tile: keys [key_begin, key_begin + keys) and its TileKind.
struct TileVisit {
  int64_t key_begin;
  int64_t keys;
  TileKind kind;
};

// The key tiles that query block qi of query heads [h0, h0 + heads) of batch o visits, at most
// key_block wide (never narrower than one kv block): without a block mask every key, in full
// tiles; with one, its non-empty key blocks (full for the heads when full for each), adjacent
// ones taken together. With merge_partial, a partial block joins its neighbours (the tile is
// then partial): fewer, wider tiles, for a kernel with a fixed cost per tile. Without it,
// only full blocks join, so a kernel evaluates mask entries where some are false, only.
inline std::vector<TileVisit> key_tiles(const BlockMask& blocks, int64_t o, int64_t h0,
                                        int64_t heads, int64_t qi, int64_t num_keys,
                                        int64_t key_block, bool merge_partial) {
  std::vector<TileVisit> tiles;
  if (!blocks.defined()) {
    for (int64_t k0 = 0; k0 < num_keys; k0 += key_block)
      tiles.push_back({k0, std::min(key_block, num_keys - k0), TileKind::kFull});
    return tiles;
  }
  const int64_t kb = blocks.kv_block_size();
  const int64_t widest = std::max<int64_t>(key_block / kb, 1) * kb;
  for (int64_t j = 0; j < blocks.num_kv_blocks(); ++j) {
    TileKind kind = blocks.kind(o, h0, qi, j);
    for (int64_t h = h0 + 1; h < h0 + heads && kind != TileKind::kPartial; ++h) {
      if (blocks.kind(o, h, qi, j) != kind)
        kind = TileKind::kPartial;
    }
    if (kind == TileKind::kEmpty)
      continue;
    const int64_t k0 = j * kb, bk = std::min(kb, num_keys - k0);
    auto* last = tiles.empty() ? nullptr : &tiles.back();
    const bool joins = last != nullptr && last->key_begin + last->keys == k0 &&
                       last->keys + bk <= widest &&
                       (merge_partial || (kind == TileKind::kFull && last->kind == kind));
    if (joins) {
      last->keys += bk;
      if (kind != last->kind)
        last->kind = TileKind::kPartial;
    } else {
      tiles.push_back({k0, bk, kind});
    }
  }
  return tiles;
}

// The block mask a tiled kernel walks for `mask` on `query` (any rank, (..., heads, n, f)):
// the mask's own when it is one, none for no mask, else one judged at block_size on
// `device` for the (outer, heads) slices the kernel's tiles see.
inline BlockMask tile_block_mask(const Mask& mask, const torch::Tensor& query, int64_t num_keys,
                                 int64_t block_size, const torch::Device& device) {
  if (const auto* given = mask.block_mask())
    return *given;  // its shape was checked with the mask's
  if (mask.is_none())
    return {};
  const auto q4 = as_outer_heads(query);
  return create_block_mask(mask, q4.size(0), q4.size(1), q4.size(2), num_keys,
                           BlockMaskOptions().block_size(block_size).device(device));
}

}  // namespace attnkit::detail
