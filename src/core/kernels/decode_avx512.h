#pragma once

// The decode step's group of query heads on AVX-512 (decode_avx512.cpp): one key head's block
// of keys and values, read in place, against its group of query heads, for float32 and
// bfloat16 caches. The keys' dot products eight keys at a time (bfloat16: on AVX-512 BF16,
// pairs of exact products summed in float32), the values (bfloat16: widened to float32 once
// for the whole group) summed with the group's contexts held in registers. Used by
// decode_attention.cpp's loop where decode_avx512_fits.

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <torch/torch.h>

namespace attnkit::detail {

/// Whether these paths run here for a cache of `dtype` with head widths hd (queries, keys)
/// and hd_v (values): float32 on AVX-512 (F, BW, VL, DQ) with hd a multiple of 16;
/// bfloat16 on AVX-512 BF16 as well, hd a multiple of 32, and ATTNKIT_CPU_16BIT_MATMUL not
/// float32; hd_v a multiple of 64 for both.
bool decode_avx512_fits(torch::ScalarType dtype, int64_t hd, int64_t hd_v);

/// scores[g * score_stride + j] = q_g . keys[j * key_stride] for g < group, j < count: q_g the
/// query at q + g * q_stride (hd), keys rows of hd.
void group_key_dots_avx512(const float* q, int64_t q_stride, int64_t group, int64_t hd,
                           const float* keys, int64_t key_stride, int64_t count, float* scores,
                           int64_t score_stride);
void group_key_dots_avx512(const c10::BFloat16* q, int64_t q_stride, int64_t group, int64_t hd,
                           const c10::BFloat16* keys, int64_t key_stride, int64_t count,
                           float* scores, int64_t score_stride);

/// context[g * hd_v + d] += sum over j < count of weights[g * weight_stride + j] *
/// values[j * value_stride + d], for g < group and d < hd_v: float32 weights and contexts.
/// In: float or c10::BFloat16.
template <typename In>
void group_weighted_values_avx512(const float* weights, int64_t weight_stride, int64_t group,
                                  const In* values, int64_t value_stride, int64_t count,
                                  int64_t hd_v, float* context);

}  // namespace attnkit::detail
