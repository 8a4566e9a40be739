#pragma once

// AVX2 + FMA helpers of attnkit's CPU kernels (loop_nest_kernel.cpp, few_rows_linear.cpp,
// decode_attention.cpp, row_softmax.h).
// Each function is compiled for those instructions on its own (target attribute), so the
// library still runs on any x86-64; callers take these paths only when has_avx2_fma().

#if defined(__GNUC__) && defined(__x86_64__)
#define ATTNKIT_HAVE_AVX2_KERNEL 1

#include <immintrin.h>

#include <cstdint>

namespace attnkit::detail {

inline bool has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Lanes [0, count) of a register (count <= 8), for the last partial block of a row.
__attribute__((target("avx2,fma"))) inline __m256i first_lanes(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lane t = the sum of the lanes of acc[t], for eight registers at once: a tree of
// horizontal adds, where eight horizontal_sum calls cost about five times the instructions.
__attribute__((target("avx2,fma"))) inline __m256 horizontal_sums_of_eight(const __m256* acc) {
  // Each 128-bit half of s0123 holds partial sums of registers 0-3 (low half: their low
  // lanes, high half: their high lanes); likewise s4567. Adding the halves finishes them.
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

}  // namespace attnkit::detail

#endif
