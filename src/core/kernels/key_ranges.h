#pragma once

// The fused tile kernel's backward split along the keys (fused_tiles.cpp). Backward's tasks
// each own their keys' gradients (dK, dV); one task per (batch, key/value head) left a second
// core idle where those are fewer than the workers (b 1 with one key/value head: 1.23x at 2
// threads), and four equal tasks per worker balanced badly on cores of unequal speed. So, when
// there are too few of them, each (batch, key/value head) is split into key ranges of about
// equal work, a task each; and into more (smaller tasks, less waiting for the last one) where
// the further ranges start where no query block's keys cross, as between documents. A query
// block seen from several ranges gets its dQ from each: the first range that sees it writes
// the gradient, every later one its own slot, and the slots are added in range order after
// the tasks (the same inputs and thread count give the same gradients).

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/kernels/tile_walk.h"

namespace attnkit::detail {

// A tile cut to one key range: `part`, what the range computes, within `whole`, the tile
// the walk made (dropout draws a tile's factors whole, as forward did).
struct RangeVisit {
  TileVisit part;
  TileVisit whole;
};

class KeyRanges {
 public:
  KeyRanges() = default;  // one range: every key
  // starts: each range's first key, ascending from 0.
  explicit KeyRanges(std::vector<int64_t> starts) : starts_(std::move(starts)) {}

  int64_t count() const { return static_cast<int64_t>(starts_.size()); }
  int64_t begin(int64_t r) const { return starts_[static_cast<size_t>(r)]; }
  // One past range r's last key, for num_keys keys.
  int64_t end(int64_t r, int64_t num_keys) const {
    return r + 1 < count() ? starts_[static_cast<size_t>(r + 1)] : num_keys;
  }
  // The range of `key`.
  int64_t of(int64_t key) const {
    return static_cast<int64_t>(std::upper_bound(starts_.begin(), starts_.end(), key) -
                                starts_.begin()) -
           1;
  }

  // The tiles of `tiles` (in key order) that fall in range r, cut at its ends.
  std::vector<RangeVisit> part(const std::vector<TileVisit>& tiles, int64_t r,
                               int64_t num_keys) const {
    std::vector<RangeVisit> parts;
    const int64_t low = begin(r), high = end(r, num_keys);
    for (const auto& tile : tiles) {
      const int64_t first = std::max(tile.key_begin, low);
      const int64_t last = std::min(tile.key_begin + tile.keys, high);
      if (first < last)
        parts.push_back({{first, last - first, tile.kind}, tile});
    }
    return parts;
  }

 private:
  std::vector<int64_t> starts_{0};
};

// How backward splits its tasks, and where each query block's dQ goes. "Lists" are the
// (batch, query head, query block) triples in that order, (o * heads + h) * blocks + qi.
struct BackwardSplit {
  KeyRanges ranges;
  // Per list: the first range that sees it (it writes dQ); empty with one range (range 0).
  std::vector<int64_t> owner;
  // Per list and range: the first of its slot's rows (query_block each), or -1 where the
  // range owns the list or does not see it; empty with one range.
  std::vector<int64_t> slot_row;
  int64_t slot_rows = 0;

  int64_t owner_of(int64_t list) const {
    return owner.empty() ? 0 : owner[static_cast<size_t>(list)];
  }
  int64_t slot_of(int64_t list, int64_t r) const {
    return slot_row.empty() ? -1 : slot_row[static_cast<size_t>(list * ranges.count() + r)];
  }
};

// Backward's split for `wanted` ranges at most: range starts on multiples of `unit` keys
// (the block mask's key block, where tiles may be cut), each range about an equal share of
// the rows the tiles hold; fewer ranges (halving) while the dQ slots would take more rows
// than `slot_budget_rows`, and more (doubling, up to `most_free`) while they take no more
// slots than that split. tiles_of(list) gives a list's tiles in key order.
BackwardSplit split_keys(int64_t wanted, int64_t most_free, int64_t unit, int64_t num_keys,
                         int64_t lists, int64_t query_block,
                         const std::function<std::vector<TileVisit>(int64_t)>& tiles_of,
                         int64_t slot_budget_rows);

}  // namespace attnkit::detail
