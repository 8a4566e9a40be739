#pragma once

// The kinds of attnkit::Mask (mask.cpp builds trees of them). Every kind answers two
// questions: which entries it allows (the mask_mod form, on broadcastable index tensors), and
// what it says about a whole tile without evaluating it where its structure allows (what
// create_block_mask asks first). A new kind of mask is one class here.

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/block_mask.h"
#include "attnkit/mask.h"
#include "core/base/checks.h"
#include "core/masks/mask_node.h"

namespace attnkit::detail {

inline void check_device(const char* fn, const char* what, const torch::Tensor& t,
                         const torch::Device& device) {
  TORCH_CHECK(t.device() == device, fn, " mask: ", what, " is on ", t.device(),
              " but the attention runs on ", device);
}

// Query i sits at key position offset + i (or offsets[b] + i, one offset per batch entry);
// it sees keys j <= that position and, with a window W > 0, only those with
// position - j < W.
struct CausalNode final : MaskNode {
  int64_t offset, window;
  torch::Tensor offsets;             // (B) int64 per-row offsets, or undefined
  std::vector<int64_t> offsets_cpu;  // their host copy, for the tiles' verdicts
  CausalNode(int64_t offset, int64_t window) : offset(offset), window(window) {}
  CausalNode(const CausalNode& other, int64_t window) : CausalNode(other) { this->window = window; }

  bool per_row() const { return offsets.defined(); }
  int64_t offset_of(int64_t batch) const { return per_row() ? offsets_cpu[batch] : offset; }
  torch::Tensor allowed(const Indices& at) const override {
    const auto position = per_row() ? at.q + offsets.index({at.b}) : at.q + offset;
    auto ok = at.kv <= position;
    if (window > 0)
      ok = ok.logical_and(position - at.kv < window);
    return ok;
  }
  bool fill_tile(const Tile& t, bool* out) const override {
    for (int64_t i = 0; i < t.queries; ++i) {
      // Row i allows the keys in [position - window + 1, position]: [lo, hi) of the tile.
      const int64_t position = offset_of(t.batch) + t.query_begin + i - t.key_begin;
      const int64_t hi = std::clamp<int64_t>(position + 1, 0, t.keys);
      // (position < window: from key 0; position - window + 1 would overflow for a window
      // near INT64_MAX)
      const int64_t lo =
          window > 0 && position >= window ? std::min<int64_t>(position - window + 1, hi) : 0;
      bool* row = out + i * t.keys;
      std::fill(row, row + lo, false);
      std::fill(row + lo, row + hi, true);
      std::fill(row + hi, row + t.keys, false);
    }
    return true;
  }
  c10::optional<TileKind> kind(const Tile& t) const override {
    const int64_t first = offset_of(t.batch) + t.query_begin, last = first + t.queries - 1;
    const int64_t k0 = t.key_begin, k1 = t.key_begin + t.keys - 1;
    if (k0 > last || (window > 0 && first - k1 >= window))
      return TileKind::kEmpty;
    if (k1 <= first && (window == 0 || last - k0 < window))
      return TileKind::kFull;
    return TileKind::kPartial;
  }
  void check(const char* fn, int64_t batch, int64_t, int64_t num_queries, int64_t,
             const torch::Device& device) const override {
    if (per_row()) {
      TORCH_CHECK(offsets.size(0) == batch, fn, " mask: causal query_offsets must have shape (",
                  batch, ") (the batch), got ", shape_string(offsets));
      check_device(fn, "causal query_offsets", offsets, device);
    }
    // Query i's position, offset + i, is an int64: the last one must fit (past it, the sum
    // wrapped, and every query saw no key).
    const int64_t largest = per_row() && !offsets_cpu.empty()
                                ? *std::max_element(offsets_cpu.begin(), offsets_cpu.end())
                                : offset;
    const int64_t bound = std::numeric_limits<int64_t>::max() - std::max<int64_t>(num_queries, 1);
    TORCH_CHECK(largest <= bound, fn, " mask: causal query_offset", per_row() ? "s" : "",
                " must be at most INT64_MAX - ", std::max<int64_t>(num_queries, 1), " = ", bound,
                " (the last query's key position must fit in int64), got ", largest);
  }
  std::string to_string() const override {
    const auto causal = per_row() ? std::string("causal(query_offsets per row)")
                                  : c10::str("causal(query_offset=", offset, ")");
    return window > 0 ? c10::str(causal, ".sliding_window(", window, ")") : causal;
  }
};

// Key padding: batch entry b sees keys j < lengths[b], or those whose padding entry is
// false. Host copies (the lengths, or prefix sums of valid keys per batch entry) make a
// tile's verdict a lookup.
struct KeyPaddingNode final : MaskNode {
  torch::Tensor lengths;  // (B) int64, or undefined
  torch::Tensor padding;  // (B, m) bool, true = padding, or undefined
  std::string form;

  torch::Tensor allowed(const Indices& at) const override {
    if (lengths.defined())
      return at.kv < lengths.index({at.b});
    return padding.index({at.b, at.kv}).logical_not();
  }
  bool fill_tile(const Tile& t, bool* out) const override {
    for (int64_t j = 0; j < t.keys; ++j) {
      const int64_t key = t.key_begin + j;
      if (lengths.defined()) {
        out[j] = key < lengths_cpu[t.batch];
      } else {
        const auto* row = counts_cpu.data() + t.batch * (padding.size(1) + 1);
        out[j] = row[key + 1] > row[key];
      }
    }
    for (int64_t i = 1; i < t.queries; ++i)  // every query of a row sees the same keys
      std::memcpy(out + i * t.keys, out, t.keys * sizeof(bool));
    return true;
  }
  c10::optional<TileKind> kind(const Tile& t) const override {
    int64_t valid;
    if (lengths.defined()) {
      const int64_t length = lengths_cpu[t.batch];
      valid = std::clamp<int64_t>(length - t.key_begin, 0, t.keys);
    } else {
      const auto* row = counts_cpu.data() + t.batch * (padding.size(1) + 1);
      valid = row[t.key_begin + t.keys] - row[t.key_begin];
    }
    return valid == 0 ? TileKind::kEmpty : valid == t.keys ? TileKind::kFull : TileKind::kPartial;
  }
  void check(const char* fn, int64_t batch, int64_t, int64_t, int64_t m,
             const torch::Device& device) const override {
    if (lengths.defined()) {
      TORCH_CHECK(lengths.size(0) == batch, fn, " mask: key_padding lengths must have shape (",
                  batch, ") (the batch), got ", shape_string(lengths));
      const int64_t longest =
          lengths_cpu.empty() ? 0 : *std::max_element(lengths_cpu.begin(), lengths_cpu.end());
      TORCH_CHECK(longest <= m, fn, " mask: key_padding lengths must be in [0, ", m,
                  "] (the number of keys), got a length of ", longest);
      check_device(fn, "key_padding lengths", lengths, device);
    } else {
      TORCH_CHECK(padding.size(0) == batch && padding.size(1) == m, fn,
                  " mask: key_padding must have shape (batch, num_keys) = (", batch, ", ", m,
                  "), got ", shape_string(padding));
      check_device(fn, "key_padding", padding, device);
    }
  }
  MaskExtent extent() const override { return {-1, padding.defined() ? padding.size(1) : -1}; }
  std::string to_string() const override { return c10::str("key_padding(", form, ")"); }

  std::vector<int64_t> lengths_cpu;  // lengths form
  std::vector<int64_t> counts_cpu;   // padding form: (B, m + 1) prefix sums of valid keys
};

// Packed sequences: token t belongs to document ids[t] (or ids[b, t]); queries see keys of
// their own document. A host copy of the ids gives a block's smallest and largest id.
struct DocumentsNode final : MaskNode {
  torch::Tensor ids;          // (n) or (B, n) int64
  std::vector<int64_t> host;  // ids on the CPU, row-major

  torch::Tensor allowed(const Indices& at) const override {
    if (ids.dim() == 1)
      return ids.index({at.q}) == ids.index({at.kv});
    return ids.index({at.b, at.q}) == ids.index({at.b, at.kv});
  }
  bool fill_tile(const Tile& t, bool* out) const override {
    const auto* row = host.data() + (ids.dim() == 1 ? 0 : t.batch * ids.size(-1));
    for (int64_t i = 0; i < t.queries; ++i) {
      const int64_t document = row[t.query_begin + i];
      for (int64_t j = 0; j < t.keys; ++j)
        out[i * t.keys + j] = row[t.key_begin + j] == document;
    }
    return true;
  }
  std::pair<int64_t, int64_t> id_range(int64_t batch, int64_t begin, int64_t count) const {
    const int64_t n = ids.size(-1);
    const auto* row = host.data() + (ids.dim() == 1 ? 0 : batch * n);
    const auto [lo, hi] = std::minmax_element(row + begin, row + begin + count);
    return {*lo, *hi};
  }
  c10::optional<TileKind> kind(const Tile& t) const override {
    const auto [q_lo, q_hi] = id_range(t.batch, t.query_begin, t.queries);
    const auto [k_lo, k_hi] = id_range(t.batch, t.key_begin, t.keys);
    if (q_hi < k_lo || k_hi < q_lo)
      return TileKind::kEmpty;  // no id in common
    if (q_lo == q_hi && k_lo == k_hi)
      return TileKind::kFull;  // one document on both sides (the same: the ranges meet)
    return TileKind::kPartial;
  }
  void check(const char* fn, int64_t batch, int64_t, int64_t n, int64_t m,
             const torch::Device& device) const override {
    TORCH_CHECK(n == m, fn, " mask: documents needs self-attention (as many queries as keys), got ",
                n, " queries and ", m, " keys");
    TORCH_CHECK(ids.size(-1) == n && (ids.dim() == 1 || ids.size(0) == batch), fn,
                " mask: document_ids must have shape (", n, ") or (", batch, ", ", n, "), got ",
                shape_string(ids));
    check_device(fn, "document_ids", ids, device);
  }
  MaskExtent extent() const override { return {ids.size(-1), ids.size(-1)}; }
  std::string to_string() const override { return "documents"; }
};

// A dense bool tensor broadcastable to (B, H, n, m), viewed as 4-D.
struct TensorNode final : MaskNode {
  torch::Tensor allowed4;

  torch::Tensor allowed(const Indices& at) const override {
    // A broadcast dimension (size 1) is read at index 0 whatever the index asks.
    const auto pick = [&](int64_t dim, const torch::Tensor& index) {
      return allowed4.size(dim) == 1 ? torch::zeros_like(index) : index;
    };
    return allowed4.index({pick(0, at.b), pick(1, at.h), pick(2, at.q), pick(3, at.kv)});
  }
  void check(const char* fn, int64_t batch, int64_t heads, int64_t n, int64_t m,
             const torch::Device& device) const override {
    const std::vector<int64_t> shape{batch, heads, n, m};
    bool fits = true;
    for (int64_t d = 0; d < 4; ++d)
      fits = fits && (allowed4.size(d) == 1 || allowed4.size(d) == shape[d]);
    TORCH_CHECK(fits, fn, " mask: the allowed tensor must broadcast to (batch, heads, ",
                "num_queries, num_keys) = (", batch, ", ", heads, ", ", n, ", ", m, "), got ",
                shape_string(allowed4), " (as 4-D)");
    check_device(fn, "the allowed tensor", allowed4, device);
  }
  MaskExtent extent() const override {
    return {allowed4.size(2) == 1 ? -1 : allowed4.size(2),
            allowed4.size(3) == 1 ? -1 : allowed4.size(3)};
  }
  std::string to_string() const override { return "from_tensor"; }
};

struct FunctionNode final : MaskNode {
  MaskMod mask_mod;

  torch::Tensor allowed(const Indices& at) const override {
    auto result = mask_mod(at.b, at.h, at.q, at.kv);
    TORCH_CHECK(result.defined() && result.scalar_type() == torch::kBool,
                "[attention] mask_mod must return a bool tensor, got ",
                result.defined() ? c10::toString(result.scalar_type()) : "an undefined tensor");
    const std::vector<int64_t> shape{at.b.size(0), at.h.size(1), at.q.size(2), at.kv.size(3)};
    bool fits = result.dim() <= 4;
    for (int64_t d = 0; fits && d < result.dim(); ++d) {
      const int64_t size = result.size(result.dim() - 1 - d);
      fits = size == 1 || size == shape[3 - d];
    }
    TORCH_CHECK(fits, "[attention] mask_mod must return a tensor broadcastable to (", shape[0],
                ", ", shape[1], ", ", shape[2], ", ", shape[3],
                ") (the broadcast shape of its index arguments), got ", shape_string(result));
    return result;
  }
  std::string to_string() const override { return "from_function"; }
};

// A block mask's mask: its entries are the inner mask's; a tile that is one of its blocks
// takes the block's verdict from the host lists (combined over the tile's heads), any other
// tile the inner mask's structure.
struct BlockMaskNode final : MaskNode {
  BlockMask blocks;

  explicit BlockMaskNode(BlockMask blocks) : blocks(std::move(blocks)) {}

  torch::Tensor allowed(const Indices& at) const override {
    return blocks.mask().allowed(at.b, at.h, at.q, at.kv);
  }
  torch::Tensor tile_allowed(const Tile& tile, const torch::Device& device) const override {
    return blocks.mask().tile_allowed(tile, device).unsqueeze(0);
  }
  bool fill_tile(const Tile& tile, bool* out) const override {
    return detail::fill_tile(blocks.mask(), tile, out);
  }
  // A tile of whole blocks (the last, short one included) combines their verdicts over its
  // heads; any other tile takes the inner mask's structure.
  c10::optional<TileKind> kind(const Tile& t) const override {
    const int64_t qb = blocks.q_block_size(), kb = blocks.kv_block_size();
    const int64_t q_end = t.query_begin + t.queries, k_end = t.key_begin + t.keys;
    const bool whole_blocks = t.queries > 0 && t.keys > 0 && t.query_begin % qb == 0 &&
                              t.key_begin % kb == 0 && q_end <= blocks.q_len() &&
                              k_end <= blocks.kv_len() &&
                              (q_end % qb == 0 || q_end == blocks.q_len()) &&
                              (k_end % kb == 0 || k_end == blocks.kv_len());
    if (!whole_blocks)
      return blocks.mask().structural_kind(t);
    c10::optional<TileKind> combined;
    for (int64_t h = t.head_begin; h < t.head_begin + t.heads; ++h) {
      for (int64_t i = t.query_begin / qb; i < (q_end + qb - 1) / qb; ++i) {
        for (int64_t j = t.key_begin / kb; j < (k_end + kb - 1) / kb; ++j) {
          const TileKind kind = blocks.kind(t.batch, h, i, j);
          if (combined.has_value() && *combined != kind)
            return TileKind::kPartial;
          combined = kind;
        }
      }
    }
    return combined;
  }
  void check(const char* fn, int64_t batch, int64_t heads, int64_t n, int64_t m,
             const torch::Device& device) const override {
    blocks.check(fn, batch, heads, n, m, device);
  }
  MaskExtent extent() const override { return {blocks.q_len(), blocks.kv_len()}; }
  std::string to_string() const override {
    return c10::str("block_mask(", blocks.mask().to_string(), ")");
  }
};

// The inner mask over a region of a larger problem: entry (i, j) of batch entry r is the
// inner mask's (query_starts[r] + i, key_starts[r] + j); one start serves every entry.
// `clamped` (a ragged cached step, whose rows end before the call's last query and key):
// entries past the problem read its last query's or key's, since the call masks them anyway.
struct RegionNode final : MaskNode {
  std::shared_ptr<const MaskNode> inner;
  std::vector<int64_t> query_starts, key_starts;  // one entry, or one per batch entry
  int64_t num_queries, num_keys;
  bool clamped;

  RegionNode(std::shared_ptr<const MaskNode> inner, std::vector<int64_t> query_starts,
             std::vector<int64_t> key_starts, int64_t num_queries, int64_t num_keys,
             bool clamped = false)
      : inner(std::move(inner)),
        query_starts(std::move(query_starts)),
        key_starts(std::move(key_starts)),
        num_queries(num_queries),
        num_keys(num_keys),
        clamped(clamped) {}

  static int64_t start_of(const std::vector<int64_t>& starts, int64_t batch) {
    return starts.size() == 1 ? starts.front() : starts[static_cast<size_t>(batch)];
  }
  // The starts read at batch indices `b` (broadcastable int64).
  static torch::Tensor starts_at(const std::vector<int64_t>& starts, const torch::Tensor& b) {
    if (starts.size() == 1)
      return torch::tensor(starts.front(), b.options());
    return torch::tensor(starts, torch::kInt64).to(b.device()).index({b});
  }
  Tile shifted(Tile tile) const {
    tile.query_begin += start_of(query_starts, tile.batch);
    tile.key_begin += start_of(key_starts, tile.batch);
    return tile;
  }
  // Whether the tile, shifted, lies inside the problem (always, unless clamped).
  bool inside(const Tile& tile) const {
    const auto t = shifted(tile);
    return !clamped ||
           (t.query_begin + t.queries <= num_queries && t.key_begin + t.keys <= num_keys);
  }
  torch::Tensor allowed(const Indices& at) const override {
    auto q = at.q + starts_at(query_starts, at.b), kv = at.kv + starts_at(key_starts, at.b);
    if (clamped) {
      q = q.clamp_max(num_queries - 1);
      kv = kv.clamp_max(num_keys - 1);
    }
    return inner->allowed({at.b, at.h, q, kv});
  }
  torch::Tensor tile_allowed(const Tile& tile, const torch::Device& device) const override {
    return inside(tile) ? inner->tile_allowed(shifted(tile), device)
                        : allowed(tile_indices(tile, device));
  }
  bool fill_tile(const Tile& tile, bool* out) const override {
    return inside(tile) && inner->fill_tile(shifted(tile), out);
  }
  c10::optional<TileKind> kind(const Tile& t) const override {
    return inside(t) ? inner->kind(shifted(t)) : c10::nullopt;
  }
  void check(const char* fn, int64_t batch, int64_t heads, int64_t n, int64_t m,
             const torch::Device& device) const override {
    TORCH_CHECK(query_starts.size() == 1 || static_cast<int64_t>(query_starts.size()) == batch, fn,
                " mask: a region with a start per batch entry (", query_starts.size(),
                ") over a batch of ", batch);
    for (int64_t r = 0; r < static_cast<int64_t>(query_starts.size()); ++r) {
      const int64_t query_start = query_starts[static_cast<size_t>(r)];
      const int64_t key_start = start_of(key_starts, r);
      // Clamped: the starts inside the problem, or at its end (a row with no new token).
      const int64_t queries = clamped ? 0 : n, keys = clamped ? 0 : m;
      TORCH_CHECK(query_start + queries <= num_queries && key_start + keys <= num_keys, fn,
                  " mask: a region from query ", query_start, " and key ", key_start, " of a ",
                  num_queries, " x ", num_keys, " problem holds at most ",
                  num_queries - query_start, " queries and ", num_keys - key_start, " keys, got ",
                  n, " queries and ", m, " keys");
    }
    inner->check(fn, batch, heads, num_queries, num_keys, device);
  }
  std::string to_string() const override {
    if (query_starts.size() == 1) {
      return c10::str(inner->to_string(), ".region(", query_starts.front(), ", ",
                      key_starts.front(), ", ", num_queries, ", ", num_keys, ")");
    }
    return c10::str(inner->to_string(),
                    ".region(query_starts=", c10::ArrayRef<int64_t>(query_starts),
                    ", key_starts=", c10::ArrayRef<int64_t>(key_starts), ", ", num_queries, ", ",
                    num_keys, ")");
  }
};

// Both children allow (is_and) or either does.
struct CombinedNode final : MaskNode {
  std::shared_ptr<const MaskNode> left, right;
  bool is_and;

  CombinedNode(std::shared_ptr<const MaskNode> left, std::shared_ptr<const MaskNode> right,
               bool is_and)
      : left(std::move(left)), right(std::move(right)), is_and(is_and) {}

  torch::Tensor allowed(const Indices& at) const override {
    const auto a = left->allowed(at), b = right->allowed(at);
    return is_and ? a.logical_and(b) : a.logical_or(b);
  }
  bool fill_tile(const Tile& t, bool* out) const override {
    const size_t count = static_cast<size_t>(t.queries * t.keys);
    std::unique_ptr<bool[]> other(new bool[count]);
    if (!left->fill_tile(t, out) || !right->fill_tile(t, other.get()))
      return false;
    for (size_t e = 0; e < count; ++e)
      out[e] = is_and ? (out[e] && other[e]) : (out[e] || other[e]);
    return true;
  }
  c10::optional<TileKind> kind(const Tile& t) const override {
    const auto a = left->kind(t), b = right->kind(t);
    // The side that settles the tile alone: an empty one for &, a full one for |.
    const TileKind settles = is_and ? TileKind::kEmpty : TileKind::kFull;
    if (a == settles || b == settles)
      return settles;
    if (!a.has_value() || !b.has_value())
      return c10::nullopt;
    // Neither settles it: both are the neutral kind (the result), or one is partial.
    return *a == *b ? *a : TileKind::kPartial;
  }
  void check(const char* fn, int64_t batch, int64_t heads, int64_t n, int64_t m,
             const torch::Device& device) const override {
    left->check(fn, batch, heads, n, m, device);
    right->check(fn, batch, heads, n, m, device);
  }
  // Both sides are checked against one problem: a fixed count of either is its count.
  MaskExtent extent() const override {
    const auto a = left->extent(), b = right->extent();
    return {a.queries >= 0 ? a.queries : b.queries, a.keys >= 0 ? a.keys : b.keys};
  }
  std::string to_string() const override {
    return c10::str("(", left->to_string(), is_and ? " & " : " | ", right->to_string(), ")");
  }
};

}  // namespace attnkit::detail
