#pragma once

// Shape checks and views shared by the attention kernels that walk (batch, head) slices
// themselves (chunked_attention, fused_attention).

#include <algorithm>

#include <torch/torch.h>

#include "core/base/checks.h"

namespace attnkit::detail {

/// Fails unless query (..., H, n, hd), key (..., G, m, hd) and value (..., G, m, hd_v) share
/// their leading dimensions, G divides H (grouped-query attention, 4-D and larger inputs;
/// G = H below) and m >= 1. Returns H / G. `fn` names the caller in the message.
inline int64_t check_qkv_layout(const char* fn, const torch::Tensor& query,
                                const torch::Tensor& key, const torch::Tensor& value) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(), fn,
              " query, key and value must all be defined tensors");
  TORCH_CHECK(query.dim() >= 2 && key.dim() == query.dim() && value.dim() == query.dim(), fn,
              " query, key and value must have the same rank >= 2, got ", shape_string(query), ", ",
              shape_string(key), ", ", shape_string(value));
  // Dimensions before the heads (-3 of a 4-D or larger tensor), which must be equal.
  const int64_t outer_dims = query.dim() >= 4 ? query.dim() - 3 : query.dim() - 2;
  TORCH_CHECK(query.size(-1) == key.size(-1) && key.size(-2) == value.size(-2) &&
                  query.sizes().slice(0, outer_dims) == key.sizes().slice(0, outer_dims) &&
                  key.sizes().slice(0, key.dim() - 2) == value.sizes().slice(0, value.dim() - 2),
              fn, " expected query (..., n, hd), key (..., m, hd), value (..., m, hd_v); got ",
              shape_string(query), ", ", shape_string(key), ", ", shape_string(value));
  TORCH_CHECK(key.size(-2) >= 1, fn, " key must hold at least one token");
  TORCH_CHECK(query.dim() < 4 || key.size(-3) <= query.size(-3), fn,
              " key and value may have fewer heads (dim -3) than query, not more; got query ",
              shape_string(query), ", key ", shape_string(key));
  return query_heads_per_kv_head(fn, query, key);
}

/// (..., n, f) -> (outer, heads, n, f), where heads is the dimension before n (1 for 2-D
/// input) and outer the product of the rest: a view whenever the leading dimensions merge,
/// as they do for the (b, h, n, hd) views of a projection split into heads.
inline torch::Tensor as_outer_heads(const torch::Tensor& t) {
  const int64_t heads = t.dim() >= 3 ? t.size(-3) : 1;
  int64_t outer = 1;
  for (int64_t d = 0; d + 3 < t.dim(); ++d)
    outer *= t.size(d);
  return t.reshape({outer, heads, t.size(-2), t.size(-1)});
}

/// An (outer, heads, n, f) tensor -> the shape of `like` with n and f replaced (a view).
inline torch::Tensor shaped_like(const torch::Tensor& t4, const torch::Tensor& like) {
  auto shape = like.sizes().vec();
  shape[shape.size() - 2] = t4.size(2);
  shape.back() = t4.size(3);
  return t4.view(shape);
}

}  // namespace attnkit::detail
