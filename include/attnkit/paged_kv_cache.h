#pragma once

/// A paged KV cache: the keys and values of many sequences in fixed-size pages of one pool,
/// allocated once, as serving engines keep them (vLLM's block tables, FlashInfer's paged
/// caches). A sequence holds only the pages its positions fill, not a capacity reserved for
/// the longest; sequences that share a prefix share its pages (`fork`), copied on the first
/// write that would change a shared page; a finished sequence's pages return to the pool
/// (`release`), and a sliding window's old ones too (`drop_before`). A pool of latents
/// (`PagedKVCache::latents`) holds multi-head latent attention's cache the same way.
///
/// The storage is apart from what the kernels read: `view(sequences)` is a `PagedKV`
/// (paged_attention.h), a page table over the pool, which `paged_attention` reads in
/// place.
///
/// Nothing here is durable: the pool lives in memory, and a process that ends loses it.

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "attnkit/paged_attention.h"

namespace attnkit {

/// A pool of num_pages pages, each page_size positions of num_heads keys and values of
/// head_dim, and the sequences that hold them.
/// Example:
/// ```
/// attnkit::PagedKVCache cache(/*num_pages=*/256, /*page_size=*/16, /*num_heads=*/4, 64);
/// const auto prompt = cache.add_sequence();
/// cache.append(prompt, keys, values);                 // (4, n, 64) each
/// const auto a = cache.fork(prompt), b = cache.fork(prompt);  // share the prompt's pages
/// cache.release(prompt);
/// cache.append(a, k_a, v_a);                           // copies a shared, partly filled page
/// auto context = attnkit::paged_attention(query, cache.view({a, b}));
/// ```
class PagedKVCache {
 public:
  /// The pool, allocated now (zeros): 2 * num_pages * num_heads * page_size * head_dim
  /// elements, each page followed by a cache line (64 bytes) that keeps pages from sharing
  /// cache sets. Fails when it would take more than attnkit::memory_budget().
  PagedKVCache(int64_t num_pages, int64_t page_size, int64_t num_heads, int64_t head_dim,
               const torch::TensorOptions& options = {});

  /// A pool of latents (multi-head latent attention's cache, DeepSeek V2/V3): num_pages pages
  /// of page_size positions of one latent_dim-wide latent each, which the kernels read as both
  /// key and value: value_pages() is key_pages(), and the pool takes half the bytes of a
  /// key/value pool of one head of latent_dim. Append with append(sequence, latents).
  static PagedKVCache latents(int64_t num_pages, int64_t page_size, int64_t latent_dim,
                              const torch::TensorOptions& options = {});

  /// Pages of page_size positions of num_heads keys and values of head_dim, in `dtype`, that
  /// fit in `bytes` (at least 1 page's worth, else it fails): the num_pages of a pool bounded
  /// by a budget. With `latents`, pages of a pool of latents (num_heads 1, head_dim its width).
  static int64_t pages_within(int64_t bytes, int64_t page_size, int64_t num_heads, int64_t head_dim,
                              torch::Dtype dtype, bool latents = false);

  // Move-only: a copy would share the pool but not the bookkeeping.
  PagedKVCache(PagedKVCache&&) = default;
  PagedKVCache& operator=(PagedKVCache&&) = default;
  PagedKVCache(const PagedKVCache&) = delete;
  PagedKVCache& operator=(const PagedKVCache&) = delete;

  /// A new empty sequence; returns its id.
  int64_t add_sequence();
  /// A new sequence holding `parent`'s positions, sharing its pages (nothing is copied until
  /// one of the two appends into a shared page); returns its id.
  int64_t fork(int64_t parent);
  /// Ends `sequence`: its pages that no other sequence holds return to the pool, and the id
  /// is refused from now on.
  void release(int64_t sequence);
  /// Frees the pages of `sequence` that hold only positions below `position` (a sliding
  /// window's that no query will see again); their page table entries become -1. The
  /// sequence's length is unchanged.
  void drop_before(int64_t sequence, int64_t position);

  /// Pages that `n` more positions of `sequence` take from the pool: new pages, and a copy of
  /// a shared, partly filled last page.
  int64_t pages_needed(int64_t sequence, int64_t n) const;
  /// Whether `n` more positions of `sequence` fit in the free pages now: a caller that would
  /// rather wait than fail asks before append.
  bool can_append(int64_t sequence, int64_t n) const;
  /// Appends keys and values (num_heads, n, head_dim) at `sequence`'s positions [length,
  /// length + n). Fails, writing nothing, when the free pages do not hold them (no page is
  /// ever overwritten), or on shapes, dtype or device other than the pool's.
  void append(int64_t sequence, const torch::Tensor& keys, const torch::Tensor& values);
  /// A pool of latents' append: latents (1, n, head_dim) at `sequence`'s positions, with the
  /// same checks.
  void append(int64_t sequence, const torch::Tensor& latents);

  /// Positions `sequence` holds.
  int64_t length(int64_t sequence) const;
  /// The kernels' view of `sequences` (rows in that order): the pool, a (rows, most pages)
  /// page table (-1 past a row's pages and at dropped ones) and the rows' lengths.
  PagedKV view(const std::vector<int64_t>& sequences) const;
  /// Refuses a view whose table reads a page that is free now (released, or never used):
  /// a view taken before a release. Names the row and the page.
  void check_view(const PagedKV& view) const;

  int64_t num_pages() const { return static_cast<int64_t>(references_.size()); }
  int64_t page_size() const { return page_size_; }
  int64_t num_heads() const { return keys_.size(1); }
  int64_t head_dim() const { return keys_.size(3); }
  /// Whether this is a pool of latents (PagedKVCache::latents).
  bool holds_latents() const { return values_.is_same(keys_); }
  /// Pages no sequence holds.
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  /// Sequences that hold `page` (0: free).
  int64_t references(int64_t page) const;
  /// Bytes of the whole pool, the pages' cache lines of padding included.
  int64_t nbytes() const;
  /// Bytes of the pages held now: (num_pages() - free_pages()) pages.
  int64_t held_bytes() const;
  /// The pool, (num_pages, num_heads, page_size, head_dim); in a pool of latents, one tensor.
  const torch::Tensor& key_pages() const { return keys_; }
  const torch::Tensor& value_pages() const { return values_; }

 private:
  struct Sequence {
    std::vector<int64_t> pages;  // -1 where drop_before freed one
    int64_t length = 0;
    bool live = true;
  };
  Sequence& sequence_at(const char* fn, int64_t sequence);
  const Sequence& sequence_at(const char* fn, int64_t sequence) const;
  int64_t pages_needed(const Sequence& s, int64_t n) const;
  int64_t take_page();
  void drop_reference(int64_t page);
  void write(const char* fn, int64_t sequence, const torch::Tensor& keys,
             const torch::Tensor& values);

  struct LatentsTag {};
  PagedKVCache(LatentsTag, int64_t num_pages, int64_t page_size, int64_t latent_dim,
               const torch::TensorOptions& options);
  void allocate(const char* fn, int64_t num_pages, int64_t num_heads, int64_t head_dim,
                const torch::TensorOptions& options, bool latents);

  // (num_pages, num_heads, page_size, head_dim); one tensor in a pool of latents
  torch::Tensor keys_, values_;
  int64_t page_size_ = 0;
  std::vector<int64_t> references_;  // per page
  std::vector<int64_t> free_;        // free pages, the next one taken last
  std::vector<Sequence> sequences_;  // by id
};

}  // namespace attnkit
