#pragma once

/// The KV cache of a multi-head attention layer: the keys and values of the tokens it has
/// seen, kept so that each new token costs one query against them instead of recomputing
/// the whole sequence.
///
/// The caller owns the cache, not the module (the book's bonus code keeps it inside the
/// module): one cache per attention layer and per group of sequences decoded together, so a
/// module can serve several generations at once, a cache can be dropped or reset without
/// touching the model, and its memory is visible (`nbytes`). The storage is allocated once,
/// at its capacity; appending writes in place and never reallocates or concatenates.

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace attnkit {

/// Keys and values (batch, num_heads, capacity, head_dim) of `size()` positions; or, made by
/// `sliding_window`, a rolling buffer of the last window_size positions; or, made by
/// `latent`, the compressed (batch, capacity, latent_dim) latents of multi-head latent
/// attention, from which keys and values are recomputed.
/// Example:
/// ```
/// auto cache = mha->make_kv_cache(/*batch=*/1);       // capacity: context_length
/// auto out = mha->forward_with_cache(prompt, cache);   // prefill: (1, n, d_out)
/// auto next = mha->forward_with_cache(token, cache);   // decode: (1, 1, d_out)
/// ```
class KVCache {
 public:
  /// No storage (capacity 0); holds nothing until a real cache is assigned.
  KVCache() = default;
  /// Storage for `capacity` positions of `batch` sequences, allocated now (zeros).
  KVCache(int64_t batch, int64_t num_heads, int64_t head_dim, int64_t capacity,
          const torch::TensorOptions& options = {});

  /// A rolling cache for sliding-window attention: storage for `window_size` positions, each
  /// new position overwriting the oldest, so it never holds more than window_size positions
  /// however many are appended (size() keeps counting them).
  static KVCache sliding_window(int64_t batch, int64_t num_heads, int64_t head_dim,
                                int64_t window_size, const torch::TensorOptions& options = {});

  /// A latent cache for multi-head latent attention: one (batch, capacity, latent_dim)
  /// tensor, appended with `append_latent`.
  static KVCache latent(int64_t batch, int64_t latent_dim, int64_t capacity,
                        const torch::TensorOptions& options = {});

  // Move-only: a copy would share the storage but not the position, and the two would
  // overwrite each other's keys.
  KVCache(KVCache&&) = default;
  KVCache& operator=(KVCache&&) = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// Positions appended since construction or reset(): the position of the next token. After
  /// a ragged append (rows of different lengths), the longest row's.
  int64_t size() const { return size_; }
  /// Each row's positions, (batch) int64 on the CPU: all size() until a ragged append.
  torch::Tensor lengths() const;
  /// Whether the rows hold different numbers of positions.
  bool is_ragged() const { return !row_lengths_.empty(); }
  /// Positions the storage holds at most.
  int64_t capacity() const { return keys_.defined() ? keys_.size(2) : 0; }
  /// Positions held now: size(), or for a rolling cache at most its window.
  int64_t held() const { return std::min(size_, capacity()); }
  /// Most positions that can be appended in all: capacity(), unbounded for a rolling cache.
  int64_t max_positions() const;
  /// The window of a rolling cache (0 for the others).
  int64_t window_size() const { return window_size_; }
  /// Whether this is a latent cache.
  bool is_latent() const { return keys_.defined() && !values_.defined(); }
  int64_t batch() const { return keys_.defined() ? keys_.size(0) : 0; }
  /// Key/value heads (1 for a latent cache).
  int64_t num_heads() const { return keys_.defined() ? keys_.size(1) : 0; }
  /// Width of a key or value head, or of a latent.
  int64_t head_dim() const { return keys_.defined() ? keys_.size(3) : 0; }
  /// Bytes of the storage at full capacity: for keys and values
  /// 2 * batch * num_heads * capacity * head_dim * element size; for latents
  /// batch * capacity * latent_dim * element size.
  int64_t nbytes() const;
  /// Bytes per position and sequence: nbytes() / (batch * capacity).
  int64_t bytes_per_token() const;
  /// The storage's dtype and device.
  torch::TensorOptions options() const;

  /// Forgets every position (the storage is kept): the next append starts a new sequence.
  void reset() {
    size_ = 0;
    row_lengths_.clear();
  }

  /// Keeps the rows `rows` (distinct, ascending, each in [0, batch())) in that order and drops
  /// the others: batch() becomes rows.size(). The kept rows move to the front of the same
  /// storage (nothing is allocated), so a batch whose sequences finish early stops paying for
  /// them. Rows of equal lengths make the cache uniform again (is_ragged() false).
  /// Example: `cache.keep_rows({0, 2});  // rows 0 and 2 become rows 0 and 1`
  void keep_rows(const std::vector<int64_t>& rows);

  /// Forgets every position of the rows `rows` (each in [0, batch())), keeping the others:
  /// the next append_ragged starts those rows over at position 0. The cache becomes ragged
  /// unless every row is reset (then it is reset()).
  void reset_rows(const std::vector<int64_t>& rows);

  /// What the queries of appended tokens attend to.
  struct Span {
    /// (batch, num_heads, m, head_dim) keys and values, m >= the tokens appended.
    torch::Tensor keys, values;
    /// The key index of the first appended token's own key: query i of the appended tokens
    /// sits at key position query_offset + i (see functional::causal_mask).
    int64_t query_offset;
  };

  /// Writes `keys` and `values` (batch, num_heads, n, head_dim) at positions
  /// [size(), size() + n) and returns what their queries attend to: every position held, in
  /// order, with query_offset = size() before the call. A rolling cache returns the positions
  /// it held plus the new ones in order, then keeps the last window_size; its one-token steps
  /// return the positions held in storage order (read in place, which a query that sees all
  /// of them does not mind), or with `position_order` in order (a copy, for a mask or score
  /// function that reads positions), with query_offset = held() - 1. Outside autograd:
  /// nothing appended records history. Fails (c10::Error) when the shapes, dtype or device
  /// differ from the cache's, on a latent cache, or when size() + n > max_positions();
  /// nothing is written then.
  Span append(const torch::Tensor& keys, const torch::Tensor& values, bool position_order = false);

  /// What the queries of a ragged append attend to: keys and values (batch, num_heads, m,
  /// head_dim), and per row (batch, int64, on the storage's device) the key index of its first
  /// new token and the end of its valid keys. In a key/value or latent cache key index j is
  /// position j (m: the longest row's length). A rolling cache lays each row out on its own:
  /// the positions it held, oldest first, then its new ones (m: the longest such row).
  struct RaggedSpan {
    torch::Tensor keys, values;
    torch::Tensor starts, ends;
  };

  /// Appends a right-padded batch: row r writes its first new_lengths[r] tokens of `keys` and
  /// `values` (batch, num_heads, n, head_dim) at positions [lengths()[r], lengths()[r] +
  /// new_lengths[r]); padding is not written. `new_lengths` has batch entries in [0, n].
  /// Query i of row r sits at key index starts[r] + i and may see keys j < ends[r] with
  /// j <= starts[r] + i (and, with a rolling cache, j > starts[r] + i - window_size()).
  /// A rolling cache keeps each row's last window_size positions. Fails like append, and
  /// when a row would pass the capacity; nothing is written then.
  RaggedSpan append_ragged(const torch::Tensor& keys, const torch::Tensor& values,
                           const std::vector<int64_t>& new_lengths);

  /// A latent cache's append_ragged: row r writes its first new_lengths[r] latents of
  /// `latents` (batch, n, latent_dim). The span's keys are the latents (batch, m, latent_dim),
  /// its values undefined.
  RaggedSpan append_latent_ragged(const torch::Tensor& latents,
                                  const std::vector<int64_t>& new_lengths);

  /// A latent cache's append: writes `latents` (batch, n, latent_dim) at positions
  /// [size(), size() + n) and returns every latent held, (batch, size(), latent_dim). Fails
  /// like append, and on a cache that is not a latent cache.
  torch::Tensor append_latent(const torch::Tensor& latents);

  /// (batch, num_heads, held(), head_dim) views of the keys and values held, in storage order
  /// (a rolling cache that has wrapped around starts at its oldest slot elsewhere). A latent
  /// cache has keys() (batch, 1, held(), latent_dim) and no values().
  torch::Tensor keys() const;
  torch::Tensor values() const;

 private:
  // Checks `t` (batch, heads, n, width) against the storage, and with check_room that n more
  // positions fit; `what` names it.
  void check_appended(const char* fn, const char* what, const torch::Tensor& t,
                      bool check_room = true) const;
  // append_latent's and append_latent_ragged's checks of `latents` (b, n, latent_dim), which
  // come back as (b, 1, n, latent_dim); `key_value_append` names the call for a key/value cache.
  torch::Tensor latents_as_heads(const char* fn, const char* key_value_append,
                                 const torch::Tensor& latents, bool check_room = true) const;
  // append_ragged and append_latent_ragged after their own checks; `values` undefined for
  // latents.
  RaggedSpan write_ragged(const char* fn, const torch::Tensor& keys, const torch::Tensor& values,
                          const std::vector<int64_t>& new_lengths);

  torch::Tensor keys_;    // (batch, num_heads, capacity, head_dim); latents: (batch, 1, ., .)
  torch::Tensor values_;  // (batch, num_heads, capacity, head_dim); latents: undefined
  int64_t size_ = 0;
  int64_t window_size_ = 0;
  std::vector<int64_t> row_lengths_;  // per row after a ragged append; empty while uniform
};

}  // namespace attnkit
