// paged_prefill_attention: a prefill chunk's queries against their row's pages in tiles (see
// paged_prefill.h). Each task walks its row's pages in order; a page is one run of keys of
// a key head, contiguous, so it is a tile as it lies: no gather, no copy of the keys beyond
// float32's transposed tile for the micro-kernel.

#include "core/kernels/paged_prefill.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>

#include "core/base/matrix_units.h"
#include "core/kernels/fused_tiles.h"

namespace attnkit::detail {

namespace {

// Queries of a task: with a group of 4 query heads, 256 rows of the products.
constexpr int64_t kQueryBlock = 64;

// C (m x n) = A (m x k) B^T, B (n x k) with row stride ld_b; or, with `accumulate`,
// C (m x n) += A (m x k) B, B (k x n) with row stride ld_b. `transposed` is a float32 buffer
// of at least k * n for the first form.
template <typename T>
void product(int64_t m, int64_t n, int64_t k, const T* a, const T* b, int64_t ld_b, T* c,
             bool accumulate, std::vector<T>& transposed) {
  if constexpr (std::is_same_v<T, float>) {
    if (!accumulate) {  // B^T laid out (k x n) for the micro-kernel
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t d = 0; d < k; ++d)
          transposed[static_cast<size_t>(d * n + j)] = b[j * ld_b + d];
      }
      matmul_float32(m, n, k, a, k, transposed.data(), n, c, n, /*accumulate=*/false);
    } else {
      matmul_float32(m, n, k, a, k, b, ld_b, c, n, /*accumulate=*/true);
    }
  } else {
    const auto options = torch::TensorOptions(c10::CppTypeToScalarType<T>::value);
    const auto lhs = torch::from_blob(const_cast<T*>(a), {m, k}, options);
    auto out = torch::from_blob(c, {m, n}, options);
    if (!accumulate) {
      at::mm_out(out, lhs, torch::from_blob(const_cast<T*>(b), {n, k}, {ld_b, 1}, options).t());
    } else {
      out.addmm_(lhs, torch::from_blob(const_cast<T*>(b), {k, n}, {ld_b, 1}, options));
    }
  }
}

template <typename T>
void prefill_rows(const torch::Tensor& query, const torch::Tensor& key_pages,
                  const torch::Tensor& value_pages, const torch::Tensor& page_table,
                  const std::vector<int64_t>& key_begin, const std::vector<int64_t>& key_end,
                  double scale, double softcap, const std::vector<double>& sinks,
                  const ScoreVariant* score_variant, const Mask* mask, torch::Tensor& out) {
  const int64_t b = query.size(0), h = query.size(1), n = query.size(2), hd = query.size(3);
  const int64_t kv_heads = key_pages.size(1), page_size = key_pages.size(2);
  const int64_t hd_v = value_pages.size(3), group = h / kv_heads;
  const int64_t pages_per_row = page_table.size(1);
  const int64_t blocks = (n + kQueryBlock - 1) / kQueryBlock;
  const T* q = query.data_ptr<T>();
  const T* k = key_pages.data_ptr<T>();
  const T* v = value_pages.data_ptr<T>();
  const auto ks = key_pages.strides(), vs = value_pages.strides();
  const int64_t* table = page_table.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();  // (b, h, n, hd_v)
  std::optional<RowScore<T>> score;
  if (score_variant != nullptr)
    score.emplace(*score_variant);
  const T cap = static_cast<T>(softcap);
  at::parallel_for(0, b * kv_heads * blocks, 1, [&](int64_t first_task, int64_t last_task) {
    const int64_t most_rows = group * kQueryBlock;
    std::vector<T> q_rows(static_cast<size_t>(most_rows * hd));
    std::vector<T> scores(static_cast<size_t>(most_rows * page_size));
    std::vector<T> acc(static_cast<size_t>(most_rows * hd_v));
    std::vector<T> running_max(static_cast<size_t>(most_rows)),
        running_sum(static_cast<size_t>(most_rows));
    std::vector<T> transposed(std::is_same_v<T, float> ? static_cast<size_t>(hd * page_size) : 0);
    std::unique_ptr<bool[]> allowed(mask != nullptr ? new bool[kQueryBlock * page_size] : nullptr);
    auto work = score ? score->workspace(page_size) : ScoreProgram::Workspace{};
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t row = task / (kv_heads * blocks), kv_head = task / blocks % kv_heads;
      const int64_t q0 = task % blocks * kQueryBlock, bq = std::min(kQueryBlock, n - q0);
      const int64_t rows = group * bq;  // product row g * bq + i: head kv_head * group + g
      const auto* task_begin = key_begin.data() + row * n + q0;
      const auto* task_end = key_end.data() + row * n + q0;
      for (int64_t g = 0; g < group; ++g) {
        const T* from = q + ((row * h + kv_head * group + g) * n + q0) * hd;
        std::copy(from, from + bq * hd, q_rows.data() + g * bq * hd);
      }
      std::fill(acc.begin(), acc.begin() + rows * hd_v, T(0));
      std::fill(running_max.begin(), running_max.begin() + rows, minus_infinity<T>());
      std::fill(running_sum.begin(), running_sum.begin() + rows, T(0));
      // The block's keys: from its first query's window to its last query's position.
      const int64_t lo = *std::min_element(task_begin, task_begin + bq);
      const int64_t hi = *std::max_element(task_end, task_end + bq);
      for (int64_t first = lo; first < hi;) {
        const int64_t count = std::min(hi - first, page_size - first % page_size);
        const int64_t page = table[row * pages_per_row + first / page_size];
        const T* keys = k + page * ks[0] + kv_head * ks[1] + (first % page_size) * ks[2];
        const T* values = v + page * vs[0] + kv_head * vs[1] + (first % page_size) * vs[2];
        product(rows, count, hd, q_rows.data(), keys, ks[2], scores.data(), false, transposed);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = kv_head * group + g;
          if (mask != nullptr) {  // the block's queries are consecutive positions
            const Tile tile{row, head, 1, task_end[0] - 1, bq, first, count};
            if (!fill_tile(*mask, tile, allowed.get())) {
              const auto bits = mask->tile_allowed(tile, torch::kCPU)
                                    .to(torch::kBool)
                                    .expand({1, bq, count})
                                    .contiguous();
              std::copy(bits.data_ptr<bool>(), bits.data_ptr<bool>() + bq * count, allowed.get());
            }
          }
          for (int64_t i = 0; i < bq; ++i) {
            const int64_t r = g * bq + i;
            T* p = scores.data() + r * count;
            for (int64_t j = 0; j < count; ++j)
              p[j] *= static_cast<T>(scale);
            if (softcap > 0.0) {
              for (int64_t j = 0; j < count; ++j)
                p[j] = cap * std::tanh(p[j] / cap);
            }
            if (score)
              score->apply(p, count, row, head, task_end[i] - 1, first, work);
            for (int64_t j = 0; j < count; ++j) {
              const int64_t key = first + j;
              const bool seen = key >= task_begin[i] && key < task_end[i] &&
                                (mask == nullptr || allowed[i * count + j]);
              if (!seen)
                p[j] = minus_infinity<T>();
            }
            online_softmax_row(p, count, running_max[r], running_sum[r], acc.data() + r * hd_v,
                               hd_v, static_cast<const T*>(nullptr));
          }
        }
        product(rows, hd_v, count, scores.data(), values, vs[2], acc.data(), true, transposed);
        first += count;
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        for (int64_t i = 0; i < bq; ++i) {
          const int64_t r = g * bq + i;
          // The sink joins the denominator (its weight is dropped); a query that saw no key
          // (sum 0) gets zeros, as in the decode kernel.
          T total = running_sum[r];
          if (!sinks.empty() && total != 0)
            total += std::exp(static_cast<T>(sinks[head]) - running_max[r]);
          const T inverse = total != 0 ? 1 / total : 0;  // NaN: stays NaN
          T* to = o + ((row * h + head) * n + q0 + i) * hd_v;
          for (int64_t d = 0; d < hd_v; ++d)
            to[d] = acc[r * hd_v + d] * inverse;
        }
      }
    }
  });
}

}  // namespace

bool paged_prefill_fits(torch::ScalarType dtype) {
  return dtype == torch::kFloat || dtype == torch::kDouble;
}

torch::Tensor paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& key_pages,
                                      const torch::Tensor& value_pages,
                                      const torch::Tensor& page_table,
                                      const std::vector<int64_t>& key_begin,
                                      const std::vector<int64_t>& key_end, double scale,
                                      double softcap, const std::vector<double>& sinks,
                                      const ScoreVariant* score, const Mask* mask) {
  auto out = torch::empty({query.size(0), query.size(1), query.size(2), value_pages.size(3)},
                          query.options());
  if (query.scalar_type() == torch::kDouble) {
    prefill_rows<double>(query, key_pages, value_pages, page_table, key_begin, key_end, scale,
                         softcap, sinks, score, mask, out);
  } else {
    prefill_rows<float>(query, key_pages, value_pages, page_table, key_begin, key_end, scale,
                        softcap, sinks, score, mask, out);
  }
  return out;
}

}  // namespace attnkit::detail
