#pragma once

// A Mask's nodes (mask.cpp holds its kinds, packed_tiles_mask.cpp the Python operators' packed
// tiles): what every kind answers, and the kernels' access to a mask's root node.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "attnkit/mask.h"

namespace attnkit::detail {

// Index tensors of one problem or tile: b (B,1,1,1), h (1,H,1,1), q (1,1,n,1), kv (1,1,1,m).
struct Indices {
  torch::Tensor b, h, q, kv;
};

inline Indices tile_indices(const Tile& tile, const torch::Device& device) {
  const auto index = torch::dtype(torch::kInt64).device(device);
  return {
      torch::full({1, 1, 1, 1}, tile.batch, index),
      torch::arange(tile.head_begin, tile.head_begin + tile.heads, index).view({1, -1, 1, 1}),
      torch::arange(tile.query_begin, tile.query_begin + tile.queries, index).view({1, 1, -1, 1}),
      torch::arange(tile.key_begin, tile.key_begin + tile.keys, index).view({1, 1, 1, -1})};
}

// The queries and keys of the one problem a mask is made for (-1: it fits any count): a
// documents mask's ids, a block mask's lengths, a padding's or a tensor's size.
struct MaskExtent {
  int64_t queries = -1, keys = -1;
};

struct MaskNode {
  virtual ~MaskNode() = default;
  virtual MaskExtent extent() const { return {}; }
  virtual torch::Tensor allowed(const Indices& at) const = 0;
  // The verdict on a tile when the structure gives it; nullopt: evaluate the tile.
  virtual c10::optional<TileKind> kind(const Tile&) const { return c10::nullopt; }
  virtual void check(const char*, int64_t, int64_t, int64_t, int64_t, const torch::Device&) const {}
  virtual std::string to_string() const = 0;
  // A tile's entries, broadcastable to (1, heads, queries, keys); a kind that holds them
  // as tiles already returns a view.
  virtual torch::Tensor tile_allowed(const Tile& tile, const torch::Device& device) const {
    return allowed(tile_indices(tile, device));
  }
  // A one-head tile's entries as bools, row-major (queries, keys), into `out`, from host
  // copies and without LibTorch operations (the fused tile kernel asks for every partial tile
  // of every head: tens of microseconds each as tensor operations). false: this kind does
  // not (a tensor, a mask_mod); the caller evaluates the tile.
  virtual bool fill_tile(const Tile&, bool*) const { return false; }
};

/// The problem, queries x keys, that `mask` over a cached step's positions [0, positions) is
/// checked against and read in: those positions, or the mask's own extent where it is made
/// for more (a documents mask of the whole sequence's ids, a block mask of its length), as
/// training read it. An extent shorter than the positions fails the mask's check.
std::pair<int64_t, int64_t> positions_problem(const Mask& mask, int64_t positions);

/// `mask` read at positions of a longer sequence: entry (i, j) of batch entry r is `mask`'s
/// (query_starts[r] + i, key_starts[r] + j) of the problem positions_problem(mask,
/// num_positions) (one start: every entry), as a cached step reads a mask over its sequences'
/// positions. A mask of no kind stays one. `ragged`: rows end before the call's last query and key
/// (their padding), and entries past the problem read its last query's or key's.
Mask mask_at_positions(const Mask& mask, std::vector<int64_t> query_starts,
                       std::vector<int64_t> key_starts, int64_t num_positions, bool ragged = false);

/// `mask`'s fill_tile (a mask of no kind allows everything).
bool fill_tile(const Mask& mask, const Tile& tile, bool* out);

struct MaskAccess {
  static const MaskNode* node(const Mask& mask) { return mask.node_.get(); }
  static std::shared_ptr<const MaskNode> node_pointer(const Mask& mask) { return mask.node_; }
  static Mask make(std::shared_ptr<const MaskNode> node) { return Mask(std::move(node)); }
};

}  // namespace attnkit::detail
