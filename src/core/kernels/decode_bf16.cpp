// The decode step's bfloat16 group on AVX-512 (decode_bf16.h).

#include "core/kernels/decode_bf16.h"

#include <algorithm>

#include "core/base/avx2.h"
#include "core/base/matrix_units.h"

namespace attnkit::detail {

#ifdef ATTNKIT_HAVE_AVX2_KERNEL

namespace {

#define ATTNKIT_AVX512_BF16 "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"

// 32 bfloat16 as the dot product instruction's operand.
__attribute__((target(ATTNKIT_AVX512_BF16), always_inline)) inline __m512bh load_pairs(
    const c10::BFloat16* x) {
  return (__m512bh)_mm512_loadu_si512(x);
}

// 16 bfloat16 as floats (a bfloat16 is a float's upper 16 bits).
__attribute__((target(ATTNKIT_AVX512_BF16), always_inline)) inline __m512 load_sixteen(
    const c10::BFloat16* x) {
  // The zero-masked forms: GCC 12's unmasked ones pass an undefined register that
  // -Wmaybe-uninitialized reports.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xFFFF, bits);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, wide, 16));
}

// A register's 16 lanes summed pairwise down to 8.
__attribute__((target(ATTNKIT_AVX512_BF16), always_inline)) inline __m256 halves_added(__m512 x) {
  return _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xFF, x, 0),
                       _mm512_maskz_extractf32x8_ps(0xFF, x, 1));
}

// Positions [0, 64) of the group's contexts: G heads x 4 registers held across the block's keys.
template <int G>
__attribute__((target(ATTNKIT_AVX512_BF16))) void weighted_values(
    const float* weights, int64_t weight_stride, const c10::BFloat16* values, int64_t value_stride,
    int64_t count, int64_t hd_v, float* context) {
  for (int64_t d = 0; d < hd_v; d += 64) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < 4; ++c)
        acc[g][c] = _mm512_loadu_ps(context + g * hd_v + d + 16 * c);
    }
    for (int64_t j = 0; j < count; ++j) {
      const c10::BFloat16* row = values + j * value_stride + d;
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

}  // namespace

bool decode_bf16_fits(int64_t hd, int64_t hd_v) {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16") && has_avx2_fma();
  return has && hd > 0 && hd % 32 == 0 && hd_v > 0 && hd_v % 64 == 0 &&
         cpu_16bit_forced_float32().empty();
}

__attribute__((target(ATTNKIT_AVX512_BF16))) void group_key_dots_bf16(
    const c10::BFloat16* q, int64_t q_stride, int64_t group, int64_t hd, const c10::BFloat16* keys,
    int64_t key_stride, int64_t count, float* scores, int64_t score_stride) {
  for (int64_t g = 0; g < group; ++g) {
    const c10::BFloat16* q_g = q + g * q_stride;
    float* out = scores + g * score_stride;
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {  // eight keys, their sums reduced together
      __m512 acc[8];
      for (int t = 0; t < 8; ++t)
        acc[t] = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 32) {
        const __m512bh qv = load_pairs(q_g + d);
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], qv, load_pairs(keys + (j + t) * key_stride + d));
      }
      __m256 halves[8];
      for (int t = 0; t < 8; ++t)
        halves[t] = halves_added(acc[t]);
      _mm256_storeu_ps(out + j, horizontal_sums_of_eight(halves));
    }
    for (; j < count; ++j) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < hd; d += 32)
        acc = _mm512_dpbf16_ps(acc, load_pairs(q_g + d), load_pairs(keys + j * key_stride + d));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, halves_added(acc));
      out[j] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
  }
}

void group_weighted_values_bf16(const float* weights, int64_t weight_stride, int64_t group,
                                const c10::BFloat16* values, int64_t value_stride, int64_t count,
                                int64_t hd_v, float* context) {
  // Up to 4 heads at a time: 16 registers of contexts, 4 of values, one of weights.
  for (int64_t g = 0; g < group; g += 4) {
    const float* w = weights + g * weight_stride;
    float* c = context + g * hd_v;
    switch (std::min<int64_t>(4, group - g)) {
      case 1:
        weighted_values<1>(w, weight_stride, values, value_stride, count, hd_v, c);
        break;
      case 2:
        weighted_values<2>(w, weight_stride, values, value_stride, count, hd_v, c);
        break;
      case 3:
        weighted_values<3>(w, weight_stride, values, value_stride, count, hd_v, c);
        break;
      default:
        weighted_values<4>(w, weight_stride, values, value_stride, count, hd_v, c);
    }
  }
}

#else  // no x86-64 GNU compiler: never fits, so never called

bool decode_bf16_fits(int64_t, int64_t) {
  return false;
}
void group_key_dots_bf16(const c10::BFloat16*, int64_t, int64_t, int64_t, const c10::BFloat16*,
                         int64_t, int64_t, float*, int64_t) {}
void group_weighted_values_bf16(const float*, int64_t, int64_t, const c10::BFloat16*, int64_t,
                                int64_t, int64_t, float*) {}

#endif

}  // namespace attnkit::detail
