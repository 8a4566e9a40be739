// The partial tiles of a FlexAttention block mask as attnkit's Python operators receive them
// (mask_parts.h's packed_tiles_mask), as a Mask node.

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "core/masks/mask_node.h"
#include "core/masks/mask_parts.h"

namespace attnkit::detail {

// FlexAttention's partial tiles as the Python operators pass them: slots (B or 1, H or 1, nq,
// nk) int64 name each block's tile in bits (P, q_block, kv_block), -1 for a full block, -2
// for an empty one. A tile that is one block (of one head) is a view of its bits.
struct PackedTilesNode final : MaskNode {
  torch::Tensor slots, bits;
  int64_t q_block, kv_block;

  torch::Tensor allowed(const Indices& at) const override {
    const auto device = bits.device();
    const auto b = (slots.size(0) == 1 ? torch::zeros_like(at.b) : at.b).to(device);
    const auto h = (slots.size(1) == 1 ? torch::zeros_like(at.h) : at.h).to(device);
    const auto q = at.q.to(device), kv = at.kv.to(device);
    const auto slot =
        slots.to(device).index({b, h, q.div(q_block, "floor"), kv.div(kv_block, "floor")});
    const auto partial =
        bits.index({slot.clamp_min(0), q.remainder(q_block), kv.remainder(kv_block)});
    return slot.eq(-1).logical_or(slot.ge(0).logical_and(partial));
  }
  torch::Tensor tile_allowed(const Tile& t, const torch::Device& device) const override {
    const bool one_block = slots.is_cpu() && bits.device() == device && t.heads == 1 &&
                           t.query_begin % q_block == 0 && t.key_begin % kv_block == 0 &&
                           t.queries <= q_block && t.keys <= kv_block;
    if (!one_block)
      return allowed(tile_indices(t, device));
    const int64_t slot =
        slots[slots.size(0) == 1 ? 0 : t.batch][slots.size(1) == 1 ? 0 : t.head_begin]
             [t.query_begin / q_block][t.key_begin / kv_block]
                 .item<int64_t>();
    const auto options = torch::dtype(torch::kBool).device(device);
    if (slot < 0)  // -1: a full block, -2: an empty one
      return torch::full({1, 1, 1, 1}, slot == -1, options);
    // (q_block, kv_block) -> (1, 1, queries, keys)
    return bits[slot].narrow(0, 0, t.queries).narrow(1, 0, t.keys).view({1, 1, t.queries, -1});
  }
  bool fill_tile(const Tile& t, bool* out) const override {
    const bool one_block = slots.is_cpu() && slots.is_contiguous() && bits.is_cpu() &&
                           bits.is_contiguous() && t.heads == 1 && t.query_begin % q_block == 0 &&
                           t.key_begin % kv_block == 0 && t.queries <= q_block &&
                           t.keys <= kv_block;
    if (!one_block)
      return false;
    const int64_t nq = slots.size(2), nk = slots.size(3);
    const int64_t b = slots.size(0) == 1 ? 0 : t.batch, h = slots.size(1) == 1 ? 0 : t.head_begin;
    const int64_t slot =
        slots.data_ptr<int64_t>()[((b * slots.size(1) + h) * nq + t.query_begin / q_block) * nk +
                                  t.key_begin / kv_block];
    if (slot < 0) {  // -1: a full block, -2: an empty one
      std::fill(out, out + t.queries * t.keys, slot == -1);
      return true;
    }
    const bool* tile = bits.data_ptr<bool>() + slot * q_block * kv_block;
    for (int64_t i = 0; i < t.queries; ++i)
      std::memcpy(out + i * t.keys, tile + i * kv_block, t.keys * sizeof(bool));
    return true;
  }
  std::string to_string() const override { return "packed_tiles"; }
};

Mask packed_tiles_mask(const torch::Tensor& slots, const torch::Tensor& bits, int64_t q_block,
                       int64_t kv_block) {
  auto node = std::make_shared<PackedTilesNode>();
  node->slots = slots, node->bits = bits, node->q_block = q_block, node->kv_block = kv_block;
  return MaskAccess::make(std::move(node));
}

}  // namespace attnkit::detail
