#pragma once

/// Attention over a paged KV cache: what a kernel sees of one (`PagedKV`), apart from the
/// storage that owns the pages (`attnkit::PagedKVCache`, paged_kv_cache.h, or a pool of your
/// own). As in FlashInfer's paged caches and vLLM's block tables, a sequence's positions lie
/// in fixed-size pages of one pool, in any order: row r's key j is in page page_table[r][j /
/// page_size], at slot j % page_size. The kernels read the pages where they lie; nothing is
/// gathered into a contiguous copy.

#include <cstdint>

#include <torch/torch.h>

#include "attnkit/mask.h"
#include "attnkit/score_mod.h"

namespace attnkit {

/// The pages a batch of sequences reads: a view, which owns nothing.
struct PagedKV {
  /// (num_pages, kv_heads, page_size, head_dim): the pool's keys.
  torch::Tensor key_pages;
  /// (num_pages, kv_heads, page_size, head_dim_v): the pool's values.
  torch::Tensor value_pages;
  /// (batch, pages) int64 on the CPU: row r's pages in order. Entries past a row's length, and
  /// those of pages a window no longer reads, are not read (-1 by convention).
  torch::Tensor page_table;
  /// (batch) int64 on the CPU: the positions each row holds, its own query's included.
  torch::Tensor lengths;
};

/// Options of `paged_attention`.
/// Example: `PagedAttentionOptions().window(4096).softcap(50.0)`.
struct PagedAttentionOptions {
  /// Multiplies q k^T; unset: 1 / sqrt(head_dim).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// > 0: the scores are capped, softcap * tanh(score / softcap) (Gemma 2); 0: none.
  TORCH_ARG(double, softcap) = 0.0;
  /// > 0: each query sees its own position and the window - 1 before it (sliding-window
  /// attention); pages wholly before that are not read, so a rolling cache may free them.
  TORCH_ARG(int64_t, window) = 0;
  /// (heads): each head's attention sink in the softmax's denominator (GPT-OSS); undefined:
  /// none.
  TORCH_ARG(torch::Tensor, sinks);
  /// A score function on the scaled scores, score_mod(score, b, h, q_idx, kv_idx) with b the
  /// row, h the query head and q_idx, kv_idx the query's and the key's positions in the row's
  /// sequence (as in training): ALiBi, a relative bias, a score graph
  /// (docs/masks.md, "Score functions"). Not with softcap (a softcap is one: give it there or
  /// here). A C++ function is called on each query's row of scores per head (a few LibTorch ops
  /// each: slower than those the kernels evaluate in their own loops).
  TORCH_ARG(ScoreMod, score_mod);
  /// A mask besides the causal one and the window, at the same indices as score_mod (b the
  /// row, q_idx and kv_idx positions in the row's sequence): documents, key padding, a
  /// mask_mod, a block mask (docs/masks.md). It is checked against a problem of the longest
  /// row's positions [0, max lengths), or of the whole sequence it was made for (documents'
  /// ids, a block mask's length, a tensor's size: at least those positions). Named kinds are
  /// read from their host form, others evaluated as tensors per query and head (a block
  /// mask: its inner mask, over the span of kv blocks its lists give the query's block, so
  /// that pages outside the span are not read). A query it allows no key gets zeros.
  TORCH_ARG(Mask, mask);
};

/// Attention of the newest n positions of each row over paged storage: query (batch, heads, n,
/// head_dim), row r's query i at position lengths[r] - n + i of its sequence (its keys and
/// values already appended), attending causally to the positions [0, lengths[r] - n + i]
/// (within the window, if one is set). n = 1 is a decode step; n > 1 a prefill chunk, in
/// float32 and float64 from 8 queries on in tiles (a block of queries against a page at a time,
/// by matrix products), else each query read against the pages like a decode step's. Heads
/// may be a multiple of the pages' key heads (grouped-query attention: query head i reads
/// key head i / (heads / kv_heads)).
/// Returns (batch, heads, n, head_dim_v), equal to the same queries on a contiguous cache.
///
/// On the CPU, in float32, float64, bfloat16 or float16 (16-bit pages read in place, the
/// arithmetic in float32), without autograd (inference: run it under torch::NoGradGuard).
/// Fails (c10::Error, naming the argument) on shapes, dtypes or devices that do not agree, a
/// row shorter than its n queries or longer than its pages, and a page table entry outside
/// the pool.
/// Example:
/// ```
/// auto kv = cache.view({request_a, request_b});
/// auto context = attnkit::paged_attention(query, kv);  // (2, heads, 1, head_dim)
/// ```
torch::Tensor paged_attention(const torch::Tensor& query, const PagedKV& kv,
                              const PagedAttentionOptions& options = {});

}  // namespace attnkit
