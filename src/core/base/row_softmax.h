#pragma once

// Operations on one row of scores, shared by attnkit's CPU attention kernels (the loop-nest
// kernel in loop_nest_kernel.cpp, the decode step in decode_attention.cpp, the fused tile
// kernel in fused_tiles.cpp): softmax, dot product, maximum, shifted exponentials, softcap.
// AVX2 for float where the CPU has it (core/base/avx2.h), a portable loop otherwise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "core/base/avx2.h"

namespace attnkit::detail {

template <typename T>
T minus_infinity() {
  return -std::numeric_limits<T>::infinity();
}

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// Floats per AVX2 register.
constexpr int64_t kLanes = 8;

// e^x for x <= 0 (every softmax argument is), eight at a time, after Cephes' expf:
// x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 polynomial, 2^k in the exponent
// bits. Within 2 ulp of std::exp; arguments below -87.3 give about 1e-38 instead of 0. NaN
// gives NaN (maxps returns its second operand when one is NaN).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp_nonpositive_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k ln2, with ln2 in two parts so that k * ln2_high is exact.
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_to_k =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_to_k));
}

// tanh(x) = sign(x) (1 - e) / (1 + e), e = e^(-2 |x|): within about 1e-7 of it absolutely
// (the softcap's and score programs' tanh in float32).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 tanh_avx2(__m256 x) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 e =
      exp_nonpositive_avx2(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), _mm256_set1_ps(-2.0f)));
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(sign_bit, x));
}

// The row's largest number (NaN entries are passed over: the exponential keeps them, so
// they reach the weights and the sum).
__attribute__((target("avx2,fma"))) inline float row_max_avx2(const float* s, int64_t count) {
  __m256 max8 = _mm256_set1_ps(minus_infinity<float>());
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes)
    max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + j));
  float result = minus_infinity<float>();
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, max8);
  for (const float lane : lanes)
    result = std::max(result, lane);
  for (; j < count; ++j)
    result = std::max(result, s[j]);
  return result;
}

__attribute__((target("avx2,fma"))) inline void softmax_row_avx2(const float* scores, int64_t count,
                                                                 float scale, float* p) {
  const __m256 row_max = _mm256_set1_ps(row_max_avx2(scores, count)),
               scale8 = _mm256_set1_ps(scale);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const __m256 e = exp_nonpositive_avx2(
        _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), row_max), scale8));
    _mm256_storeu_ps(p + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  if (j < count) {
    const __m256i lanes = first_lanes(count - j);
    const __m256 e =
        _mm256_and_ps(exp_nonpositive_avx2(_mm256_mul_ps(
                          _mm256_sub_ps(_mm256_maskload_ps(scores + j, lanes), row_max), scale8)),
                      _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(p + j, lanes, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / horizontal_sum(sum8));
  for (j = 0; j + kLanes <= count; j += kLanes)
    _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), inverse));
  for (; j < count; ++j)
    p[j] *= _mm_cvtss_f32(_mm256_castps256_ps128(inverse));
}

__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* a, const float* b,
                                                          int64_t count) {
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes)
    sum8 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), sum8);
  if (j < count) {
    const __m256i lanes = first_lanes(count - j);
    sum8 =
        _mm256_fmadd_ps(_mm256_maskload_ps(a + j, lanes), _mm256_maskload_ps(b + j, lanes), sum8);
  }
  return horizontal_sum(sum8);
}
#endif

// The row's largest number, -inf if it has none (NaN entries are passed over: the
// exponentials below keep them).
template <typename T>
T row_max(const T* s, int64_t count) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma())
      return row_max_avx2(s, count);
  }
#endif
  T result = minus_infinity<T>();
  for (int64_t j = 0; j < count; ++j)
    result = std::max(result, s[j]);
  return result;
}

// p[0, count) = softmax(scores[0, count) * scale): a NaN score makes the row NaN (its
// exponential is NaN, and so is the sum).
template <typename T>
void softmax_row(const T* scores, int64_t count, T scale, T* p) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma()) {
      softmax_row_avx2(scores, count, scale, p);
      return;
    }
  }
#endif
  const T top = row_max(scores, count);
  T sum = 0;
  for (int64_t j = 0; j < count; ++j) {
    p[j] = std::exp((scores[j] - top) * scale);
    sum += p[j];
  }
  const T inverse = T(1) / sum;
  for (int64_t j = 0; j < count; ++j)
    p[j] *= inverse;
}

template <typename T>
T dot(const T* a, const T* b, int64_t count) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma())
      return dot_avx2(a, b, count);
  }
#endif
  T sum = 0;
  for (int64_t j = 0; j < count; ++j)
    sum += a[j] * b[j];
  return sum;
}

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// e^x, exactly 0 for x below -87.3 (and -inf): a masked score contributes nothing. NaN stays
// NaN (the comparison is unordered-true).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp_or_zero_avx2(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_NLE_UQ);
  return _mm256_and_ps(exp_nonpositive_avx2(x), live);
}

__attribute__((target("avx2,fma"))) inline float exp_shifted_avx2(float* s, int64_t count,
                                                                  float shift) {
  const __m256 shift8 = _mm256_set1_ps(shift);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const __m256 e = exp_or_zero_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift8));
    _mm256_storeu_ps(s + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  if (j < count) {
    const __m256i lanes = first_lanes(count - j);
    const __m256 e =
        _mm256_and_ps(exp_or_zero_avx2(_mm256_sub_ps(_mm256_maskload_ps(s + j, lanes), shift8)),
                      _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(s + j, lanes, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  return horizontal_sum(sum8);
}

// s = cap tanh(s / cap).
__attribute__((target("avx2,fma"))) inline void softcap_avx2(float* s, int64_t count, float cap) {
  const __m256 inverse = _mm256_set1_ps(1.0f / cap), cap8 = _mm256_set1_ps(cap);
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) {
    const __m256 t = tanh_avx2(_mm256_mul_ps(_mm256_loadu_ps(s + j), inverse));
    _mm256_storeu_ps(s + j, _mm256_mul_ps(t, cap8));
  }
  for (; j < count; ++j)
    s[j] = cap * std::tanh(s[j] / cap);
}
#endif

// s = e^(s - shift) (0 where s is -inf); returns the row's sum.
template <typename T>
T exp_shifted(T* s, int64_t count, T shift) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma())
      return exp_shifted_avx2(s, count, shift);
  }
#endif
  T sum = 0;
  for (int64_t j = 0; j < count; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

template <typename T>
void softcap_row(T* s, int64_t count, T cap) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma()) {
      softcap_avx2(s, count, cap);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < count; ++j)
    s[j] = cap * std::tanh(s[j] / cap);
}

}  // namespace attnkit::detail
