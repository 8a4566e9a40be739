// paged_prefill_attention: a prefill chunk's queries against their row's pages in tiles (see
// paged_prefill.h). Each task walks its row's pages in order; a page is one run of keys of
// a key head, contiguous, so it is a tile as it lies: no gather, no copy of the keys beyond
// float32's transposed tile and 16-bit's packed pairs for the micro-kernels.

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

// The products of 16-bit pages on the matrix units (matrix_units.h): 16-bit operands,
// float32 scores and sums. A page's run of keys, and of values, is packed in pairs of rows
// once per task and page: at a group of 4 heads and 64 queries, 1/256 of the product's work.
template <typename In>
struct SixteenBitProducts {
  std::vector<In> keys_t, values, weights;  // packed K^T, packed V, a block's rounded weights

  SixteenBitProducts(int64_t rows, int64_t hd, int64_t hd_v, int64_t page_size)
      : keys_t(static_cast<size_t>(hd * page_size)),
        values(static_cast<size_t>((page_size + 1) / 2 * 2 * hd_v)),
        weights(static_cast<size_t>(rows * ((page_size + 1) / 2 * 2))) {}

  // scores (rows x count) = queries (rows x hd) K^T, K (count x hd) with row stride ld_k.
  void scores(int64_t rows, int64_t count, int64_t hd, const In* queries, const In* keys,
              int64_t ld_k, float* out) {
    pack_pairs(keys, 1, ld_k, hd, count, count, keys_t.data());
    matmul_16bit(rows, count, hd, queries, hd, keys_t.data(), count, out, count, false);
  }

  // acc (rows x hd_v) += P V: P (rows x count) the float32 weights, rounded to In, V (count x
  // hd_v) with row stride ld_v.
  void add_weighted_values(int64_t rows, int64_t count, int64_t hd_v, const float* p,
                           const In* value_rows, int64_t ld_v, float* acc) {
    const int64_t paired = (count + 1) / 2 * 2;  // the units multiply pairs of keys
    for (int64_t r = 0; r < rows; ++r) {
      In* row = weights.data() + r * paired;
      round_row(p + r * count, count, row);
      if (paired != count)
        row[count] = In(0.0f);
    }
    pack_pairs(value_rows, ld_v, 1, count, hd_v, hd_v, values.data());
    matmul_16bit(rows, hd_v, paired, weights.data(), paired, values.data(), hd_v, acc, hd_v, true);
  }
};

// In: the pages' dtype; T: the arithmetic's (float32 for 16-bit pages, on the matrix units).
template <typename In>
void prefill_rows(const torch::Tensor& query, const torch::Tensor& key_pages,
                  const torch::Tensor& value_pages, const torch::Tensor& page_table,
                  const std::vector<int64_t>& key_begin, const std::vector<int64_t>& key_end,
                  double scale, double softcap, const std::vector<double>& sinks,
                  const ScoreVariant* score_variant, const Mask* mask, torch::Tensor& out) {
  using T = ComputeType<In>;
  const int64_t b = query.size(0), h = query.size(1), n = query.size(2), hd = query.size(3);
  const int64_t kv_heads = key_pages.size(1), page_size = key_pages.size(2);
  const int64_t hd_v = value_pages.size(3), group = h / kv_heads;
  const int64_t pages_per_row = page_table.size(1);
  const int64_t blocks = (n + kQueryBlock - 1) / kQueryBlock;
  const In* q = query.data_ptr<In>();
  const In* k = key_pages.data_ptr<In>();
  const In* v = value_pages.data_ptr<In>();
  const auto ks = key_pages.strides(), vs = value_pages.strides();
  const int64_t* table = page_table.data_ptr<int64_t>();
  In* o = out.data_ptr<In>();  // (b, h, n, hd_v)
  std::optional<RowScore<T>> score;
  if (score_variant != nullptr)
    score.emplace(*score_variant);
  const T cap = static_cast<T>(softcap);
  at::parallel_for(0, b * kv_heads * blocks, 1, [&](int64_t first_task, int64_t last_task) {
    const int64_t most_rows = group * kQueryBlock;
    std::vector<In> q_rows(static_cast<size_t>(most_rows * hd));
    std::vector<T> scores(static_cast<size_t>(most_rows * page_size));
    std::vector<T> acc(static_cast<size_t>(most_rows * hd_v));
    std::vector<T> running_max(static_cast<size_t>(most_rows)),
        running_sum(static_cast<size_t>(most_rows));
    std::vector<T> transposed(std::is_same_v<In, float> ? static_cast<size_t>(hd * page_size) : 0);
    std::optional<SixteenBitProducts<In>> units;
    if constexpr (kSixteenBit<In>)
      units.emplace(most_rows, hd, hd_v, page_size);
    std::unique_ptr<bool[]> allowed(mask != nullptr ? new bool[kQueryBlock * page_size] : nullptr);
    auto work = score ? score->workspace(page_size) : ScoreProgram::Workspace{};
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t row = task / (kv_heads * blocks), kv_head = task / blocks % kv_heads;
      const int64_t q0 = task % blocks * kQueryBlock, bq = std::min(kQueryBlock, n - q0);
      const int64_t rows = group * bq;  // product row g * bq + i: head kv_head * group + g
      const auto* task_begin = key_begin.data() + row * n + q0;
      const auto* task_end = key_end.data() + row * n + q0;
      for (int64_t g = 0; g < group; ++g) {
        const In* from = q + ((row * h + kv_head * group + g) * n + q0) * hd;
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
        const In* keys = k + page * ks[0] + kv_head * ks[1] + (first % page_size) * ks[2];
        const In* values = v + page * vs[0] + kv_head * vs[1] + (first % page_size) * vs[2];
        if constexpr (kSixteenBit<In>)
          units->scores(rows, count, hd, q_rows.data(), keys, ks[2], scores.data());
        else
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
        if constexpr (kSixteenBit<In>)
          units->add_weighted_values(rows, count, hd_v, scores.data(), values, vs[2], acc.data());
        else
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
          In* to = o + ((row * h + head) * n + q0 + i) * hd_v;
          for (int64_t d = 0; d < hd_v; ++d)  // rounded once to the pages' dtype
            to[d] = static_cast<In>(acc[r * hd_v + d] * inverse);
        }
      }
    }
    if constexpr (kSixteenBit<In>)
      release_matrix_units();
  });
}

}  // namespace

bool paged_prefill_fits(torch::ScalarType dtype, int64_t head_dim, int64_t queries) {
  // Below these the decode kernel's loop costs less (AMD EPYC, Llama 3 8B's heads: float32,
  // 4 queries took 1.38x the loop at 1k positions; bfloat16 on AVX-512 BF16 at 4k, 8 queries
  // 1.05x, 16 queries 0.83x).
  if (dtype == torch::kBFloat16 || dtype == torch::kHalf)
    return queries >= 16 && head_dim % 2 == 0 && cpu_16bit_matmul_lacks(dtype).empty();
  return queries >= 8 && (dtype == torch::kFloat || dtype == torch::kDouble);
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
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill_attention", [&] {
        prefill_rows<scalar_t>(query, key_pages, value_pages, page_table, key_begin, key_end, scale,
                               softcap, sinks, score, mask, out);
      });
  return out;
}

}  // namespace attnkit::detail
