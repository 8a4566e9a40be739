#pragma once

/// `attnkit::Mask`: which keys each query may attend to, as one value type that every
/// attention path reads (docs/masks.md).
///
/// Convention: true = may attend, as in `F.scaled_dot_product_attention`'s bool `attn_mask`
/// and FlexAttention's `mask_mod` (the one exception is `key_padding`'s bool form, which
/// takes `nn.MultiheadAttention`'s `key_padding_mask`, where true = padding).
/// Indices: b is the batch, h the query head, q_idx the query's row and kv_idx the key's row.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace attnkit {

/// FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool`, called on broadcastable int64
/// index tensors covering a whole tile at once (b (B,1,1,1), h (1,H,1,1), q_idx (1,1,n,1),
/// kv_idx (1,1,1,m) or blocks of them). It returns a bool tensor broadcastable to their
/// broadcast shape, true where the query may attend to the key. It should be a pure function
/// of its arguments: `create_block_mask` calls it for several query blocks at once, from
/// LibTorch's worker threads on the CPU.
/// Example: `[](auto b, auto h, auto q, auto kv) { return kv <= q; }` (causal).
using MaskMod =
    std::function<torch::Tensor(const torch::Tensor& b, const torch::Tensor& h,
                                const torch::Tensor& q_idx, const torch::Tensor& kv_idx)>;

/// What a mask says about a tile (a block of queries against a block of keys).
enum class TileKind : int8_t {
  kEmpty = 0,    ///< no query of the tile sees any of its keys: skip it
  kPartial = 1,  ///< some do: the tile needs its dense rows
  kFull = 2,     ///< every query sees every key: nothing to mask
};

/// A tile of an attention problem: batch `batch`, query heads [head_begin, head_begin +
/// heads), queries [query_begin, query_begin + queries), keys [key_begin, key_begin + keys).
struct Tile {
  int64_t batch = 0;
  int64_t head_begin = 0;
  int64_t heads = 1;
  int64_t query_begin = 0;
  int64_t queries = 0;
  int64_t key_begin = 0;
  int64_t keys = 0;
};

/// A tile's verdict and, for a partial tile, which of its entries may attend: a bool
/// tensor broadcastable to (heads, queries, keys).
struct TileMask {
  TileKind kind;
  torch::Tensor allowed;
};

class BlockMask;

namespace detail {
struct MaskNode;
struct MaskAccess;  // the kernels' view of a mask's structure (src/core/masks/mask.cpp)
}  // namespace detail

/// Which keys each query may attend to. A default-constructed Mask masks nothing.
/// Masks combine with `&` (both allow) and `|` (either allows).
/// Example: `Mask::causal() & Mask::key_padding(lengths)`.
class Mask {
 public:
  /// Every query may attend to every key.
  Mask();

  /// Query i sits at key position query_offset + i and sees keys j <= query_offset + i:
  /// offset 0 aligns the mask top-left, m - n bottom-right (queries at the end of a longer
  /// key sequence, as a decode step against a KV cache). query_offset must be >= 0.
  /// Example: `Mask::causal()`; `Mask::causal(cache.size())`.
  static Mask causal(int64_t query_offset = 0);
  /// The same with one offset per batch entry: a (b) int64 tensor, each >= 0, on the
  /// attention's device; query i of entry r sits at key position query_offsets[r] + i (rows
  /// of a ragged batch, each at its own position in a KV cache).
  /// Example: `Mask::causal(cache.lengths()) & Mask::key_padding(ends)`.
  static Mask causal(const torch::Tensor& query_offsets);

  /// This causal mask restricted to a sliding window: query i also does not see keys more
  /// than window_size - 1 positions before it (0 <= query_offset + i - j < window_size).
  /// Only on a mask made by `causal` (or `documents(ids, true)`); window_size >= 1.
  /// Example: `Mask::causal().sliding_window(4096)`.
  Mask sliding_window(int64_t window_size) const;

  /// Padded key sequences: a (b, m) bool tensor with true = padding (the convention of
  /// `nn.MultiheadAttention`'s `key_padding_mask`), or a (b) int64 tensor of valid lengths,
  /// each in [0, m]: batch entry i sees keys j < lengths[i].
  /// Example: `Mask::key_padding(torch::tensor({5, 3}))`.
  static Mask key_padding(const torch::Tensor& padding_or_lengths);

  /// Packed sequences: document_ids (n) or (b, n), int64, give each token's document; a
  /// query sees only keys of its own document (and, with `causal`, not later ones). Needs
  /// self-attention: n queries, n keys.
  /// Example: `Mask::documents(torch::tensor({0, 0, 0, 1, 1}), /*causal=*/true)`.
  static Mask documents(const torch::Tensor& document_ids, bool causal = false);

  /// A bool tensor broadcastable to (b, h, n, m), true = may attend (the convention of
  /// `F.scaled_dot_product_attention`'s bool `attn_mask`).
  /// Example: `Mask::from_tensor(torch::ones({n, m}, torch::kBool).tril())`.
  static Mask from_tensor(const torch::Tensor& allowed);

  /// A mask from a `mask_mod`, called only on tiles, never element by element.
  /// Example: `Mask::from_function([](auto, auto, auto q, auto kv) { return kv <= q; })`.
  static Mask from_function(MaskMod mask_mod);

  /// The mask of a block mask (`create_block_mask`), carrying its verdicts: where a module
  /// takes a `Mask`, this passes one block mask to every layer. A call of the block mask's
  /// shape reads its block lists; a module's own causal mask `&` it is judged from them and
  /// the causal structure, so the inner mask is evaluated only on partial tiles.
  /// Example: `mha->forward(x, {}, {}, Mask::from_block_mask(bm))`.
  static Mask from_block_mask(const BlockMask& block_mask);

  /// This mask over a region of a problem of num_queries x num_keys: entry (i, j) of the
  /// result is entry (query_start + i, key_start + j) of this mask, so a call over a chunk of
  /// the queries and a chunk of the keys sees the whole problem's mask there (what each rank
  /// of a context-parallel call applies, attnkit/context_parallel.h). A call with the result
  /// checks that its n queries and m keys lie inside the problem, and this mask against the
  /// whole problem. Example: `Mask::documents(ids, true).region(512, 0, 1024, 1024)`.
  Mask region(int64_t query_start, int64_t key_start, int64_t num_queries, int64_t num_keys) const;

  /// Both masks allow.
  Mask operator&(const Mask& other) const;
  /// Either mask allows.
  Mask operator|(const Mask& other) const;

  /// Whether this mask lets every query see every key (a default-constructed Mask).
  bool is_none() const { return node_ == nullptr; }
  /// Whether this mask is exactly `causal(offset)` or `causal(offset).sliding_window(w)`;
  /// if so, the offset and the window (0: none) are written.
  bool is_causal(int64_t* query_offset = nullptr, int64_t* window_size = nullptr) const;
  /// The block mask this mask was made from by `from_block_mask`, else nullptr.
  const BlockMask* block_mask() const;
  /// A readable form: "causal(query_offset=0) & key_padding(lengths)".
  std::string to_string() const;

  /// Fails with a c10::Error naming `fn` unless this mask fits a problem of `batch`
  /// sequences, `heads` query heads, n queries and m keys on `device`.
  void check(const char* fn, int64_t batch, int64_t heads, int64_t num_queries, int64_t num_keys,
             const torch::Device& device) const;

  /// The mask_mod form: true where query q_idx of batch b and head h may attend to key
  /// kv_idx, for broadcastable int64 index tensors.
  torch::Tensor allowed(const torch::Tensor& b, const torch::Tensor& h, const torch::Tensor& q_idx,
                        const torch::Tensor& kv_idx) const;

  /// The dense form: a bool tensor (batch or 1, heads or 1, n, m) on `device`.
  torch::Tensor dense(int64_t batch, int64_t heads, int64_t num_queries, int64_t num_keys,
                      const torch::Device& device) const;

  /// The verdict on a tile, reached without evaluating it where the mask's structure allows
  /// (causal, sliding window, key padding, documents), and the dense rows of a partial tile.
  TileMask tile(const Tile& tile, const torch::Device& device) const;

  /// The verdict on a tile from the mask's structure alone, without evaluating any entry;
  /// nullopt where only its entries can tell (a tensor, a mask_mod). A structured kPartial
  /// may still be full or empty in an `&` or `|` of two masks.
  c10::optional<TileKind> structural_kind(const Tile& tile) const;

  /// Which entries of a tile may attend: a bool tensor broadcastable to (heads, queries,
  /// keys), evaluated on `device` with no verdict taken (no device synchronisation).
  torch::Tensor tile_allowed(const Tile& tile, const torch::Device& device) const;

 private:
  friend struct detail::MaskAccess;
  explicit Mask(std::shared_ptr<const detail::MaskNode> node) : node_(std::move(node)) {}
  std::shared_ptr<const detail::MaskNode> node_;
};

namespace functional {

/// Causal mask as a bool tensor of shape (num_queries, num_keys): `true` where a query would
/// see a later key. Query i sits at key position `query_offset + i` and sees keys
/// j <= query_offset + i: offset 0 aligns the mask top-left, as
/// `torch.triu(torch.ones(n, m), diagonal=1).bool()`; offset m - n aligns it bottom-right,
/// as queries at the end of a longer key sequence (a decode step against a KV cache) need.
/// With `window_size` W (sliding-window attention) query i also does not see keys more than
/// W - 1 positions before it: it sees keys j with 0 <= query_offset + i - j < W.
/// Example: `causal_mask(6, 6)`; `causal_mask(1, 10, torch::kCPU, 9)` masks nothing;
/// `causal_mask(6, 6, torch::kCPU, 0, 2)` lets each query see itself and its predecessor.
torch::Tensor causal_mask(int64_t num_queries, int64_t num_keys,
                          const torch::Device& device = torch::kCPU, int64_t query_offset = 0,
                          c10::optional<int64_t> window_size = c10::nullopt);

}  // namespace functional

}  // namespace attnkit
