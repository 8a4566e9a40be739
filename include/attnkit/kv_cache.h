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

#include <cstdint>
#include <utility>

#include <torch/torch.h>

namespace attnkit {

/// Keys and values (batch, num_heads, capacity, head_dim) of `size()` positions.
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

  // Move-only: a copy would share the storage but not the position, and the two would
  // overwrite each other's keys.
  KVCache(KVCache&&) = default;
  KVCache& operator=(KVCache&&) = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  /// Positions held: the position of the next token appended.
  int64_t size() const { return size_; }
  /// Positions the storage holds at most.
  int64_t capacity() const { return keys_.defined() ? keys_.size(2) : 0; }
  int64_t batch() const { return keys_.defined() ? keys_.size(0) : 0; }
  int64_t num_heads() const { return keys_.defined() ? keys_.size(1) : 0; }
  int64_t head_dim() const { return keys_.defined() ? keys_.size(3) : 0; }
  /// Bytes of the storage, keys and values at full capacity:
  /// 2 * batch * num_heads * capacity * head_dim * element size.
  int64_t nbytes() const;
  /// The storage's dtype and device.
  torch::TensorOptions options() const;

  /// Forgets every position (the storage is kept): the next append starts a new sequence.
  void reset() { size_ = 0; }

  /// Writes `keys` and `values` (batch, num_heads, n, head_dim) at positions
  /// [size(), size() + n) and returns every position held, (batch, num_heads, size(), head_dim)
  /// views of the storage. Outside autograd: nothing appended records history. Fails
  /// (c10::Error) when the shapes, dtype or device differ from the cache's or when
  /// size() + n > capacity(); nothing is written then.
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& keys,
                                                 const torch::Tensor& values);

  /// (batch, num_heads, size(), head_dim) views of the keys and values held.
  torch::Tensor keys() const;
  torch::Tensor values() const;

 private:
  torch::Tensor keys_;    // (batch, num_heads, capacity, head_dim)
  torch::Tensor values_;  // (batch, num_heads, capacity, head_dim)
  int64_t size_ = 0;
};

}  // namespace attnkit
