// The fused decode step: one query token per row against its cached keys, every head in one
// loop, reading the cache in place. Why: at toy sizes a decode step's cost is its operator
// count, and the general path spends a dozen ops per layer (masks, head splits, the math
// core's score, softmax and product, the merge) on arithmetic that takes a few microseconds.

#include "core/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"

namespace attnkit::detail {

namespace {

// Eight partial sums, so that the compiler can vectorise the product without reassociating
// one sum (which it may not do for floating point).
template <typename scalar_t, typename acc_t>
acc_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  constexpr int64_t kLanes = 8;
  acc_t partial[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane)
      partial[lane] += static_cast<acc_t>(a[d + lane]) * static_cast<acc_t>(b[d + lane]);
  }
  acc_t total = 0;
  for (; d < n; ++d)
    total += static_cast<acc_t>(a[d]) * static_cast<acc_t>(b[d]);
  for (int64_t lane = 0; lane < kLanes; ++lane)
    total += partial[lane];
  return total;
}

template <typename scalar_t, typename acc_t>
void decode_rows(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                 double scale, const std::vector<int64_t>& key_begin,
                 const std::vector<int64_t>& key_end, torch::Tensor& out) {
  const int64_t b = query.size(0), h = query.size(1), hd = query.size(3);
  const int64_t kv_heads = keys.size(1), m = keys.size(2), hd_v = values.size(3);
  const int64_t group = h / kv_heads;
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = keys.data_ptr<scalar_t>();
  const auto* v = values.data_ptr<scalar_t>();
  auto* o = out.data_ptr<scalar_t>();  // (b, 1, h, hd_v) contiguous
  const auto qs = query.strides(), ks = keys.strides(), vs = values.strides();
  // Enough keys per task that a thread's share is worth waking it for.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, m * (hd + hd_v)));
  at::parallel_for(0, b * h, grain, [&](int64_t first, int64_t last) {
    std::vector<acc_t> weights(static_cast<size_t>(m));
    std::vector<acc_t> context(static_cast<size_t>(hd_v));
    for (int64_t task = first; task < last; ++task) {
      const int64_t row = task / h, head = task % h, kv_head = head / group;
      const int64_t begin = key_begin.empty() ? 0 : key_begin[row];
      const int64_t end = key_end.empty() ? m : key_end[row];
      const scalar_t* q_row = q + row * qs[0] + head * qs[1];
      const scalar_t* k_head = k + row * ks[0] + kv_head * ks[1];
      const scalar_t* v_head = v + row * vs[0] + kv_head * vs[1];
      std::fill(context.begin(), context.end(), acc_t(0));
      acc_t max_score = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = begin; j < end; ++j) {
        weights[j] =
            dot<scalar_t, acc_t>(q_row, k_head + j * ks[2], hd) * static_cast<acc_t>(scale);
        max_score = std::max(max_score, weights[j]);
      }
      acc_t total = 0;
      for (int64_t j = begin; j < end; ++j) {
        weights[j] = std::exp(weights[j] - max_score);
        total += weights[j];
        const scalar_t* value = v_head + j * vs[2];
        for (int64_t d = 0; d < hd_v; ++d)
          context[d] += weights[j] * static_cast<acc_t>(value[d]);
      }
      // A row that sees no key gets zero weights, as in the math core.
      const acc_t inverse = end > begin ? acc_t(1) / total : acc_t(0);
      scalar_t* out_row = o + (row * h + head) * hd_v;
      for (int64_t d = 0; d < hd_v; ++d)
        out_row[d] = static_cast<scalar_t>(context[d] * inverse);
    }
  });
}

}  // namespace

bool decode_attention_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values) {
  const auto dtype = query.scalar_type();
  return query.device().is_cpu() && query.dim() == 4 && query.size(2) == 1 &&
         (dtype == torch::kFloat || dtype == torch::kDouble) && keys.scalar_type() == dtype &&
         values.scalar_type() == dtype && keys.device().is_cpu() && values.device().is_cpu() &&
         query.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 &&
         keys.size(1) >= 1 && query.size(1) % keys.size(1) == 0 &&
         !(torch::GradMode::is_enabled() &&
           (query.requires_grad() || keys.requires_grad() || values.requires_grad()));
}

torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& keys,
                               const torch::Tensor& values, double scale,
                               const std::vector<int64_t>& key_begin,
                               const std::vector<int64_t>& key_end) {
  TORCH_CHECK(decode_attention_fits(query, keys, values),
              "[decode_attention] expected one CPU float or double query per row, last "
              "dimensions contiguous, heads a multiple of the key heads and no autograd; got "
              "query ",
              query.sizes(), " ", query.scalar_type(), " on ", query.device(), ", keys ",
              keys.sizes());
  const int64_t b = query.size(0), h = query.size(1), m = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && values.size(0) == b && values.size(1) == keys.size(1) &&
                  values.size(2) == m && keys.size(3) == query.size(3),
              "[decode_attention] keys and values must be (", b, ", kv_heads, m, ", query.size(3),
              ") and (", b, ", kv_heads, m, hd_v), got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(key_begin.size() == key_end.size() &&
                  (key_begin.empty() || static_cast<int64_t>(key_begin.size()) == b),
              "[decode_attention] key_begin and key_end must both be empty or have ", b,
              " entries, got ", key_begin.size(), " and ", key_end.size());
  for (size_t r = 0; r < key_begin.size(); ++r) {
    TORCH_CHECK(0 <= key_begin[r] && key_end[r] <= m, "[decode_attention] row ", r, ": keys [",
                key_begin[r], ", ", key_end[r], ") must lie in [0, ", m, "]");
  }
  // (b, 1, h, hd_v) memory, returned as (b, h, 1, hd_v): merging the heads is then a view.
  auto out = torch::empty({b, 1, h, values.size(3)}, query.options());
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "decode_attention", [&] {
    decode_rows<scalar_t, scalar_t>(query, keys, values, scale, key_begin, key_end, out);
  });
  return out.transpose(1, 2);
}

}  // namespace attnkit::detail
