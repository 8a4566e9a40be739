#pragma once

// The fused decode step's attention (decode_attention.cpp): one query token per row against
// cached keys and values, read in place, every head in one loop.

#include <vector>

#include <torch/torch.h>

#include "core/plan/kernel_spec.h"
#include "core/scores/row_variants.h"

namespace attnkit::detail {

KernelSpec decode_spec();  // the planner's table

/// Whether decode_attention takes these: one query per row, (b, h, 1, hd) on the CPU, float32,
/// float64, bfloat16 or float16 like the keys and values (16-bit ones read in place, the
/// arithmetic in float32, the result rounded once), last dimensions contiguous, h a multiple of the
/// key heads, and no autograd to record (the decode step runs under NoGradGuard).
bool decode_attention_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values);

/// softmax(scale * q k^T) v (with `softcap` > 0: softmax(softcap * tanh(scale * q k^T /
/// softcap)) v, Gemma 2's capped scores; with `sinks` (h), each head's sink in the softmax's
/// denominator with no value, GPT-OSS's attention sinks) for query (b, h, 1, hd) against keys (b,
/// kv_heads, m, hd) and values (b, kv_heads, m, hd_v), any strides but the last; query head i reads
/// key/value head i / (h / kv_heads). Row r sees keys [key_begin[r], key_end[r]) (every key when
/// both are empty); a row that sees none gets zeros. Returns (b, h, 1, hd_v), laid out as (b, 1, h,
/// hd_v) so that merging the heads is a view.
torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& keys,
                               const torch::Tensor& values, double scale,
                               const std::vector<int64_t>& key_begin = {},
                               const std::vector<int64_t>& key_end = {}, double softcap = 0.0,
                               const torch::Tensor& sinks = {});

/// `sinks` ((h) or undefined) as doubles, one per query head (empty: none); fails, naming
/// `fn`, on another shape.
std::vector<double> sink_values(const torch::Tensor& sinks, int64_t h, const char* fn);

/// decode_attention over a paged cache: key_pages (num_pages, kv_heads, page_size, hd) and
/// value_pages (num_pages, kv_heads, page_size, hd_v), read in place; row r's key j lies in page
/// page_table[r][j / page_size] (page_table (b, pages) int64, contiguous, on the CPU) at slot
/// j % page_size, and its query sees keys [key_begin[r], key_end[r]) (b entries each). The
/// caller has checked that every page read lies in the pool (paged_decode_attention in
/// core/api/paged_attention.cpp). With `score`, a score function on the scaled scores
/// (instead of a softcap), and with `mask` a mask besides [key_begin, key_end): b the row /
/// queries_per_row, h the query head, q_idx the query's position key_end[r] - 1, kv_idx the
/// key's position. A row whose mask allows no key gets zeros. Returns (b, h, 1, hd_v), laid out as
/// (b, 1, h, hd_v).
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_pages,
                                     const torch::Tensor& value_pages,
                                     const torch::Tensor& page_table,
                                     const std::vector<int64_t>& key_begin,
                                     const std::vector<int64_t>& key_end, double scale,
                                     double softcap = 0.0, const torch::Tensor& sinks = {},
                                     const ScoreVariant* score = nullptr,
                                     const Mask* mask = nullptr, int64_t queries_per_row = 1);

}  // namespace attnkit::detail
