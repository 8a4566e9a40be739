#pragma once

// Prefill chunks over a paged KV cache in tiles, as the fused tile kernel runs whole sequences:
// a block of queries against a page of keys at a time, by matrix products, instead of each
// query reading every page alone as a decode step does.

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "attnkit/mask.h"
#include "core/scores/row_variants.h"

namespace attnkit::detail {

/// Whether paged_prefill_attention runs chunks of `queries` per row over pages of `dtype` with
/// heads of `head_dim`, rather than the decode kernel a query at a time: float32 and float64
/// from 8 queries; bfloat16 and float16 from 16, where the CPU's matrix units multiply them
/// (matrix_units.h: LibTorch 2.x's brgemm) and head_dim is even. Elsewhere 16-bit pages stay
/// with the decode kernel, which reads them in place (tiles in float32 would convert every
/// page).
bool paged_prefill_fits(torch::ScalarType dtype, int64_t head_dim, int64_t queries);

/// n queries per row over paged storage: query (b, h, n, hd) contiguous, key_pages and
/// value_pages (num_pages, kv_heads, page_size, hd / hd_v) with contiguous rows, page_table
/// (b, pages) int64 on the CPU, every page a row reads checked to lie in the pool by the
/// caller. Query i of row r (task r * n + i) sees keys [key_begin, key_end) of its task, its
/// position key_end - 1; scores scaled, then capped (softcap > 0) or modified by `score`
/// (positions in the sequence, b the row), `mask` besides (b the row, q_idx and kv_idx
/// positions), and with `sinks` (h) a sink in each head's denominator. A query that sees no
/// key gets zeros. Returns (b, h, n, hd_v), equal to paged_decode_attention's to rounding.
///
/// A task is a row's key head with its group of query heads and a block of queries: their
/// scores against one page's run of keys by one product, the rows' score function, mask and
/// online softmax, and their weights times the run's values by another, accumulated in the
/// pages' dtype (16-bit pages: float32, the weights rounded to 16 bits for the product, the
/// output once).
torch::Tensor paged_prefill_attention(const torch::Tensor& query, const torch::Tensor& key_pages,
                                      const torch::Tensor& value_pages,
                                      const torch::Tensor& page_table,
                                      const std::vector<int64_t>& key_begin,
                                      const std::vector<int64_t>& key_end, double scale,
                                      double softcap, const std::vector<double>& sinks,
                                      const ScoreVariant* score, const Mask* mask);

}  // namespace attnkit::detail
