// The decode step's group of query heads on AVX-512 (decode_avx512.h).

#include "core/kernels/decode_avx512.h"

#include <algorithm>

#include "core/base/avx2.h"
#include "core/base/matrix_units.h"

namespace attnkit::detail {

#ifdef ATTNKIT_HAVE_AVX2_KERNEL

namespace {

#define ATTNKIT_AVX512 "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq"
#define ATTNKIT_AVX512_BF16 ATTNKIT_AVX512 ",avx512bf16"

// 16 elements as floats (a bfloat16 is a float's upper 16 bits). The zero-masked forms:
// GCC 12's unmasked ones pass an undefined register that -Wmaybe-uninitialized reports.
__attribute__((target(ATTNKIT_AVX512), always_inline)) inline __m512 load_sixteen(const float* x) {
  return _mm512_loadu_ps(x);
}
__attribute__((target(ATTNKIT_AVX512), always_inline)) inline __m512 load_sixteen(
    const c10::BFloat16* x) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xFFFF, bits);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, wide, 16));
}

// A register's 16 lanes summed pairwise down to 8.
__attribute__((target(ATTNKIT_AVX512), always_inline)) inline __m256 halves_added(__m512 x) {
  return _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xFF, x, 0),
                       _mm512_maskz_extractf32x8_ps(0xFF, x, 1));
}

// The sum of a register's 16 lanes.
__attribute__((target(ATTNKIT_AVX512), always_inline)) inline float lanes_summed(__m512 x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, halves_added(x));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// acc += q . key over one register's worth of features at d: 16 floats, or 32 bfloat16 as
// 16 pairs of exact products.
__attribute__((target(ATTNKIT_AVX512), always_inline)) inline __m512 dot_step(__m512 acc,
                                                                              const float* q,
                                                                              const float* key) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key), acc);
}
__attribute__((target(ATTNKIT_AVX512_BF16), always_inline)) inline __m512 dot_step(
    __m512 acc, const c10::BFloat16* q, const c10::BFloat16* key) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(key));
}

template <typename In>
constexpr int64_t kStep = 64 / static_cast<int64_t>(sizeof(In));  // features per dot_step

// Positions [0, hd_v) of G heads' contexts, 64 at a time: G x 4 registers held across the
// block's keys.
template <int G, typename In>
__attribute__((target(ATTNKIT_AVX512))) void weighted_values(
    const float* weights, int64_t weight_stride, const In* values, int64_t value_stride,
    int64_t count, int64_t hd_v, float* context, const PrefetchAhead& ahead) {
  for (int64_t d = 0; d < hd_v; d += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < 4; ++c)
        acc[g][c] = _mm512_loadu_ps(context + g * hd_v + d + 16 * c);
    }
    for (int64_t j = 0; j < count; ++j) {
      if (d == 0)  // the first pass over the rows
        ahead.with_rows(j, j + 1, count);
      const In* row = values + j * value_stride + d;
      __m512 v[4];
      for (int c = 0; c < 4; ++c)
        v[c] = load_sixteen(row + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g * weight_stride + j]);
        for (int c = 0; c < 4; ++c)
          acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(context + g * hd_v + d + 16 * c, acc[g][c]);
    }
  }
}

// group_key_dots_avx512, compiled with AVX-512 BF16 for both dtypes: the float32 instantiation has
// no bfloat16 to convert, so it uses none of its instructions (decode_avx512_fits asks for them
// only for bfloat16).
template <typename In>
__attribute__((target(ATTNKIT_AVX512_BF16))) void key_dots(
    const In* q, int64_t q_stride, int64_t group, int64_t hd, const In* keys, int64_t key_stride,
    int64_t count, float* scores, int64_t score_stride, const PrefetchAhead& ahead) {
  for (int64_t g = 0; g < group; ++g) {
    const In* q_g = q + g * q_stride;
    float* out = scores + g * score_stride;
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {  // eight keys, their sums reduced together
      if (g == 0)                     // the first pass over the keys
        ahead.with_rows(j, j + 8, count);
      __m512 acc[8];
      for (int t = 0; t < 8; ++t)
        acc[t] = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += kStep<In>) {
        for (int t = 0; t < 8; ++t)
          acc[t] = dot_step(acc[t], q_g + d, keys + (j + t) * key_stride + d);
      }
      __m256 halves[8];
      for (int t = 0; t < 8; ++t)
        halves[t] = halves_added(acc[t]);
      _mm256_storeu_ps(out + j, horizontal_sums_of_eight(halves));
    }
    for (; j < count; ++j) {
      if (g == 0)
        ahead.with_rows(j, j + 1, count);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += kStep<In>)
        acc = dot_step(acc, q_g + d, keys + j * key_stride + d);
      out[j] = lanes_summed(acc);
    }
  }
}

bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") && has_avx2_fma();
  return has;
}

}  // namespace

bool decode_avx512_fits(torch::ScalarType dtype, int64_t hd, int64_t hd_v) {
  if (!has_avx512() || hd <= 0 || hd_v <= 0 || hd_v % 64 != 0)
    return false;
  if (dtype == torch::kFloat)
    return hd % 16 == 0;
  static const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  return dtype == torch::kBFloat16 && has_bf16 && hd % 32 == 0 &&
         cpu_16bit_forced_float32().empty();
}

void group_key_dots_avx512(const float* q, int64_t q_stride, int64_t group, int64_t hd,
                           const float* keys, int64_t key_stride, int64_t count, float* scores,
                           int64_t score_stride, const PrefetchAhead& ahead) {
  key_dots(q, q_stride, group, hd, keys, key_stride, count, scores, score_stride, ahead);
}

void group_key_dots_avx512(const c10::BFloat16* q, int64_t q_stride, int64_t group, int64_t hd,
                           const c10::BFloat16* keys, int64_t key_stride, int64_t count,
                           float* scores, int64_t score_stride, const PrefetchAhead& ahead) {
  key_dots(q, q_stride, group, hd, keys, key_stride, count, scores, score_stride, ahead);
}

template <typename In>
void group_weighted_values_avx512(const float* weights, int64_t weight_stride, int64_t group,
                                  const In* values, int64_t value_stride, int64_t count,
                                  int64_t hd_v, float* context, const PrefetchAhead& ahead) {
  // Up to 4 heads at a time: 16 registers of contexts, 4 of values, one of weights.
  for (int64_t g = 0; g < group; g += 4) {
    const float* w = weights + g * weight_stride;
    float* c = context + g * hd_v;
    const PrefetchAhead once = g == 0 ? ahead : PrefetchAhead{};  // in the first group's pass
    switch (std::min<int64_t>(4, group - g)) {
      case 1:
        weighted_values<1>(w, weight_stride, values, value_stride, count, hd_v, c, once);
        break;
      case 2:
        weighted_values<2>(w, weight_stride, values, value_stride, count, hd_v, c, once);
        break;
      case 3:
        weighted_values<3>(w, weight_stride, values, value_stride, count, hd_v, c, once);
        break;
      default:
        weighted_values<4>(w, weight_stride, values, value_stride, count, hd_v, c, once);
    }
  }
}

#else  // no x86-64 GNU compiler: never fits, so never called

bool decode_avx512_fits(torch::ScalarType, int64_t, int64_t) {
  return false;
}
void group_key_dots_avx512(const float*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                           float*, int64_t, const PrefetchAhead&) {}
void group_key_dots_avx512(const c10::BFloat16*, int64_t, int64_t, int64_t, const c10::BFloat16*,
                           int64_t, int64_t, float*, int64_t, const PrefetchAhead&) {}
template <typename In>
void group_weighted_values_avx512(const float*, int64_t, int64_t, const In*, int64_t, int64_t,
                                  int64_t, float*, const PrefetchAhead&) {}

#endif

template void group_weighted_values_avx512<float>(const float*, int64_t, int64_t, const float*,
                                                  int64_t, int64_t, int64_t, float*,
                                                  const PrefetchAhead&);
template void group_weighted_values_avx512<c10::BFloat16>(const float*, int64_t, int64_t,
                                                          const c10::BFloat16*, int64_t, int64_t,
                                                          int64_t, float*, const PrefetchAhead&);

}  // namespace attnkit::detail
