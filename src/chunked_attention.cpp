// Memory-efficient attention: queries and keys in blocks, an online softmax (running max
// and sum), blocks above the causal diagonal skipped, and a backward pass that recomputes
// each block's probabilities from the saved log-sum-exp. Beyond inputs and outputs, memory
// is one score tile (head group x query block x key block) instead of the O(n^2) score
// matrix of the math path, so it grows linearly in n.
//
// Speed (LibTorch 1.13 CPU): the inputs are read in place through (outer, heads, n, f)
// views, so the (b, h, n, hd) views of a QKV projection are not copied; the softmax scale
// is applied to each query block (bq x hd), not to the scores (bq x bk); the block's
// elementwise steps run in place; heads are processed in groups whose score block stays in
// cache.
//
// Grouped-query attention: the query heads that share a key/value head are folded into the
// rows of one matrix, (gs, bq, hd) -> (1, gs * bq, hd), so one bmm against the shared keys
// serves the whole group and the repeated keys and values never exist. Sliding windows:
// each query block starts at the first key its first query may see, so only key blocks
// that meet the window are visited and the work grows as n * window_size, not n^2.

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "attention_layout.h"
#include "attnkit/functional.h"
#include "parallel.h"

namespace attnkit::functional {

namespace {

using detail::as_outer_heads;
using detail::shaped_like;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// Bytes of one score tile (head group x query block x key block): a few MiB, near the L2
// size of the development machine (2 MiB per core); tuned by hand with attnkit-bench.
constexpr int64_t kScoreBlockBytes = int64_t{4} << 20;

// Everything forward and backward must agree on to visit the same blocks the same way.
struct BlockPlan {
  int64_t outer;
  int64_t heads;
  int64_t num_queries;
  int64_t num_keys;
  int64_t query_block;
  int64_t key_block;
  int64_t group_size;  // query heads per key/value head
  int64_t head_group;  // query heads per bmm, a multiple of group_size
  bool causal;
  int64_t query_offset;  // key position of query 0 (causal only)
  int64_t window;        // sliding window (causal only); 0: none
  double scale;
  double dropout_p;
  int64_t dropout_seed;  // < 0: no dropout

  BlockPlan(const torch::Tensor& q4, const torch::Tensor& k4, int64_t query_block_size,
            int64_t key_block_size, bool causal, int64_t query_offset, int64_t window,
            double dropout_p, int64_t dropout_seed)
      : outer(q4.size(0)),
        heads(q4.size(1)),
        num_queries(q4.size(2)),
        num_keys(k4.size(2)),
        query_block(query_block_size),
        key_block(key_block_size),
        group_size(q4.size(1) / k4.size(1)),
        causal(causal),
        query_offset(query_offset),
        window(window),
        scale(1.0 / std::sqrt(static_cast<double>(q4.size(3)))),
        dropout_p(dropout_p),
        dropout_seed(dropout_seed) {
    // Head groups of equal size (a multiple of group_size) whose score tile fits
    // kScoreBlockBytes, and at least as many (outer, head group) pairs as there are workers
    // where the heads allow it: backward's tasks are those pairs.
    const int64_t block_bytes = query_block * key_block * static_cast<int64_t>(q4.element_size());
    const int64_t kv_heads = std::max<int64_t>(heads / group_size, 1);
    const int64_t fitting_heads = kScoreBlockBytes / std::max<int64_t>(block_bytes, 1);
    int64_t groups = std::max<int64_t>(fitting_heads / group_size, 1);
    groups = (kv_heads + groups - 1) / groups;  // kv heads per group -> number of groups
    const int64_t workers = detail::worker_count(outer * kv_heads, q4.device());
    groups = std::min(std::max(groups, (workers + outer - 1) / outer), kv_heads);
    head_group = (kv_heads + groups - 1) / groups * group_size;
  }

  int64_t num_head_groups() const { return (heads + head_group - 1) / head_group; }
  int64_t num_query_blocks() const { return (num_queries + query_block - 1) / query_block; }

  // Keys a query block ending at q1 can see: all, or (causal) j < query_offset + q1.
  int64_t key_end(int64_t q1) const {
    return causal ? std::min(num_keys, query_offset + q1) : num_keys;
  }
  // First key a query block starting at q0 can see: 0, or (window) that of its first query.
  int64_t key_begin(int64_t q0) const {
    return window > 0 ? std::clamp<int64_t>(query_offset + q0 - window + 1, 0, num_keys) : 0;
  }
  // The key blocks (k0, bk) that query block [q0, q0 + bq) visits, at most key_block wide.
  // Without a window: from key 0 in steps of key_block. With one, the keys every query of the
  // block sees get blocks of their own, so that only the two edges of the band (about bq
  // keys each) pay for a mask, not the whole window.
  std::vector<std::pair<int64_t, int64_t>> key_blocks(int64_t q0, int64_t bq) const {
    const int64_t begin = key_begin(q0), end = key_end(q0 + bq);
    std::vector<int64_t> cuts{begin};
    if (window > 0) {
      const int64_t first = query_offset + q0, last = first + bq - 1;  // query positions
      for (const int64_t cut : {last - window + 1, first + 1}) {
        if (cut > cuts.back() && cut < end)
          cuts.push_back(cut);
      }
    }
    cuts.push_back(end);
    std::vector<std::pair<int64_t, int64_t>> blocks;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      for (int64_t k0 = cuts[i]; k0 < cuts[i + 1]; k0 += key_block)
        blocks.emplace_back(k0, std::min(key_block, cuts[i + 1] - k0));
    }
    return blocks;
  }
};

// Where a block sits: outer index o, heads [h0, h0 + g).
struct HeadGroup {
  int64_t o, h0, g;
};

// Rows [r0, r0 + rows) of a head group of an (outer, heads, n, f) query-side tensor: a
// (g, rows, f) view.
torch::Tensor block_of(const torch::Tensor& t4, const HeadGroup& at, int64_t r0, int64_t rows) {
  return t4.select(0, at.o).narrow(0, at.h0, at.g).narrow(1, r0, rows);
}

// The same rows of the key/value heads the group's query heads use: (g / group_size, rows, f).
torch::Tensor kv_block_of(const torch::Tensor& t4, const HeadGroup& at, int64_t r0, int64_t rows,
                          const BlockPlan& plan) {
  return t4.select(0, at.o)
      .narrow(0, at.h0 / plan.group_size, at.g / plan.group_size)
      .narrow(1, r0, rows);
}

// (g, r, f) per query head -> (g / gs, gs * r, f): the query heads sharing a key/value head
// stacked as the rows of one matrix (a view when gs is 1 or t is contiguous).
torch::Tensor fold_groups(const torch::Tensor& t, int64_t gs) {
  return gs == 1 ? t : t.reshape({t.size(0) / gs, gs * t.size(1), t.size(2)});
}

// The inverse of fold_groups for a fresh product: (g / gs, gs * r, f) -> (g, r, f).
torch::Tensor unfold_groups(const torch::Tensor& t, int64_t gs) {
  return gs == 1 ? t : t.view({t.size(0) * gs, t.size(1) / gs, t.size(2)});
}

// Scores of a (pre-scaled query block, key block) pair, (g, bq, bk), with -inf where key j
// lies after query i's position query_offset + i, or (window) window or more before it.
torch::Tensor block_scores(const torch::Tensor& q_block, const torch::Tensor& k_block, int64_t q0,
                           int64_t k0, const BlockPlan& plan) {
  const int64_t bq = q_block.size(1), bk = k_block.size(1);
  auto scores = unfold_groups(
      torch::bmm(fold_groups(q_block, plan.group_size), k_block.transpose(1, 2)), plan.group_size);
  const int64_t position = plan.query_offset + q0;  // of the block's first query
  const bool above_diagonal = plan.causal && k0 + bk - 1 > position;
  const bool below_window = plan.window > 0 && position + bq - 1 - k0 >= plan.window;
  if (above_diagonal || below_window) {
    const auto index = torch::dtype(torch::kInt64);
    const auto rows = torch::arange(position, position + bq, index).unsqueeze(1);
    const auto cols = torch::arange(k0, k0 + bk, index).unsqueeze(0);
    auto masked = cols > rows;
    if (below_window)
      masked.logical_or_(rows - cols >= plan.window);
    scores.masked_fill_(masked.to(scores.device()), -kInfinity);
  }
  return scores;
}

// A running row maximum made safe to subtract: a row that has seen only masked keys so far
// (possible with a window) has maximum -inf; 0 stands in, so its exp() terms are 0, not NaN.
torch::Tensor finite_max(const torch::Tensor& row_max, const BlockPlan& plan) {
  return plan.window > 0 ? row_max.masked_fill(row_max == -kInfinity, 0.0) : row_max;
}

// The dropout keep-mask (scaled by 1 / (1 - p)) of one block, each head's drawn from a
// generator seeded by the call's seed and the head's block position, so backward redraws the
// same mask however the heads are grouped and whichever worker draws it.
torch::Tensor dropout_scale(const torch::Tensor& like, const HeadGroup& at, int64_t q0, int64_t k0,
                            const BlockPlan& plan) {
  auto keep = torch::empty(like.sizes(), torch::dtype(like.scalar_type()));
  for (int64_t i = 0; i < at.g; ++i) {
    const auto block_index =
        ((at.o * plan.heads + at.h0 + i) * plan.num_queries + q0) * plan.num_keys + k0;
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(plan.dropout_seed) +
                                                    static_cast<uint64_t>(block_index));
    keep[i].bernoulli_(1.0 - plan.dropout_p, generator);
  }
  return keep.div_(1.0 - plan.dropout_p).to(like.device());
}

HeadGroup head_group_of(const BlockPlan& plan, int64_t index) {
  const int64_t o = index / plan.num_head_groups();
  const int64_t h0 = index % plan.num_head_groups() * plan.head_group;
  return {o, h0, std::min(plan.head_group, plan.heads - h0)};
}

// Calls visit(head group, q0, bq) for every query block, in parallel (src/parallel.h): the
// tasks are (outer, head group, query block), the last query blocks (which see the most keys
// when causal) first.
template <typename Visit>
void for_each_query_block(const BlockPlan& plan, const torch::Device& device, Visit&& visit) {
  const int64_t pairs = plan.outer * plan.num_head_groups(), blocks = plan.num_query_blocks();
  detail::run_tasks(pairs * blocks, device, [&](int64_t task) {
    const int64_t q0 = (blocks - 1 - task / pairs) * plan.query_block;
    visit(head_group_of(plan, task % pairs), q0, std::min(plan.query_block, plan.num_queries - q0));
  });
}

// Calls visit(head group) for every (outer, head group) pair, in parallel: backward's tasks,
// as each pair's key and value gradients gather from all of its query blocks.
template <typename Visit>
void for_each_head_group(const BlockPlan& plan, const torch::Device& device, Visit&& visit) {
  detail::run_tasks(plan.outer * plan.num_head_groups(), device,
                    [&](int64_t task) { visit(head_group_of(plan, task)); });
}

struct ChunkedAttention : public torch::autograd::Function<ChunkedAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, int64_t query_offset,
                               int64_t window, double dropout_p, int64_t dropout_seed,
                               int64_t query_block, int64_t key_block) {
    const auto q4 = as_outer_heads(q), k4 = as_outer_heads(k), v4 = as_outer_heads(v);
    const BlockPlan plan(q4, k4, query_block, key_block, causal, query_offset, window, dropout_p,
                         dropout_seed);
    const int64_t gs = plan.group_size;
    auto out_shape = q.sizes().vec();
    out_shape.back() = v.size(-1);
    auto out = torch::empty(out_shape, q.options());
    auto out4 = as_outer_heads(out);  // a view of the output, written block by block
    auto lse4 = torch::empty({plan.outer, plan.heads, plan.num_queries, 1}, q.options());

    for_each_query_block(plan, q.device(), [&](const HeadGroup& at, int64_t q0, int64_t bq) {
      const auto q_block = block_of(q4, at, q0, bq) * plan.scale;  // (g, bq, hd), scaled
      auto acc = block_of(out4, at, q0, bq);                       // written in place
      torch::Tensor row_max, row_sum;
      const auto key_blocks = plan.key_blocks(q0, bq);
      for (const auto& [k0, bk] : key_blocks) {
        const bool first = k0 == key_blocks.front().first;
        auto p = block_scores(q_block, kv_block_of(k4, at, k0, bk, plan), q0, k0, plan);
        const auto block_max = p.amax(-1, /*keepdim=*/true);
        torch::Tensor correction;
        if (first) {
          row_max = block_max;  // finite without a window: key 0 is visible to every row
        } else {
          const auto new_max = torch::maximum(row_max, block_max);
          correction = (row_max - finite_max(new_max, plan)).exp_();
          row_max = new_max;
        }
        p.sub_(finite_max(row_max, plan)).exp_();
        const auto block_sum = p.sum(-1, /*keepdim=*/true);
        if (plan.dropout_seed >= 0)
          p.mul_(dropout_scale(p, at, q0, k0, plan));
        const auto v_block = kv_block_of(v4, at, k0, bk, plan);
        if (first) {
          row_sum = block_sum;
          acc.copy_(unfold_groups(torch::bmm(fold_groups(p, gs), v_block), gs));
        } else {
          row_sum.mul_(correction).add_(block_sum);
          if (gs == 1) {
            acc.mul_(correction).baddbmm_(p, v_block);
          } else {
            acc.mul_(correction).add_(unfold_groups(torch::bmm(fold_groups(p, gs), v_block), gs));
          }
        }
      }
      acc.div_(row_sum);
      block_of(lse4, at, q0, bq).copy_(row_max + row_sum.log());
    });
    ctx->save_for_backward({q, k, v, out, lse4});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["query_offset"] = query_offset;
    ctx->saved_data["window"] = window;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dropout_seed"] = dropout_seed;
    ctx->saved_data["query_block"] = query_block;
    ctx->saved_data["key_block"] = key_block;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &lse4 = saved[4];
    const auto q4 = as_outer_heads(q), k4 = as_outer_heads(k), v4 = as_outer_heads(v);
    const auto out4 = as_outer_heads(saved[3]);
    const BlockPlan plan(q4, k4, ctx->saved_data["query_block"].toInt(),
                         ctx->saved_data["key_block"].toInt(), ctx->saved_data["causal"].toBool(),
                         ctx->saved_data["query_offset"].toInt(), ctx->saved_data["window"].toInt(),
                         ctx->saved_data["dropout_p"].toDouble(),
                         ctx->saved_data["dropout_seed"].toInt());
    const int64_t gs = plan.group_size;
    const auto grad_out4 = as_outer_heads(grads[0]);
    // D_i = sum_j P_ij dP_ij = dO_i . O_i (holds with dropout too, since O = P_dropped V).
    const auto delta4 = (grad_out4 * out4).sum(-1, /*keepdim=*/true);
    auto grad_q4 = torch::zeros(q4.sizes(), q4.options());
    auto grad_k4 = torch::zeros(k4.sizes(), k4.options());
    auto grad_v4 = torch::zeros(v4.sizes(), v4.options());
    const auto visit_query_block = [&](const HeadGroup& at, int64_t q0, int64_t bq) {
      const auto q_block = block_of(q4, at, q0, bq) * plan.scale;  // (g, bq, hd), scaled
      const auto grad_out_block = block_of(grad_out4, at, q0, bq);
      const auto lse_block = block_of(lse4, at, q0, bq);
      const auto delta_block = block_of(delta4, at, q0, bq);
      auto grad_q_block = block_of(grad_q4, at, q0, bq);
      // Query-side blocks with each group's heads as rows of one matrix, for the
      // products against the shared key/value heads.
      const auto grad_out_rows = fold_groups(grad_out_block, gs);
      const auto q_rows = fold_groups(q_block, gs);
      for (const auto& [k0, bk] : plan.key_blocks(q0, bq)) {
        const auto k_block = kv_block_of(k4, at, k0, bk, plan);
        const auto v_block = kv_block_of(v4, at, k0, bk, plan);
        auto p = block_scores(q_block, k_block, q0, k0, plan).sub_(lse_block).exp_();
        auto grad_p = unfold_groups(torch::bmm(grad_out_rows, v_block.transpose(1, 2)), gs);
        torch::Tensor p_used = p;
        if (plan.dropout_seed >= 0) {
          const auto keep = dropout_scale(p, at, q0, k0, plan);
          p_used = p * keep;
          grad_p.mul_(keep);
        }
        kv_block_of(grad_v4, at, k0, bk, plan)
            .baddbmm_(fold_groups(p_used, gs).transpose(1, 2), grad_out_rows);
        const auto grad_scores = grad_p.sub_(delta_block).mul_(p);  // w.r.t. scaled scores
        if (gs == 1) {
          grad_q_block.baddbmm_(grad_scores, k_block, /*beta=*/1, /*alpha=*/plan.scale);
        } else {
          grad_q_block.add_(unfold_groups(torch::bmm(fold_groups(grad_scores, gs), k_block), gs),
                            plan.scale);
        }
        kv_block_of(grad_k4, at, k0, bk, plan)
            .baddbmm_(fold_groups(grad_scores, gs).transpose(1, 2), q_rows);
      }
    };
    for_each_head_group(plan, q.device(), [&](const HeadGroup& at) {
      for (int64_t q0 = 0; q0 < plan.num_queries; q0 += plan.query_block)
        visit_query_block(at, q0, std::min(plan.query_block, plan.num_queries - q0));
    });
    variable_list grads_in{shaped_like(grad_q4, q), shaped_like(grad_k4, k),
                           shaped_like(grad_v4, v)};
    grads_in.resize(10);  // none for the seven non-tensor arguments
    return grads_in;
  }
};

}  // namespace

torch::Tensor chunked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                const torch::Tensor& value, const ChunkedOptions& options) {
  const char* fn = "[chunked_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  detail::check_window_size(fn, options.window_size(), options.is_causal());
  TORCH_CHECK(options.block_size() >= 1, fn, " block_size must be >= 1, got ",
              options.block_size());
  TORCH_CHECK(options.key_block_size() >= 1, fn, " key_block_size must be >= 1, got ",
              options.key_block_size());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  detail::check_query_offset(fn, options.query_offset());
  const bool dropout = options.training() && options.dropout_p() > 0.0;
  // The seed comes from the global generator, so torch::manual_seed fixes the masks.
  const int64_t seed =
      dropout ? torch::randint(0, int64_t{1} << 62, {1}, torch::kInt64).item<int64_t>() : -1;
  return ChunkedAttention::apply(query, key, value, options.is_causal(), options.query_offset(),
                                 options.window_size().value_or(0), options.dropout_p(), seed,
                                 options.block_size(), options.key_block_size());
}

}  // namespace attnkit::functional
