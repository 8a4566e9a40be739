// Why: a decode step multiplies each weight matrix by one row (or a batch's few), so it is
// bound by reading the weights. OpenBLAS's GEMV read GPT-2 small's weights at 11-13 GB/s on
// one thread here, this loop at 17 GB/s and more; and OpenBLAS's GEMM at 8 rows packs the
// weight each call and ran no faster per row than 8 GEMVs. Here each weight row is loaded
// once, with independent sums for every row of x, which stays in cache.

#include "modules/few_rows_linear.h"

#include <ATen/Parallel.h>

#include "core/base/avx2.h"

namespace attnkit::detail {

namespace {

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// How far ahead of its loads the kernel prefetches the weight stream, in floats. Past the
// end of the weight it prefetches nothing useful, and a prefetch never faults.
constexpr int64_t kPrefetchAhead = 512;

// y[r][n] = bias[n] + x[r] . w[n] for r < kRows, n in [n_begin, n_end): one accumulator per
// row of x, each weight block loaded once for all of them.
template <int kRows>
__attribute__((target("avx2,fma"))) void rows_times_weight_avx2(const float* x, int64_t in,
                                                                const float* w, const float* bias,
                                                                int64_t n_begin, int64_t n_end,
                                                                int64_t out, float* y) {
  const int64_t whole = in / 8 * 8;
  const __m256i tail = first_lanes(in - whole);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* w_row = w + n * in;
    __m256 acc[kRows];
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < whole; k += 8) {
      // With several rows of x the loop computes long enough per weight row that the
      // hardware prefetcher falls behind; asking for the stream 2 KB ahead (one cache line
      // per two steps) took 8 rows from 6-7 to 10 GB/s of weights read from memory.
      if constexpr (kRows > 1) {
        if (k % 16 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(w_row + k + kPrefetchAhead), _MM_HINT_T0);
      }
      const __m256 wv = _mm256_loadu_ps(w_row + k);
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * in + k), wv, acc[r]);
    }
    if (whole < in) {
      const __m256 wv = _mm256_maskload_ps(w_row + whole, tail);
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * in + whole, tail), wv, acc[r]);
    }
    const float b = bias ? bias[n] : 0.0f;
    if constexpr (kRows == 8) {
      // At short rows (a toy model's 64) the eight horizontal sums cost as much as the
      // multiply-adds; reduced together they are one register.
      alignas(32) float sums[8];
      _mm256_store_ps(sums, horizontal_sums_of_eight(acc));
      for (int r = 0; r < kRows; ++r)
        y[r * out + n] = sums[r] + b;
    } else {
      for (int r = 0; r < kRows; ++r)
        y[r * out + n] = horizontal_sum(acc[r]) + b;
    }
  }
}

// kRows as a template argument, so the accumulators live in registers.
template <int kRows = 8>
void rows_times_weight(int rows, const float* x, int64_t in, const float* w, const float* bias,
                       int64_t n_begin, int64_t n_end, int64_t out, float* y) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      rows_times_weight<kRows - 1>(rows, x, in, w, bias, n_begin, n_end, out, y);
      return;
    }
  }
  rows_times_weight_avx2<kRows>(x, in, w, bias, n_begin, n_end, out, y);
}
#endif

// Weight rows per task of at::parallel_for (one task on one thread).
constexpr int64_t kWeightRowsPerTask = 256;

}  // namespace

torch::Tensor few_rows_linear_if_fits(const torch::Tensor& x, const torch::Tensor& weight,
                                      const torch::Tensor& bias) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  const bool records_history =
      torch::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!has_avx2_fma() || records_history || x.dim() < 1 || weight.dim() != 2 ||
      !x.device().is_cpu() || !weight.device().is_cpu() || x.scalar_type() != torch::kFloat ||
      weight.scalar_type() != torch::kFloat || !weight.is_contiguous() ||
      x.size(-1) != weight.size(1) ||
      (bias.defined() && (bias.scalar_type() != torch::kFloat || !bias.device().is_cpu() ||
                          bias.dim() != 1 || bias.size(0) != weight.size(0)))) {
    return {};
  }
  const int64_t in = weight.size(1), out = weight.size(0);
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (rows < 1 || rows > kFewRowsMax)
    return {};
  const auto x_rows = x.reshape({rows, in}).contiguous();  // (rows, in)
  const auto bias_values = bias.defined() ? bias.contiguous() : torch::Tensor();
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x_rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias_values.defined() ? bias_values.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, kWeightRowsPerTask, [&](int64_t n_begin, int64_t n_end) {
    // Rows of x in groups of at most 8: one register of sums each.
    for (int64_t first = 0; first < rows; first += 8) {
      const int count = static_cast<int>(std::min<int64_t>(8, rows - first));
      rows_times_weight(count, xp + first * in, in, wp, bp, n_begin, n_end, out, yp + first * out);
    }
  });
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return y.view(sizes);
#else
  (void)x, (void)weight, (void)bias;
  return {};
#endif
}

}  // namespace attnkit::detail
