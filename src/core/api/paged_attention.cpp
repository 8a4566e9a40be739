// paged_attention: the checks of a paged view against its queries, then the kernels reading
// the pages in place: the decode kernel (core/kernels/decode_attention.cpp), one query per
// task, or for a prefill chunk the tiles of core/kernels/paged_prefill.cpp where they fit.

#include "attnkit/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/block_mask.h"
#include "core/base/checks.h"
#include "core/kernels/decode_attention.h"
#include "core/kernels/paged_prefill.h"
#include "core/masks/mask_node.h"
#include "core/scores/row_variants.h"

namespace attnkit {

namespace {

using detail::shape_string;

std::string shape_or_undefined(const torch::Tensor& t) {
  return t.defined() ? shape_string(t) : std::string("undefined");
}

// An int64 tensor of `dims` dimensions on the CPU, `name` in the message.
void check_index_tensor(const char* fn, const char* name, const torch::Tensor& t, int64_t dims,
                        const char* expected_shape) {
  TORCH_CHECK(t.defined() && t.dim() == dims, fn, " ", name, ": expected ", expected_shape,
              ", got ", shape_or_undefined(t));
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.device().is_cpu(), fn, " ", name,
              " must be int64 on the CPU, got ", t.scalar_type(), " on ", t.device());
}

// Narrows each query's keys [begin, end) to the span of the kv blocks that `blocks` lists
// for the query's block (partial or full, any head): the keys outside it are masked for every
// head, so the kernels need not read their pages. A query it lists no block for sees no key
// (begin = end: zeros, as the mask gives). Queries are positions: task r * n + i is at
// end - 1.
void narrow_to_listed_blocks(const BlockMask& blocks, int64_t b, int64_t n,
                             std::vector<int64_t>& begin, std::vector<int64_t>& end) {
  const auto host = [](const torch::Tensor& t) {
    return t.to(torch::kCPU, torch::kInt64).contiguous();
  };
  const auto counts = host(blocks.kv_num_blocks()), indices = host(blocks.kv_indices());
  const auto full_counts = host(blocks.full_kv_num_blocks());
  const auto full_indices = host(blocks.full_kv_indices());
  const int64_t heads = blocks.heads(), nq = blocks.num_q_blocks(), nk = indices.size(3);
  const int64_t q_block = blocks.q_block_size(), kv_block = blocks.kv_block_size();
  for (int64_t r = 0; r < b; ++r) {
    const int64_t entry = blocks.batch() == 1 ? 0 : r;
    int64_t cached_block = -1, lo = 0, hi = 0;  // the last query block's listed span, in blocks
    for (int64_t i = 0; i < n; ++i) {
      const auto task = static_cast<size_t>(r * n + i);
      const int64_t query_block = (end[task] - 1) / q_block;
      if (query_block >= nq)
        continue;  // past the mask's queries: positions_problem has refused such a mask
      if (query_block != cached_block) {
        cached_block = query_block;
        lo = nk;
        hi = -1;
        for (int64_t head = 0; head < heads; ++head) {
          const int64_t at = (entry * heads + head) * nq + query_block;
          for (const auto& [count, index] :
               {std::pair{&counts, &indices}, std::pair{&full_counts, &full_indices}}) {
            const int64_t* listed = index->data_ptr<int64_t>() + at * nk;
            for (int64_t j = 0; j < count->data_ptr<int64_t>()[at]; ++j) {
              lo = std::min(lo, listed[j]);
              hi = std::max(hi, listed[j]);
            }
          }
        }
      }
      if (hi < 0) {
        begin[task] = end[task];
        continue;
      }
      begin[task] = std::min(end[task], std::max(begin[task], lo * kv_block));
      end[task] = std::max(begin[task], std::min(end[task], (hi + 1) * kv_block));
    }
  }
}

}  // namespace

torch::Tensor paged_attention(const torch::Tensor& query, const PagedKV& kv,
                              const PagedAttentionOptions& options) {
  const char* fn = "[attnkit::paged_attention]";
  TORCH_CHECK(query.defined() && query.dim() == 4 && query.size(2) >= 1, fn,
              " query: expected (batch, heads, n, head_dim) with n >= 1, got ",
              shape_or_undefined(query));
  const auto& keys = kv.key_pages;
  const auto& values = kv.value_pages;
  TORCH_CHECK(keys.defined() && keys.dim() == 4, fn,
              " key_pages: expected (num_pages, kv_heads, page_size, head_dim), got ",
              shape_or_undefined(keys));
  TORCH_CHECK(values.defined() && values.dim() == 4 && values.size(0) == keys.size(0) &&
                  values.size(1) == keys.size(1) && values.size(2) == keys.size(2),
              fn, " value_pages: expected (", keys.size(0), ", ", keys.size(1), ", ", keys.size(2),
              ", head_dim_v) like key_pages, got ", shape_or_undefined(values));
  TORCH_CHECK(keys.size(3) == query.size(3), fn, " key_pages' head_dim must be the query's (",
              query.size(3), "), got ", keys.size(3));
  const int64_t b = query.size(0), heads = query.size(1), kv_heads = keys.size(1);
  TORCH_CHECK(heads % kv_heads == 0, fn, " the query's ", heads,
              " heads must be a multiple of the pages' ", kv_heads, " key heads");
  TORCH_CHECK(query.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(), fn,
              " runs on the CPU; got query on ", query.device(), ", key_pages on ", keys.device(),
              ", value_pages on ", values.device());
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kBFloat16 ||
               dtype == torch::kHalf) &&
                  keys.scalar_type() == dtype && values.scalar_type() == dtype,
              fn,
              " query, key_pages and value_pages need one dtype of float32, float64, bfloat16 "
              "or float16, got ",
              dtype, ", ", keys.scalar_type(), " and ", values.scalar_type());
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, fn,
              " key_pages and value_pages need contiguous last dimensions");
  TORCH_CHECK(!(torch::GradMode::is_enabled() &&
                (query.requires_grad() || keys.requires_grad() || values.requires_grad())),
              fn,
              " records no autograd (a decode step is inference): call it under "
              "torch::NoGradGuard");
  check_index_tensor(fn, "page_table", kv.page_table, 2, "(batch, pages)");
  check_index_tensor(fn, "lengths", kv.lengths, 1, "(batch)");
  TORCH_CHECK(kv.page_table.size(0) == b && kv.lengths.size(0) == b, fn,
              " page_table and lengths need one row per query row (", b, "), got ",
              kv.page_table.size(0), " and ", kv.lengths.size(0));
  const double softcap = options.softcap();
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), fn, " softcap must be >= 0 (0: none), got ",
              softcap);
  TORCH_CHECK(options.window() >= 0, fn, " window must be >= 0 (0: none), got ", options.window());
  const double scale =
      options.scale().value_or(1.0 / std::sqrt(static_cast<double>(query.size(3))));
  TORCH_CHECK(std::isfinite(scale), fn, " scale must be finite, got ", scale);
  std::optional<detail::ScoreVariant> score;
  if (options.score_mod()) {
    TORCH_CHECK(softcap == 0.0, fn,
                " score_mod and softcap: give one (a softcap is a score function, "
                "score_mods::softcap)");
    // A C++ function is called on each row's tensors: slower than a named function or a
    // ScoreGraph, which the kernels evaluate in their own loops.
    score = detail::cpu_forward_score_variant(fn, options.score_mod(), heads);
  }
  const detail::ScoreVariant* variant = score ? &*score : nullptr;
  const Mask* mask = options.mask().is_none() ? nullptr : &options.mask();

  // Query i of row r is task r * n + i, whose keys are [begin, end): its causal end and the
  // window's begin. Every page a row's queries read is checked against the pool.
  const auto table = kv.page_table.contiguous();
  const auto lengths = kv.lengths.contiguous();
  const int64_t page_size = keys.size(2), num_pages = keys.size(0), row_pages = table.size(1);
  const int64_t n = query.size(2);
  const auto* entry = table.data_ptr<int64_t>();
  const auto* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> begin(static_cast<size_t>(b * n)), end(static_cast<size_t>(b * n));
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(length[r] >= n && length[r] <= row_pages * page_size, fn, " lengths[", r,
                "] must be in [", n, ", ", row_pages * page_size, "] (the ", n,
                " queries' positions, and at most the row's ", row_pages, " pages of ", page_size,
                " positions), got ", length[r]);
    for (int64_t i = 0; i < n; ++i) {
      const auto task = static_cast<size_t>(r * n + i);
      end[task] = length[r] - n + i + 1;
      begin[task] = options.window() > 0 ? std::max<int64_t>(0, end[task] - options.window()) : 0;
    }
    for (int64_t page = begin[static_cast<size_t>(r * n)] / page_size; page * page_size < length[r];
         ++page) {
      const int64_t index = entry[r * row_pages + page];
      TORCH_CHECK(index >= 0 && index < num_pages, fn, " page_table[", r, "][", page, "] = ", index,
                  " points outside the pool of ", num_pages, " pages");
    }
  }
  if (mask != nullptr) {
    const int64_t longest = *std::max_element(length, length + b);
    const auto [mask_queries, mask_keys] = detail::positions_problem(*mask, longest);
    mask->check(fn, b, heads, mask_queries, mask_keys, torch::kCPU);
    if (const BlockMask* blocks = mask->block_mask())
      narrow_to_listed_blocks(*blocks, b, n, begin, end);
  }
  if (n == 1) {
    return detail::paged_decode_attention(query.contiguous(), keys, values, table, begin, end,
                                          scale, softcap, options.sinks(), variant, mask);
  }
  if (detail::paged_prefill_fits(dtype, query.size(3), n)) {
    return detail::paged_prefill_attention(
        query.contiguous(), keys, values, table, begin, end, scale, softcap,
        detail::sink_values(options.sinks(), heads, fn), variant, mask);
  }
  // (b, h, n, hd) -> (b, n, h, hd) -> (b * n, h, 1, hd): a task per query, each with its row's
  // page table (the indices repeated, not the pages).
  const auto tasks = query.transpose(1, 2).contiguous().view({b * n, heads, 1, query.size(3)});
  const auto out =
      detail::paged_decode_attention(tasks, keys, values, table.repeat_interleave(n, 0), begin, end,
                                     scale, softcap, options.sinks(), variant, mask, n);
  // (b * n, h, 1, hd_v), laid out as (b * n, 1, h, hd_v) -> (b, n, h, hd_v) -> (b, h, n, hd_v)
  return out.transpose(1, 2).view({b, n, heads, values.size(3)}).transpose(1, 2);
}

}  // namespace attnkit
