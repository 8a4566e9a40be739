#include "attnkit/kv_cache.h"

#include "checks.h"

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

int64_t KVCache::nbytes() const {
  return keys_.defined() ? 2 * keys_.numel() * static_cast<int64_t>(keys_.element_size()) : 0;
}

torch::TensorOptions KVCache::options() const {
  return keys_.defined() ? keys_.options() : torch::TensorOptions();
}

std::pair<torch::Tensor, torch::Tensor> KVCache::append(const torch::Tensor& keys,
                                                        const torch::Tensor& values) {
  const char* fn = "[KVCache::append]";
  TORCH_CHECK(keys_.defined(), fn,
              " this cache has no storage (default-constructed); make one with "
              "KVCache(batch, num_heads, head_dim, capacity) or a module's make_kv_cache");
  TORCH_CHECK(keys.defined() && values.defined() && keys.dim() == 4 &&
                  keys.sizes() == values.sizes() && keys.size(0) == batch() &&
                  keys.size(1) == num_heads() && keys.size(3) == head_dim(),
              fn, " keys and values: expected (batch, num_heads, n, head_dim) = (", batch(), ", ",
              num_heads(), ", n, ", head_dim(), ") each, got ",
              keys.defined() ? detail::shape_string(keys) : "undefined", " and ",
              values.defined() ? detail::shape_string(values) : "undefined");
  TORCH_CHECK(keys.scalar_type() == keys_.scalar_type() &&
                  values.scalar_type() == keys_.scalar_type() && keys.device() == keys_.device() &&
                  values.device() == keys_.device(),
              fn, " keys and values must match the cache's dtype and device (", keys_.scalar_type(),
              " on ", keys_.device(), "), got ", keys.scalar_type(), " on ", keys.device(), " and ",
              values.scalar_type(), " on ", values.device());
  const int64_t n = keys.size(2);
  TORCH_CHECK(size_ + n <= capacity(), fn, " ", n, " more positions do not fit: the cache holds ",
              size_, " of its capacity ", capacity());
  torch::NoGradGuard no_grad;
  keys_.narrow(2, size_, n).copy_(keys);
  values_.narrow(2, size_, n).copy_(values);
  size_ += n;
  return {this->keys(), this->values()};
}

torch::Tensor KVCache::keys() const {
  TORCH_CHECK(keys_.defined(), "[KVCache::keys] this cache has no storage");
  return keys_.narrow(2, 0, size_);
}

torch::Tensor KVCache::values() const {
  TORCH_CHECK(values_.defined(), "[KVCache::values] this cache has no storage");
  return values_.narrow(2, 0, size_);
}

}  // namespace attnkit
