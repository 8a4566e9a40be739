#pragma once

// The decode step's group of query heads on AVX-512 (decode_avx512.cpp): one key head's block
// of keys and values, read in place, against its group of query heads, for float32 and
// bfloat16 caches. The keys' dot products eight keys at a time (bfloat16: on AVX-512 BF16,
// pairs of exact products summed in float32), the values (bfloat16: widened to float32 once
// for the whole group) summed with the group's contexts held in registers. Used by
// decode_attention.cpp's loop where decode_avx512_fits.

#include <algorithm>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <torch/torch.h>

namespace attnkit::detail {

/// The next block of keys or values, to bring into L2 while a block is read: each row read
/// prefetches the next block's row of the same index (the last row, the rest). Why: the hardware
/// prefetcher follows a stream, and ramps up too late in a paged cache's short runs, whose pages
/// lie anywhere in the pool, and even in a contiguous cache's long one it fell behind (AMD EPYC,
/// a contiguous cache's bfloat16 step at 4k positions read from memory: 0.60x the time
/// without; docs/inference.md). Spread among the arithmetic, not issued at once: 128
/// prefetches in a burst filled the miss buffers and stalled the step. No data: nothing to
/// fetch.
struct PrefetchAhead {
  const char* data = nullptr;                       // the next block's first row
  int64_t rows = 0, row_stride = 0, row_bytes = 0;  // strides and widths in bytes

  /// Prefetches the rows that go with rows [from, to) of a block of `count` being read.
  void with_rows(int64_t from, int64_t to, int64_t count) const {
    const int64_t last = to >= count ? rows : std::min(rows, to);
    for (int64_t row = from; row < last; ++row) {
      const auto start = reinterpret_cast<std::uintptr_t>(data + row * row_stride);
      for (auto line = start & ~std::uintptr_t{63}; line < start + row_bytes; line += 64) {
#ifdef __x86_64__
        // Locality 2 (prefetcht1): into L2. GCC 12's dead-code elimination dropped
        // __builtin_prefetch inlined into the kernels' loops; an asm statement stays.
        asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(line)));
#else
        __builtin_prefetch(reinterpret_cast<const char*>(line), 0, 2);
#endif
      }
    }
  }
};

/// Whether these paths run here for a cache of `dtype` with head widths hd (queries, keys)
/// and hd_v (values): float32 on AVX-512 (F, BW, VL, DQ) with hd a multiple of 16;
/// bfloat16 on AVX-512 BF16 as well, hd a multiple of 32, and ATTNKIT_CPU_16BIT_MATMUL not
/// float32; hd_v a multiple of 64 for both.
bool decode_avx512_fits(torch::ScalarType dtype, int64_t hd, int64_t hd_v);

/// scores[g * score_stride + j] = q_g . keys[j * key_stride] for g < group, j < count: q_g the
/// query at q + g * q_stride (hd), keys rows of hd; fetches `ahead` as it reads the keys.
void group_key_dots_avx512(const float* q, int64_t q_stride, int64_t group, int64_t hd,
                           const float* keys, int64_t key_stride, int64_t count, float* scores,
                           int64_t score_stride, const PrefetchAhead& ahead = {});
void group_key_dots_avx512(const c10::BFloat16* q, int64_t q_stride, int64_t group, int64_t hd,
                           const c10::BFloat16* keys, int64_t key_stride, int64_t count,
                           float* scores, int64_t score_stride, const PrefetchAhead& ahead = {});

/// context[g * hd_v + d] += sum over j < count of weights[g * weight_stride + j] *
/// values[j * value_stride + d], for g < group and d < hd_v: float32 weights and contexts;
/// fetches `ahead` as it reads the values. In: float or c10::BFloat16.
template <typename In>
void group_weighted_values_avx512(const float* weights, int64_t weight_stride, int64_t group,
                                  const In* values, int64_t value_stride, int64_t count,
                                  int64_t hd_v, float* context, const PrefetchAhead& ahead = {});

}  // namespace attnkit::detail
