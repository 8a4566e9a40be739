#include "attnkit/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/base/checks.h"

namespace attnkit {

KVCache::KVCache(int64_t batch, int64_t num_heads, int64_t head_dim, int64_t capacity,
                 const torch::TensorOptions& options) {
  const char* fn = "[KVCache]";
  TORCH_CHECK(batch >= 1, fn, " batch must be >= 1, got ", batch);
  TORCH_CHECK(num_heads >= 1, fn, " num_heads must be >= 1, got ", num_heads);
  TORCH_CHECK(head_dim >= 1, fn, " head_dim must be >= 1, got ", head_dim);
  TORCH_CHECK(capacity >= 1, fn, " capacity must be >= 1, got ", capacity);
  TORCH_CHECK(c10::isFloatingType(c10::typeMetaToScalarType(options.dtype())), fn,
              " keys and values need a floating dtype, got ", options.dtype());
  keys_ = torch::zeros({batch, num_heads, capacity, head_dim}, options.requires_grad(false));
  values_ = torch::zeros_like(keys_);
}

KVCache KVCache::sliding_window(int64_t batch, int64_t num_heads, int64_t head_dim,
                                int64_t window_size, const torch::TensorOptions& options) {
  TORCH_CHECK(window_size >= 1, "[KVCache::sliding_window] window_size must be >= 1, got ",
              window_size);
  KVCache cache(batch, num_heads, head_dim, window_size, options);
  cache.window_size_ = window_size;
  return cache;
}

KVCache KVCache::latent(int64_t batch, int64_t latent_dim, int64_t capacity,
                        const torch::TensorOptions& options) {
  TORCH_CHECK(latent_dim >= 1, "[KVCache::latent] latent_dim must be >= 1, got ", latent_dim);
  KVCache cache(batch, /*num_heads=*/1, latent_dim, capacity, options);
  cache.values_ = torch::Tensor();
  return cache;
}

int64_t KVCache::max_positions() const {
  return window_size_ > 0 ? std::numeric_limits<int64_t>::max() : capacity();
}

int64_t KVCache::nbytes() const {
  const auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  return bytes(keys_) + bytes(values_);
}

int64_t KVCache::bytes_per_token() const {
  return keys_.defined() ? nbytes() / (batch() * capacity()) : 0;
}

torch::TensorOptions KVCache::options() const {
  return keys_.defined() ? keys_.options() : torch::TensorOptions();
}

void KVCache::check_appended(const char* fn, const char* what, const torch::Tensor& t,
                             bool check_room) const {
  TORCH_CHECK(keys_.defined(), fn,
              " this cache has no storage (default-constructed); make one with "
              "KVCache(batch, num_heads, head_dim, capacity) or a module's make_kv_cache");
  TORCH_CHECK(t.defined() && t.dim() == 4 && t.size(0) == batch() && t.size(1) == num_heads() &&
                  t.size(3) == head_dim(),
              fn, " ", what, ": expected (", batch(), ", ", num_heads(), ", n, ", head_dim(),
              "), got ", t.defined() ? detail::shape_string(t) : "undefined");
  TORCH_CHECK(t.scalar_type() == keys_.scalar_type() && t.device() == keys_.device(), fn, " ", what,
              " must match the cache's dtype and device (", keys_.scalar_type(), " on ",
              keys_.device(), "), got ", t.scalar_type(), " on ", t.device());
  const int64_t n = t.size(2);
  TORCH_CHECK(!check_room || n <= max_positions() - size_, fn, " ", n,
              " more positions do not fit: the cache holds ", size_, " of its capacity ",
              capacity());
}

torch::Tensor KVCache::lengths() const {
  if (is_ragged())
    return torch::tensor(row_lengths_, torch::kInt64);
  return torch::full({batch()}, size_, torch::kInt64);
}

void KVCache::reset_rows(const std::vector<int64_t>& rows) {
  const char* fn = "[KVCache::reset_rows]";
  std::vector<int64_t> lengths(batch(), size_);
  if (is_ragged())
    lengths = row_lengths_;
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < batch(), fn, " rows[", i, "] must be in [0, ", batch(),
                "), got ", rows[i]);
    lengths[rows[i]] = -1;  // marked; set to 0 once every index is checked
  }
  if (rows.empty())
    return;
  const bool every_row =
      std::all_of(lengths.begin(), lengths.end(), [](int64_t l) { return l < 0; });
  if (every_row) {
    reset();
    return;
  }
  for (auto& length : lengths)
    length = std::max<int64_t>(length, 0);
  size_ = *std::max_element(lengths.begin(), lengths.end());
  row_lengths_ = std::move(lengths);
}

void KVCache::keep_rows(const std::vector<int64_t>& rows) {
  const char* fn = "[KVCache::keep_rows]";
  TORCH_CHECK(keys_.defined(), fn, " the cache has no storage");
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < batch(), fn, " rows[", i, "] must be in [0, ", batch(),
                "), got ", rows[i]);
    TORCH_CHECK(i == 0 || rows[i] > rows[i - 1], fn, " rows must be distinct and ascending, got ",
                rows[i - 1], " before ", rows[i]);
  }
  // Row rows[i] >= i moves to slot i; ascending order never overwrites a row still to move.
  const int64_t held_positions = held();
  std::vector<int64_t> kept_lengths;
  for (size_t i = 0; i < rows.size(); ++i) {
    const int64_t from = rows[i], to = static_cast<int64_t>(i);
    if (from != to) {
      keys_[to].narrow(1, 0, held_positions).copy_(keys_[from].narrow(1, 0, held_positions));
      if (values_.defined())
        values_[to].narrow(1, 0, held_positions).copy_(values_[from].narrow(1, 0, held_positions));
    }
    if (is_ragged())
      kept_lengths.push_back(row_lengths_[from]);
  }
  const auto kept = static_cast<int64_t>(rows.size());
  keys_ = keys_.narrow(0, 0, kept);
  if (values_.defined())
    values_ = values_.narrow(0, 0, kept);
  if (!is_ragged())
    return;
  const bool uniform = std::all_of(kept_lengths.begin(), kept_lengths.end(),
                                   [&](int64_t length) { return length == kept_lengths.front(); });
  size_ = kept_lengths.empty() ? 0 : *std::max_element(kept_lengths.begin(), kept_lengths.end());
  row_lengths_ = uniform ? std::vector<int64_t>{} : std::move(kept_lengths);
}

KVCache::RaggedSpan KVCache::append_ragged(const torch::Tensor& keys, const torch::Tensor& values,
                                           const std::vector<int64_t>& new_lengths) {
  const char* fn = "[KVCache::append_ragged]";
  TORCH_CHECK(!is_latent(), fn, " this is a latent cache; use append_latent_ragged");
  check_appended(fn, "keys", keys, /*check_room=*/false);
  check_appended(fn, "values", values, /*check_room=*/false);
  TORCH_CHECK(keys.sizes() == values.sizes(), fn, " keys and values must have the same shape, got ",
              detail::shape_string(keys), " and ", detail::shape_string(values));
  return write_ragged(fn, keys, values, new_lengths);
}

torch::Tensor KVCache::latents_as_heads(const char* fn, const char* key_value_append,
                                        const torch::Tensor& latents, bool check_room) const {
  TORCH_CHECK(is_latent(), fn, " this cache holds keys and values; use ", key_value_append);
  TORCH_CHECK(latents.defined() && latents.dim() == 3, fn,
              " latents: expected (batch, n, latent_dim), got ",
              latents.defined() ? detail::shape_string(latents) : "undefined");
  // (b, n, latent_dim) -> (b, 1, n, latent_dim), the storage's layout
  const auto as_heads = latents.unsqueeze(1);
  check_appended(fn, "latents", as_heads, check_room);
  return as_heads;
}

KVCache::RaggedSpan KVCache::append_latent_ragged(const torch::Tensor& latents,
                                                  const std::vector<int64_t>& new_lengths) {
  const char* fn = "[KVCache::append_latent_ragged]";
  const auto as_heads = latents_as_heads(fn, "append_ragged", latents, /*check_room=*/false);
  auto span = write_ragged(fn, as_heads, torch::Tensor(), new_lengths);
  span.keys = span.keys.select(1, 0);  // (b, 1, m, latent_dim) -> (b, m, latent_dim)
  return span;
}

namespace {

// Row r's last min(new_lengths[r], slots) tokens of `appended` (b, heads, n, width) into the
// slots (p % slots) of their positions p, which end at ends[r], of the contiguous `storage`
// (b, heads, capacity, width) on the CPU: copied row by row on the host, where a scatter (or
// a refill's index_copy_ per row) cost a small model's decode step more than its arithmetic.
void copy_into_slots(torch::Tensor& storage, const torch::Tensor& appended,
                     const std::vector<int64_t>& new_lengths, const std::vector<int64_t>& ends,
                     int64_t slots) {
  const auto source = appended.stride(3) == 1 ? appended : appended.contiguous();
  const int64_t heads = storage.size(1), capacity = storage.size(2), width = storage.size(3);
  const auto item = static_cast<int64_t>(storage.element_size());
  auto* to = static_cast<char*>(storage.data_ptr());
  const auto* from = static_cast<const char*>(source.data_ptr());
  for (int64_t r = 0; r < storage.size(0); ++r) {
    const int64_t keep = std::min(new_lengths[r], slots), first = new_lengths[r] - keep;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < keep; ++i) {
        const int64_t slot = (ends[r] - keep + i) % slots;
        std::memcpy(
            to + ((r * heads + h) * capacity + slot) * width * item,
            from + (r * source.stride(0) + h * source.stride(1) + (first + i) * source.stride(2)) *
                       item,
            width * item);
      }
    }
  }
}

// Positions [start, start + n) of every row of `appended` (b, heads, n, width) into their
// slots (p % slots) of `storage`, the last min(n, slots) of them (a rolling cache keeps no
// more): by memcpy on the CPU, else one copy where the slots do not wrap.
void write_positions(torch::Tensor& storage, const torch::Tensor& appended, int64_t start,
                     int64_t slots) {
  const int64_t b = storage.size(0), n = appended.size(2), keep = std::min(n, slots);
  if (storage.device().is_cpu() && storage.is_contiguous()) {
    copy_into_slots(storage, appended, std::vector<int64_t>(b, n),
                    std::vector<int64_t>(b, start + n), slots);
    return;
  }
  const int64_t first_slot = (start + n - keep) % slots;
  const auto kept = appended.narrow(2, n - keep, keep);
  if (first_slot + keep <= slots) {
    storage.narrow(2, first_slot, keep).copy_(kept);
    return;
  }
  const auto slot_index = torch::arange(start + n - keep, start + n,
                                        torch::dtype(torch::kInt64).device(storage.device()))
                              .remainder_(slots);
  storage.index_copy_(2, slot_index, kept);
}

}  // namespace

KVCache::RaggedSpan KVCache::write_ragged(const char* fn, const torch::Tensor& keys,
                                          const torch::Tensor& values,
                                          const std::vector<int64_t>& new_lengths) {
  const int64_t b = batch(), n = keys.size(2);
  TORCH_CHECK(static_cast<int64_t>(new_lengths.size()) == b, fn, " new_lengths: expected ", b,
              " entries (one per row), got ", new_lengths.size());
  std::vector<int64_t> starts(b, size_), ends(b);
  if (is_ragged())
    starts = row_lengths_;
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(new_lengths[r] >= 0 && new_lengths[r] <= n, fn, " new_lengths[", r,
                "] must be in [0, ", n, "] (the tokens given), got ", new_lengths[r]);
    ends[r] = starts[r] + new_lengths[r];
    TORCH_CHECK(ends[r] <= max_positions(), fn, " row ", r, ": ", new_lengths[r],
                " more positions do not fit: it holds ", starts[r], " of the capacity ",
                capacity());
  }
  torch::NoGradGuard no_grad;
  const auto device = keys_.device();
  const auto on_device = [&](const std::vector<int64_t>& v) {
    return torch::tensor(v, torch::kInt64).to(device);
  };
  RaggedSpan span;
  const int64_t window = window_size_;
  if (window > 0) {
    // Each row's span before the new keys overwrite the oldest slots: its held positions
    // oldest first (position p in slot p % window), then its new tokens, then filler.
    std::vector<int64_t> span_starts(b), span_ends(b);
    for (int64_t r = 0; r < b; ++r) {
      span_starts[r] = std::min(starts[r], window);
      span_ends[r] = span_starts[r] + new_lengths[r];
    }
    const int64_t m = *std::max_element(span_ends.begin(), span_ends.end());
    // Indices into cat(storage, new tokens) along the positions: (b * m).
    std::vector<int64_t> index(b * m, 0);
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t k = 0; k < span_ends[r]; ++k) {
        const int64_t held_position = starts[r] - span_starts[r] + k;
        index[r * m + k] =
            k < span_starts[r] ? held_position % window : window + k - span_starts[r];
      }
    }
    // (b * m) -> (b, 1, m, 1) -> (b, heads, m, width)
    const auto gather_index =
        on_device(index).view({b, 1, m, 1}).expand({b, keys.size(1), m, keys.size(3)});
    const auto gathered = [&](const torch::Tensor& storage, const torch::Tensor& appended) {
      return torch::cat({storage, appended}, 2).gather(2, gather_index);
    };
    span.keys = gathered(keys_, keys);
    if (values_.defined())
      span.values = gathered(values_, values);
    span.starts = on_device(span_starts);
    span.ends = on_device(span_ends);
  }
  // Position p goes to slot p % slots: a rolling cache wraps, no other row passes capacity().
  const int64_t slots = window > 0 ? window : capacity();
  const bool every_token_valid =
      std::all_of(new_lengths.begin(), new_lengths.end(), [n](int64_t l) { return l == n; });
  const bool on_host =
      device.is_cpu() && keys_.is_contiguous() && (!values_.defined() || values_.is_contiguous());
  if (on_host) {
    copy_into_slots(keys_, keys, new_lengths, ends, slots);
    if (values_.defined())
      copy_into_slots(values_, values, new_lengths, ends, slots);
  } else if (every_token_valid && n <= slots) {
    // One scatter: token i of row r to slot (starts[r] + i) % slots (decode steps take this
    // path); n <= slots keeps each row's slots distinct.
    const auto positions = (on_device(starts).unsqueeze(1) +
                            torch::arange(n, torch::dtype(torch::kInt64).device(device)))
                               .remainder_(slots);  // (b, n)
    // (b, n) -> (b, 1, n, 1) -> (b, heads, n, width)
    const auto index = positions.view({b, 1, n, 1}).expand_as(keys);
    keys_.scatter_(2, index, keys);
    if (values_.defined())
      values_.scatter_(2, index, values);
  } else {
    for (int64_t r = 0; r < b; ++r) {
      // A row's last `keep` tokens: all of them unless a rolling cache drops the oldest.
      const int64_t keep = std::min(new_lengths[r], slots);
      if (keep == 0)
        continue;
      const auto row_slots =
          torch::arange(ends[r] - keep, ends[r], torch::dtype(torch::kInt64).device(device))
              .remainder_(slots);
      const int64_t first = new_lengths[r] - keep;
      keys_[r].index_copy_(1, row_slots, keys[r].narrow(1, first, keep));
      if (values_.defined())
        values_[r].index_copy_(1, row_slots, values[r].narrow(1, first, keep));
    }
  }
  const int64_t longest = *std::max_element(ends.begin(), ends.end());
  const bool uniform =
      std::all_of(ends.begin(), ends.end(), [&](int64_t e) { return e == ends[0]; });
  row_lengths_ = uniform ? std::vector<int64_t>() : ends;
  size_ = longest;
  if (window > 0)
    return span;
  return {keys_.narrow(2, 0, longest),
          values_.defined() ? values_.narrow(2, 0, longest) : torch::Tensor(), on_device(starts),
          on_device(ends)};
}

KVCache::Span KVCache::append(const torch::Tensor& keys, const torch::Tensor& values,
                              bool position_order) {
  const char* fn = "[KVCache::append]";
  TORCH_CHECK(!is_latent(), fn, " this is a latent cache; use append_latent");
  TORCH_CHECK(!is_ragged(), fn,
              " the rows hold different numbers of positions (a ragged append); append with "
              "append_ragged (a module: forward_with_cache(x, cache, lengths)), or reset()");
  check_appended(fn, "keys", keys);
  check_appended(fn, "values", values);
  TORCH_CHECK(keys.sizes() == values.sizes(), fn, " keys and values must have the same shape, got ",
              detail::shape_string(keys), " and ", detail::shape_string(values));
  torch::NoGradGuard no_grad;
  const int64_t n = keys.size(2);
  const int64_t start = size_;
  const int64_t window = window_size_;
  const int64_t slots = window > 0 ? window : capacity();
  const auto write = [&] {
    write_positions(keys_, keys, start, slots);
    write_positions(values_, values, start, slots);
    size_ += n;
  };
  if (window == 0) {
    write();
    return {this->keys(), this->values(), start};
  }
  if (n == 1) {
    // Position p lives in slot p % window. The one query sees every position held, so
    // the storage order will do, unless the caller reads positions: then from the oldest
    // held, in slot size() % window once the buffer has wrapped.
    write();
    const int64_t oldest = size_ > window ? size_ % window : 0;
    if (!position_order || oldest == 0)
      return {this->keys(), this->values(), held() - 1};
    return {this->keys().roll(-oldest, 2), this->values().roll(-oldest, 2), held() - 1};
  }
  // Several queries need their keys in order: the positions held, oldest first (slot
  // start % window once the buffer has wrapped), then the new ones; read before the new
  // keys overwrite the oldest slots.
  const int64_t held_before = held();
  const int64_t oldest = start > window ? start % window : 0;
  const auto in_order = [&](const torch::Tensor& storage, const torch::Tensor& appended) {
    const auto held_part = storage.narrow(2, 0, held_before);
    return torch::cat({held_part.roll(-oldest, 2), appended}, 2);
  };
  Span span{in_order(keys_, keys), in_order(values_, values), held_before};
  write();
  return span;
}

torch::Tensor KVCache::append_latent(const torch::Tensor& latents) {
  const auto as_heads = latents_as_heads("[KVCache::append_latent]", "append", latents);
  torch::NoGradGuard no_grad;
  write_positions(keys_, as_heads, size_, capacity());
  size_ += latents.size(1);
  return keys().select(1, 0);
}

torch::Tensor KVCache::keys() const {
  TORCH_CHECK(keys_.defined(), "[KVCache::keys] this cache has no storage");
  return keys_.narrow(2, 0, held());
}

torch::Tensor KVCache::values() const {
  TORCH_CHECK(values_.defined(), "[KVCache::values] this cache has no values (",
              keys_.defined() ? "a latent cache" : "no storage", ")");
  return values_.narrow(2, 0, held());
}

}  // namespace attnkit
