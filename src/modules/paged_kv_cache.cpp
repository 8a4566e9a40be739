#include "attnkit/paged_kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "core/base/checks.h"

namespace attnkit {

namespace {

// Bytes between two pages of the keys (or values): the page and a cache line (pool_storage).
int64_t page_stride_bytes(int64_t page_size, int64_t num_heads, int64_t head_dim, int64_t element) {
  return page_size * num_heads * head_dim * element + 64;
}

// A page's keys and values, or its latents (one tensor).
int64_t page_bytes(int64_t page_size, int64_t num_heads, int64_t head_dim, int64_t element,
                   bool latents) {
  return (latents ? 1 : 2) * page_stride_bytes(page_size, num_heads, head_dim, element);
}

// Zeros (num_pages, num_heads, page_size, head_dim) with pages one cache line further apart
// than their size, in memory that the kernel may back with 2 MiB pages.
// - The gap: a head's run of a page (page_size * head_dim elements, 8 KB at 16 positions of
//   128 floats) sits a power of two of bytes from the next page's, so the runs of one head
//   fell into the same cache sets and evicted each other: the query heads of a grouped-query
//   group, which read the same runs one after another, then found them gone, and a decode
//   step on 16-position pages took about 1.6-1.8x the contiguous cache's time.
// - The huge pages (transparent huge pages, asked for before the first touch; Linux's default
//   "madvise" mode gives them to those who ask): with 4 KiB pages each run also costs a page
//   walk, its entry rarely cached since runs lie anywhere in the pool.
torch::Tensor pool_storage(int64_t num_pages, int64_t num_heads, int64_t page_size,
                           int64_t head_dim, const torch::TensorOptions& options) {
  const auto element =
      static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  const int64_t stride = page_stride_bytes(page_size, num_heads, head_dim, element) / element;
  auto storage = torch::empty({num_pages * stride}, options);
#ifdef __linux__
  if (storage.device().is_cpu()) {
    constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
    const auto begin = reinterpret_cast<uintptr_t>(storage.data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + storage.nbytes()) & ~(kHugePage - 1);
    if (last > first)  // advice only: where the kernel declines, 4 KiB pages serve
      madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  storage.zero_();
  // (num_pages * stride) -> (num_pages, num_heads, page_size, head_dim), pages `stride` apart
  return storage.as_strided({num_pages, num_heads, page_size, head_dim},
                            {stride, page_size * head_dim, head_dim, 1});
}

}  // namespace

PagedKVCache::PagedKVCache(int64_t num_pages, int64_t page_size, int64_t num_heads,
                           int64_t head_dim, const torch::TensorOptions& options)
    : page_size_(page_size) {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"num_pages", num_pages},
                                    {"page_size", page_size},
                                    {"num_heads", num_heads},
                                    {"head_dim", head_dim}})
    detail::check_positive_option("PagedKVCache", name, value);
  allocate("[PagedKVCache]", num_pages, num_heads, head_dim, options, /*latents=*/false);
}

PagedKVCache::PagedKVCache(LatentsTag, int64_t num_pages, int64_t page_size, int64_t latent_dim,
                           const torch::TensorOptions& options)
    : page_size_(page_size) {
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"num_pages", num_pages},
                                    {"page_size", page_size},
                                    {"latent_dim", latent_dim}})
    detail::check_positive_option("PagedKVCache::latents", name, value);
  allocate("[PagedKVCache::latents]", num_pages, 1, latent_dim, options, /*latents=*/true);
}

PagedKVCache PagedKVCache::latents(int64_t num_pages, int64_t page_size, int64_t latent_dim,
                                   const torch::TensorOptions& options) {
  return PagedKVCache(LatentsTag{}, num_pages, page_size, latent_dim, options);
}

void PagedKVCache::allocate(const char* fn, int64_t num_pages, int64_t num_heads, int64_t head_dim,
                            const torch::TensorOptions& options, bool latents) {
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  TORCH_CHECK(c10::isFloatingType(dtype), fn, " keys and values need a floating dtype, got ",
              dtype);
  const double bytes =
      static_cast<double>(num_pages) *
      page_bytes(page_size_, num_heads, head_dim, c10::elementSize(dtype), latents);
  detail::check_memory_budget(fn, c10::str("a pool of ", num_pages, " pages"), bytes,
                              "take fewer pages (PagedKVCache::pages_within(bytes, ...))");
  const auto storage = options.requires_grad(false);
  keys_ = pool_storage(num_pages, num_heads, page_size_, head_dim, storage);
  // A latent is its position's key and value alike: one tensor.
  values_ = latents ? keys_ : pool_storage(num_pages, num_heads, page_size_, head_dim, storage);
  references_.assign(static_cast<size_t>(num_pages), 0);
  // Taken from the back: page 0 first.
  for (int64_t page = num_pages - 1; page >= 0; --page)
    free_.push_back(page);
}

int64_t PagedKVCache::pages_within(int64_t bytes, int64_t page_size, int64_t num_heads,
                                   int64_t head_dim, torch::Dtype dtype, bool latents) {
  const char* fn = "[PagedKVCache::pages_within]";
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"page_size", page_size},
                                    {"num_heads", num_heads},
                                    {"head_dim", head_dim}})
    detail::check_positive_option("PagedKVCache::pages_within", name, value);
  TORCH_CHECK(!latents || num_heads == 1, fn, " a pool of latents has num_heads 1, got ",
              num_heads);
  const int64_t one_page =
      page_bytes(page_size, num_heads, head_dim, c10::elementSize(dtype), latents);
  TORCH_CHECK(bytes >= one_page, fn, " bytes must hold at least one page (", one_page,
              " bytes), got ", bytes);
  return bytes / one_page;
}

PagedKVCache::Sequence& PagedKVCache::sequence_at(const char* fn, int64_t sequence) {
  const auto& self = *this;
  return const_cast<Sequence&>(self.sequence_at(fn, sequence));
}

const PagedKVCache::Sequence& PagedKVCache::sequence_at(const char* fn, int64_t sequence) const {
  TORCH_CHECK(sequence >= 0 && sequence < static_cast<int64_t>(sequences_.size()), fn, " sequence ",
              sequence, " does not exist (ids are [0, ", sequences_.size(), "))");
  const auto& s = sequences_[static_cast<size_t>(sequence)];
  TORCH_CHECK(s.live, fn, " sequence ", sequence, " was released");
  return s;
}

int64_t PagedKVCache::references(int64_t page) const {
  TORCH_CHECK(page >= 0 && page < num_pages(), "[PagedKVCache::references] page must be in [0, ",
              num_pages(), "), got ", page);
  return references_[static_cast<size_t>(page)];
}

int64_t PagedKVCache::nbytes() const {
  return num_pages() * page_bytes(page_size_, num_heads(), head_dim(),
                                  static_cast<int64_t>(keys_.element_size()), holds_latents());
}

int64_t PagedKVCache::held_bytes() const {
  return (num_pages() - free_pages()) * (nbytes() / num_pages());
}

int64_t PagedKVCache::add_sequence() {
  sequences_.push_back(Sequence{});
  return static_cast<int64_t>(sequences_.size()) - 1;
}

int64_t PagedKVCache::fork(int64_t parent) {
  Sequence child = sequence_at("[PagedKVCache::fork]", parent);
  for (const int64_t page : child.pages) {
    if (page >= 0)
      ++references_[static_cast<size_t>(page)];
  }
  sequences_.push_back(std::move(child));
  return static_cast<int64_t>(sequences_.size()) - 1;
}

void PagedKVCache::drop_reference(int64_t page) {
  if (page >= 0 && --references_[static_cast<size_t>(page)] == 0)
    free_.push_back(page);
}

void PagedKVCache::release(int64_t sequence) {
  auto& s = sequence_at("[PagedKVCache::release]", sequence);
  for (const int64_t page : s.pages)
    drop_reference(page);
  s.pages.clear();
  s.length = 0;
  s.live = false;
}

void PagedKVCache::drop_before(int64_t sequence, int64_t position) {
  const char* fn = "[PagedKVCache::drop_before]";
  auto& s = sequence_at(fn, sequence);
  TORCH_CHECK(position >= 0 && position <= s.length, fn, " position must be in [0, ", s.length,
              "] (the sequence's length), got ", position);
  for (int64_t page = 0; (page + 1) * page_size_ <= position; ++page) {
    drop_reference(s.pages[static_cast<size_t>(page)]);
    s.pages[static_cast<size_t>(page)] = -1;
  }
}

int64_t PagedKVCache::length(int64_t sequence) const {
  return sequence_at("[PagedKVCache::length]", sequence).length;
}

int64_t PagedKVCache::pages_needed(const Sequence& s, int64_t n) const {
  if (n == 0)
    return 0;
  const int64_t held_pages = static_cast<int64_t>(s.pages.size());
  const int64_t new_pages = (s.length + n + page_size_ - 1) / page_size_ - held_pages;
  // A partly filled last page that another sequence shares is copied before it is written.
  const bool copies_last =
      s.length % page_size_ != 0 && references_[static_cast<size_t>(s.pages.back())] > 1;
  return new_pages + (copies_last ? 1 : 0);
}

int64_t PagedKVCache::pages_needed(int64_t sequence, int64_t n) const {
  TORCH_CHECK(n >= 0, "[PagedKVCache::pages_needed] n must be >= 0, got ", n);
  return pages_needed(sequence_at("[PagedKVCache::pages_needed]", sequence), n);
}

bool PagedKVCache::can_append(int64_t sequence, int64_t n) const {
  TORCH_CHECK(n >= 0, "[PagedKVCache::can_append] n must be >= 0, got ", n);
  return pages_needed(sequence_at("[PagedKVCache::can_append]", sequence), n) <= free_pages();
}

int64_t PagedKVCache::take_page() {
  const int64_t page = free_.back();
  free_.pop_back();
  references_[static_cast<size_t>(page)] = 1;
  return page;
}

void PagedKVCache::append(int64_t sequence, const torch::Tensor& keys,
                          const torch::Tensor& values) {
  const char* fn = "[PagedKVCache::append]";
  TORCH_CHECK(!holds_latents(), fn,
              " this pool holds latents, each its position's key and value: "
              "append(sequence, latents)");
  write(fn, sequence, keys, values);
}

void PagedKVCache::append(int64_t sequence, const torch::Tensor& latents) {
  const char* fn = "[PagedKVCache::append]";
  TORCH_CHECK(holds_latents(), fn,
              " this pool holds keys and values: append(sequence, keys, values)");
  write(fn, sequence, latents, latents);
}

void PagedKVCache::write(const char* fn, int64_t sequence, const torch::Tensor& keys,
                         const torch::Tensor& values) {
  auto& s = sequence_at(fn, sequence);
  const bool latents = holds_latents();
  for (const auto& [name, t] :
       {std::pair<const char*, const torch::Tensor&>{latents ? "latents" : "keys", keys},
        std::pair<const char*, const torch::Tensor&>{latents ? "latents" : "values", values}}) {
    TORCH_CHECK(t.defined() && t.dim() == 3 && t.size(0) == num_heads() && t.size(2) == head_dim(),
                fn, " ", name, ": expected (", num_heads(), ", n, ", head_dim(), "), got ",
                t.defined() ? detail::shape_string(t) : "undefined");
    TORCH_CHECK(t.scalar_type() == keys_.scalar_type() && t.device() == keys_.device(), fn, " ",
                name, " must match the pool's dtype and device (", keys_.scalar_type(), " on ",
                keys_.device(), "), got ", t.scalar_type(), " on ", t.device());
  }
  TORCH_CHECK(keys.size(1) == values.size(1), fn,
              " keys and values must bring the same positions, got ", keys.size(1), " and ",
              values.size(1));
  const int64_t n = keys.size(1);
  const int64_t needed = pages_needed(s, n);
  TORCH_CHECK(needed <= free_pages(), fn, " the pool is full: ", n, " more positions of sequence ",
              sequence, " need ", needed, " free pages, and ", free_pages(), " of ", num_pages(),
              " are free; release finished sequences, or ask can_append first and wait");
  torch::NoGradGuard no_grad;
  if (needed > 0 && s.length % page_size_ != 0) {
    auto& last = s.pages.back();
    if (references_[static_cast<size_t>(last)] > 1) {  // copy on write
      const int64_t copy = take_page();
      const int64_t filled = s.length % page_size_;
      keys_[copy].narrow(1, 0, filled).copy_(keys_[last].narrow(1, 0, filled));
      if (!latents)
        values_[copy].narrow(1, 0, filled).copy_(values_[last].narrow(1, 0, filled));
      drop_reference(last);
      last = copy;
    }
  }
  for (int64_t written = 0; written < n;) {
    const int64_t position = s.length + written, slot = position % page_size_;
    if (slot == 0)
      s.pages.push_back(take_page());
    const int64_t page = s.pages.back(), count = std::min(n - written, page_size_ - slot);
    keys_[page].narrow(1, slot, count).copy_(keys.narrow(1, written, count));
    if (!latents)
      values_[page].narrow(1, slot, count).copy_(values.narrow(1, written, count));
    written += count;
  }
  s.length += n;
}

PagedKV PagedKVCache::view(const std::vector<int64_t>& sequences) const {
  const char* fn = "[PagedKVCache::view]";
  size_t most_pages = 1;
  for (const int64_t id : sequences)
    most_pages = std::max(most_pages, sequence_at(fn, id).pages.size());
  const auto rows = static_cast<int64_t>(sequences.size());
  auto table = torch::full({rows, static_cast<int64_t>(most_pages)}, -1, torch::kInt64);
  auto lengths = torch::empty({rows}, torch::kInt64);
  auto* entry = table.data_ptr<int64_t>();
  auto* length = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const auto& s = sequences_[static_cast<size_t>(sequences[static_cast<size_t>(r)])];
    std::copy(s.pages.begin(), s.pages.end(), entry + r * static_cast<int64_t>(most_pages));
    length[r] = s.length;
  }
  return {keys_, values_, table, lengths};
}

void PagedKVCache::check_view(const PagedKV& view) const {
  const char* fn = "[PagedKVCache::check_view]";
  TORCH_CHECK(view.key_pages.is_same(keys_) && view.value_pages.is_same(values_), fn,
              " the view's pages are not this pool's");
  TORCH_CHECK(view.page_table.defined() && view.page_table.dim() == 2 &&
                  view.page_table.scalar_type() == torch::kInt64 &&
                  view.page_table.device().is_cpu(),
              fn, " page_table must be (batch, pages) int64 on the CPU");
  const auto table = view.page_table.contiguous();
  const auto* entry = table.data_ptr<int64_t>();
  for (int64_t r = 0; r < table.size(0); ++r) {
    for (int64_t i = 0; i < table.size(1); ++i) {
      const int64_t page = entry[r * table.size(1) + i];
      if (page < 0)
        continue;
      TORCH_CHECK(page < num_pages(), fn, " page_table[", r, "][", i, "] = ", page,
                  " points outside the pool of ", num_pages(), " pages");
      TORCH_CHECK(references_[static_cast<size_t>(page)] > 0, fn, " page_table[", r, "][", i,
                  "] = ", page, " is a free page (released since the view was taken)");
    }
  }
}

}  // namespace attnkit
