#pragma once

// The decode step's bfloat16 group on AVX-512 (decode_bf16.cpp): one key head's block of keys
// and values, read in place, against its group of query heads. The keys' dot products on
// AVX-512 BF16 (pairs of bfloat16 products summed in float32), the values widened to float32
// once for the whole group and summed with the group's contexts held in registers. Used by
// decode_attention.cpp's loop where decode_bf16_fits.

#include <cstdint>

#include <c10/util/BFloat16.h>

namespace attnkit::detail {

/// Whether these paths run here for head widths hd (queries, keys) and hd_v (values): the CPU
/// has AVX-512 BF16, ATTNKIT_CPU_16BIT_MATMUL is not float32, hd is a multiple of 32 and hd_v
/// of 64.
bool decode_bf16_fits(int64_t hd, int64_t hd_v);

/// scores[g * score_stride + j] = q_g . keys[j * key_stride] for g < group, j < count: q_g the
/// bfloat16 query at q + g * q_stride (hd), keys bfloat16 rows of hd.
void group_key_dots_bf16(const c10::BFloat16* q, int64_t q_stride, int64_t group, int64_t hd,
                         const c10::BFloat16* keys, int64_t key_stride, int64_t count,
                         float* scores, int64_t score_stride);

/// context[g * hd_v + d] += sum over j < count of weights[g * weight_stride + j] *
/// values[j * value_stride + d], for g < group and d < hd_v: float32 weights and contexts,
/// bfloat16 values.
void group_weighted_values_bf16(const float* weights, int64_t weight_stride, int64_t group,
                                const c10::BFloat16* values, int64_t value_stride, int64_t count,
                                int64_t hd_v, float* context);

}  // namespace attnkit::detail
