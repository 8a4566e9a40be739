#include "core/kernels/key_ranges.h"

namespace attnkit::detail {

namespace {

// Range starts for `count` ranges of about equal weight, at units of `unit` keys; fewer when
// the weight does not divide so (a range is never empty).
std::vector<int64_t> balanced_starts(const std::vector<int64_t>& weight, int64_t count,
                                     int64_t unit) {
  int64_t total = 0;
  for (const auto w : weight)
    total += w;
  std::vector<int64_t> starts{0};
  int64_t sum = 0;
  for (size_t u = 0; u + 1 < weight.size() && static_cast<int64_t>(starts.size()) < count; ++u) {
    sum += weight[u];
    // Range r starts where the weight before it first reaches r / count of the total.
    if (sum * count >= total * static_cast<int64_t>(starts.size()))
      starts.push_back(static_cast<int64_t>(u + 1) * unit);
  }
  return starts;
}

}  // namespace

BackwardSplit split_keys(int64_t wanted, int64_t most_free, int64_t unit, int64_t num_keys,
                         int64_t lists, int64_t query_block,
                         const std::function<std::vector<TileVisit>(int64_t)>& tiles_of,
                         int64_t slot_budget_rows) {
  const int64_t units = (num_keys + unit - 1) / unit;
  wanted = std::min(wanted, units);
  most_free = std::min(most_free, units);
  if (wanted <= 1 && most_free <= 1)
    return {};
  std::vector<std::vector<TileVisit>> tiles(static_cast<size_t>(lists));
  std::vector<int64_t> weight(static_cast<size_t>(units), 0);
  for (int64_t list = 0; list < lists; ++list) {
    tiles[static_cast<size_t>(list)] = tiles_of(list);
    for (const auto& tile : tiles[static_cast<size_t>(list)]) {
      for (int64_t u = tile.key_begin / unit; u * unit < tile.key_begin + tile.keys; ++u)
        weight[static_cast<size_t>(u)] += std::min(unit, num_keys - u * unit);
    }
  }
  if (std::all_of(weight.begin(), weight.end(), [](int64_t w) { return w == 0; }))
    return {};  // no tile: nothing to split
  // The split into about `count` ranges, with its dQ owners and slots.
  const auto split_into = [&](int64_t count) {
    BackwardSplit split{KeyRanges(balanced_starts(weight, count, unit)), {}, {}, 0};
    const int64_t ranges = split.ranges.count();
    if (ranges == 1)
      return split;
    split.owner.assign(static_cast<size_t>(lists), 0);
    split.slot_row.assign(static_cast<size_t>(lists * ranges), -1);
    for (int64_t list = 0; list < lists; ++list) {
      const auto& list_tiles = tiles[static_cast<size_t>(list)];
      if (list_tiles.empty())
        continue;
      const int64_t owner = split.ranges.of(list_tiles.front().key_begin);
      split.owner[static_cast<size_t>(list)] = owner;
      int64_t last_seen = owner;  // tiles in key order: each later range seen starts a slot
      for (const auto& tile : list_tiles) {
        const int64_t last = split.ranges.of(tile.key_begin + tile.keys - 1);
        for (int64_t r = std::max(last_seen + 1, split.ranges.of(tile.key_begin)); r <= last; ++r) {
          split.slot_row[static_cast<size_t>(list * ranges + r)] = split.slot_rows;
          split.slot_rows += query_block;
        }
        last_seen = std::max(last_seen, last);
      }
    }
    return split;
  };
  BackwardSplit split;  // one range
  for (int64_t count = wanted; count > 1; count /= 2) {
    auto candidate = split_into(count);
    if (candidate.ranges.count() == 1)
      break;
    if (candidate.slot_rows <= slot_budget_rows) {
      split = std::move(candidate);
      break;
    }
  }
  // More ranges while they cost no more slots (their starts fall where no query block's keys
  // cross, as between documents): smaller tasks, so less time where one worker waits for the
  // other's last task.
  for (int64_t count = split.ranges.count() * 2; count <= most_free; count *= 2) {
    auto finer = split_into(count);
    if (finer.ranges.count() <= split.ranges.count() || finer.slot_rows > split.slot_rows)
      break;
    split = std::move(finer);
  }
  return split;
}

}  // namespace attnkit::detail
