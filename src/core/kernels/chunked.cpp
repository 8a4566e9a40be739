// Memory-efficient attention: queries and keys in blocks, an online softmax (running max
// and sum), blocks above the causal diagonal skipped, and a backward pass that recomputes
// each block's probabilities from the saved log-sum-exp. A masked call reads a block mask
// (attnkit::BlockMask, the call's own or one it makes): its query blocks are the tiles' rows,
// empty key blocks are skipped, adjacent ones are computed together (partial if any of them
// is), full tiles mask nothing, and only partial ones evaluate the mask, in forward and in
// backward alike. The verdicts come from the block mask's host copy: no device
// synchronisation in the tile loop. Beyond inputs and outputs, memory is one score tile
// (head batch x query block x key block) instead of the O(n^2) score matrix of the math path,
// so it grows linearly in n.
//
// Speed (LibTorch 1.13 CPU): the inputs are read in place through (outer, heads, n, f)
// views, so the (b, h, n, hd) views of a QKV projection are not copied; the softmax scale
// is applied to each query block (bq x hd), not to the scores (bq x bk); the block's
// elementwise steps run in place; heads are processed in batches whose score block stays in
// cache.
//
// Grouped-query attention: the query heads that share a key/value head are folded into the
// rows of one matrix, (gs, bq, hd) -> (1, gs * bq, hd), so one bmm against the shared keys
// serves the whole group and the repeated keys and values never exist. Sliding windows: only
// the key blocks that meet the window are listed, so the work grows as n * window_size.

#include "core/kernels/chunked.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "attnkit/attention_types.h"
#include "core/base/attention_layout.h"
#include "core/base/autocast.h"
#include "core/base/parallel.h"
#include "core/kernels/tile_walk.h"
#include "core/scores/score_mods.h"

namespace attnkit::detail {

namespace {

using detail::as_outer_heads;
using detail::shaped_like;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInfinity = std::numeric_limits<double>::infinity();
// Bytes of one score tile (head batch x query block x key block): a few MiB, near the L2
// size of the development machine (2 MiB per core); tuned by hand with attnkit-bench.
constexpr int64_t kScoreBlockBytes = int64_t{4} << 20;

// Where a block sits: outer index o, heads [h0, h0 + g).
struct HeadBatch {
  int64_t o, h0, g;
  int64_t pair;  // o * num_head_batches + head batch
};

struct BlockPlan {
  const ChunkedProblem& call;
  int64_t outer;
  int64_t heads;
  int64_t num_queries;
  int64_t num_keys;
  int64_t query_block;
  int64_t key_block;
  int64_t group_size;  // query heads per key/value head
  int64_t head_batch;  // query heads per bmm, a multiple of group_size
  double scale;
  // A row may see no key in a tile (or at all): its running maximum needs a guard.
  bool rows_may_be_empty;

  BlockPlan(const torch::Tensor& q4, const torch::Tensor& k4, const ChunkedProblem& call)
      : call(call),
        outer(q4.size(0)),
        heads(q4.size(1)),
        num_queries(q4.size(2)),
        num_keys(k4.size(2)),
        query_block(call.blocks.defined() ? call.blocks.q_block_size() : call.query_block),
        key_block(call.key_block),
        group_size(q4.size(1) / k4.size(1)),
        head_batch(call.head_batch),
        scale(call.scale),
        rows_may_be_empty(!call.mask.is_none() || call.score_mod) {
    if (head_batch > 0)
      return;
    // Head batches of equal size (a multiple of group_size) whose score tile fits
    // kScoreBlockBytes, and at least as many (outer, head batch) pairs as there are workers
    // where the heads allow it: backward's tasks are those pairs.
    const int64_t block_bytes = query_block * key_block * static_cast<int64_t>(q4.element_size());
    const int64_t kv_heads = std::max<int64_t>(heads / group_size, 1);
    const int64_t fitting_heads = kScoreBlockBytes / std::max<int64_t>(block_bytes, 1);
    int64_t batches = std::max<int64_t>(fitting_heads / group_size, 1);
    batches = (kv_heads + batches - 1) / batches;  // kv heads per batch -> number of batches
    const int64_t workers = worker_count(outer * kv_heads, q4.device());
    // An empty batch (outer 0) has no tasks to share among the workers.
    const int64_t batches_per_outer = (workers + outer - 1) / std::max<int64_t>(outer, 1);
    batches = std::min(std::max(batches, batches_per_outer), kv_heads);
    head_batch = (kv_heads + batches - 1) / batches * group_size;
  }

  int64_t num_head_batches() const { return (heads + head_batch - 1) / head_batch; }
  int64_t num_query_blocks() const { return (num_queries + query_block - 1) / query_block; }

  // The key tiles that query block [q0, q0 + bq) of a head batch visits (tile_walk.h),
  // partial blocks joined with their neighbours: fewer, wider tiles. A causal query block is
  // one tile of up to key_block keys, not a full run and its diagonal block, since each tile
  // has a fixed cost of about 16 LibTorch ops (which weighs at n 1,024).
  std::vector<TileVisit> key_tiles(const HeadBatch& at, int64_t q0) const {
    const int64_t qi = call.blocks.defined() ? q0 / call.blocks.q_block_size() : 0;
    return detail::key_tiles(call.blocks, at.o, at.h0, at.g, qi, num_keys, key_block,
                             /*merge_partial=*/true);
  }
};

// Rows [r0, r0 + rows) of a head batch of an (outer, heads, n, f) query-side tensor: a
// (g, rows, f) view.
torch::Tensor block_of(const torch::Tensor& t4, const HeadBatch& at, int64_t r0, int64_t rows) {
  return t4.select(0, at.o).narrow(0, at.h0, at.g).narrow(1, r0, rows);
}

// The same rows of the key/value heads the batch's query heads use: (g / group_size, rows, f).
torch::Tensor kv_block_of(const torch::Tensor& t4, const HeadBatch& at, int64_t r0, int64_t rows,
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

Tile tile_at(const HeadBatch& at, int64_t q0, int64_t bq, int64_t k0, int64_t bk) {
  return {at.o, at.h0, at.g, q0, bq, k0, bk};
}

// The tile's index tensors for a score function: b, h, q_idx, kv_idx, each 3-D to match the
// (g, bq, bk) scores.
std::vector<torch::Tensor> tile_index(const Tile& t, const torch::Device& device) {
  const auto index = torch::dtype(torch::kInt64).device(device);
  return {torch::full({1, 1, 1}, t.batch, index),
          torch::arange(t.head_begin, t.head_begin + t.heads, index).view({-1, 1, 1}),
          torch::arange(t.query_begin, t.query_begin + t.queries, index).view({1, -1, 1}),
          torch::arange(t.key_begin, t.key_begin + t.keys, index).view({1, 1, -1})};
}

// Scaled scores of a (pre-scaled query block, key block) pair, (g, bq, bk).
torch::Tensor block_scores(const torch::Tensor& q_block, const torch::Tensor& k_block,
                           const BlockPlan& plan) {
  return unfold_groups(torch::bmm(fold_groups(q_block, plan.group_size), k_block.transpose(1, 2)),
                       plan.group_size);
}

// A tile's verdict, with the mask's entries evaluated for a partial one.
TileMask verdict_of(const ChunkedProblem& call, const TileVisit& visit, const Tile& tile,
                    const torch::Device& device) {
  return {visit.kind, visit.kind == TileKind::kPartial ? call.mask.tile_allowed(tile, device)
                                                       : torch::Tensor()};
}

// -inf where a partial tile's entries may not attend.
void mask_tile(torch::Tensor& scores, const TileMask& verdict) {
  if (verdict.kind == TileKind::kPartial)
    scores.masked_fill_(verdict.allowed.logical_not(), -kInfinity);
}

// A running row maximum made safe to subtract: a row that has seen only masked keys so far
// has maximum -inf; 0 stands in, so its exp() terms are 0, not NaN.
torch::Tensor finite_max(const torch::Tensor& row_max, const BlockPlan& plan) {
  return plan.rows_may_be_empty ? row_max.masked_fill(row_max == -kInfinity, 0.0) : row_max;
}

// The dropout factors of one block, each head's tile drawn as TileDropout draws it.
torch::Tensor dropout_scale(const torch::Tensor& like, const HeadBatch& at, int64_t q0, int64_t k0,
                            const BlockPlan& plan) {
  auto keep = torch::empty(like.sizes(), torch::dtype(like.scalar_type()));
  for (int64_t i = 0; i < at.g; ++i) {
    plan.call.dropout.draw(keep[i], TileDropout::place(at.o, at.h0 + i, q0, k0, plan.heads,
                                                       plan.num_queries, plan.num_keys));
  }
  return keep.to(like.device());
}

HeadBatch head_batch_of(const BlockPlan& plan, int64_t pair) {
  const int64_t o = pair / plan.num_head_batches();
  const int64_t h0 = pair % plan.num_head_batches() * plan.head_batch;
  return {o, h0, std::min(plan.head_batch, plan.heads - h0), pair};
}

// Calls visit(head batch, q0, bq) for every query block, in parallel (src/core/base/parallel.h):
// the tasks are (outer, head batch, query block), the last query blocks (which see the most keys
// when causal) first.
template <typename Visit>
void for_each_query_block(const BlockPlan& plan, const torch::Device& device, Visit&& visit) {
  const int64_t pairs = plan.outer * plan.num_head_batches(), blocks = plan.num_query_blocks();
  run_tasks(pairs * blocks, device, [&](int64_t task) {
    const int64_t q0 = (blocks - 1 - task / pairs) * plan.query_block;
    visit(head_batch_of(plan, task % pairs), q0, std::min(plan.query_block, plan.num_queries - q0));
  });
}

// Calls visit(head batch) for every (outer, head batch) pair, in parallel: backward's tasks,
// as each pair's key and value gradients gather from all of its query blocks.
template <typename Visit>
void for_each_head_batch(const BlockPlan& plan, const torch::Device& device, Visit&& visit) {
  run_tasks(plan.outer * plan.num_head_batches(), device,
            [&](int64_t task) { visit(head_batch_of(plan, task)); });
}

// Shapes: scores (g, bq, bk) with index tensors (b, h, q_idx, kv_idx) of that rank.
torch::Tensor modified_scores(const BlockPlan& plan, const torch::Tensor& scores, const Tile& t) {
  return plan.call.score_mod
             ? apply_score_mod(plan.call.score_mod, scores, tile_index(t, scores.device()))
             : scores;
}

}  // namespace

torch::Tensor chunked_forward(ChunkedProblem& call, const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, torch::Tensor* lse) {
  const auto q4 = as_outer_heads(q), k4 = as_outer_heads(k), v4 = as_outer_heads(v);
  const BlockPlan plan(q4, k4, call);
  call.head_batch = plan.head_batch;
  const int64_t gs = plan.group_size;
  auto out_shape = q.sizes().vec();
  out_shape.back() = v.size(-1);
  auto out = torch::empty(out_shape, q.options());
  auto out4 = as_outer_heads(out);  // a view of the output, written block by block
  auto lse4 = torch::empty({plan.outer, plan.heads, plan.num_queries, 1}, q.options());

  for_each_query_block(plan, q.device(), [&](const HeadBatch& at, int64_t q0, int64_t bq) {
    const auto q_block = block_of(q4, at, q0, bq) * plan.scale;  // (g, bq, hd), scaled
    auto acc = block_of(out4, at, q0, bq);                       // written in place
    torch::Tensor row_max, row_sum;
    for (const auto& visit : plan.key_tiles(at, q0)) {
      const int64_t k0 = visit.key_begin, bk = visit.keys;
      const auto verdict = verdict_of(call, visit, tile_at(at, q0, bq, k0, bk), q.device());
      const bool first = !row_max.defined();
      auto p = modified_scores(plan, block_scores(q_block, kv_block_of(k4, at, k0, bk, plan), plan),
                               tile_at(at, q0, bq, k0, bk));
      mask_tile(p, verdict);
      const auto block_max = p.amax(-1, /*keepdim=*/true);
      torch::Tensor correction;
      if (first) {
        row_max = block_max;
      } else {
        const auto new_max = torch::maximum(row_max, block_max);
        correction = (row_max - finite_max(new_max, plan)).exp_();
        row_max = new_max;
      }
      p.sub_(finite_max(row_max, plan)).exp_();
      const auto block_sum = p.sum(-1, /*keepdim=*/true);
      if (call.dropout.on())
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
    auto lse_block = block_of(lse4, at, q0, bq);
    if (!row_max.defined()) {  // every tile empty: these queries see no key
      acc.zero_();
      lse_block.fill_(kInfinity);
      return;
    }
    if (plan.rows_may_be_empty) {
      // A row that saw no key has sum 0 and output 0; lse +inf makes backward's weights 0.
      const auto empty_rows = row_sum == 0;
      acc.div_(row_sum.masked_fill(empty_rows, 1.0));
      lse_block.copy_(
          (finite_max(row_max, plan) + row_sum.log()).masked_fill_(empty_rows, kInfinity));
    } else {
      acc.div_(row_sum);
      lse_block.copy_(row_max + row_sum.log());
    }
  });
  *lse = lse4;
  return out;
}

std::vector<torch::Tensor> chunked_backward(const ChunkedProblem& call, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& v,
                                            const torch::Tensor& out, const torch::Tensor& lse4,
                                            const torch::Tensor& grad_out,
                                            const std::vector<torch::Tensor>& parameters) {
  const auto q4 = as_outer_heads(q), k4 = as_outer_heads(k), v4 = as_outer_heads(v);
  const auto out4 = as_outer_heads(out);
  const BlockPlan plan(q4, k4, call);
  const int64_t gs = plan.group_size;
  const auto grad_out4 = as_outer_heads(grad_out);
  // D_i = sum_j P_ij dP_ij = dO_i . O_i (holds with dropout too, since O = P_dropped V).
  const auto delta4 = (grad_out4 * out4).sum(-1, /*keepdim=*/true);
  auto grad_q4 = torch::zeros(q4.sizes(), q4.options());
  auto grad_k4 = torch::zeros(k4.sizes(), k4.options());
  auto grad_v4 = torch::zeros(v4.sizes(), v4.options());
  // Gradients of the tensors the score function reads, summed over tiles and tasks.
  const size_t num_parameters = parameters.size();
  std::vector<torch::Tensor> parameter_grads(num_parameters);

  const auto visit_query_block = [&](const HeadBatch& at, int64_t q0, int64_t bq,
                                     std::vector<torch::Tensor>& task_parameter_grads) {
    const auto q_block = block_of(q4, at, q0, bq) * plan.scale;  // (g, bq, hd), scaled
    const auto grad_out_block = block_of(grad_out4, at, q0, bq);
    const auto lse_block = block_of(lse4, at, q0, bq);
    const auto delta_block = block_of(delta4, at, q0, bq);
    auto grad_q_block = block_of(grad_q4, at, q0, bq);
    // Query-side blocks with each group's heads as rows of one matrix, for the
    // products against the shared key/value heads.
    const auto grad_out_rows = fold_groups(grad_out_block, gs);
    const auto q_rows = fold_groups(q_block, gs);
    for (const auto& visit : plan.key_tiles(at, q0)) {
      const int64_t k0 = visit.key_begin, bk = visit.keys;
      const auto tile = tile_at(at, q0, bq, k0, bk);
      const auto verdict = verdict_of(call, visit, tile, q.device());
      const auto k_block = kv_block_of(k4, at, k0, bk, plan);
      const auto v_block = kv_block_of(v4, at, k0, bk, plan);
      auto scores = block_scores(q_block, k_block, plan);
      // With a score function, autograd differentiates it on this tile: d score_mod / d
      // score for q and k, and d score_mod / d parameter for the tensors it reads.
      torch::Tensor score_leaf, modified;
      if (call.score_mod) {
        const torch::AutoGradMode grad_mode(true);  // workers run without grad mode
        score_leaf = scores.detach().requires_grad_(true);
        modified = modified_scores(plan, score_leaf, tile);
        scores = modified.detach().clone();  // masked in place below; autograd keeps modified
      }
      mask_tile(scores, verdict);
      auto p = scores.sub_(lse_block).exp_();
      auto grad_p = unfold_groups(torch::bmm(grad_out_rows, v_block.transpose(1, 2)), gs);
      torch::Tensor p_used = p;
      if (call.dropout.on()) {
        const auto keep = dropout_scale(p, at, q0, k0, plan);
        p_used = p * keep;
        grad_p.mul_(keep);
      }
      kv_block_of(grad_v4, at, k0, bk, plan)
          .baddbmm_(fold_groups(p_used, gs).transpose(1, 2), grad_out_rows);
      auto grad_scores = grad_p.sub_(delta_block).mul_(p);  // w.r.t. the modified scores
      if (call.score_mod) {
        std::vector<torch::Tensor> inputs{score_leaf};
        inputs.insert(inputs.end(), parameters.begin(), parameters.end());
        const auto tile_grads = torch::autograd::grad({modified}, inputs, {grad_scores},
                                                      /*retain_graph=*/false,
                                                      /*create_graph=*/false,
                                                      /*allow_unused=*/true);
        grad_scores = tile_grads[0];
        for (size_t j = 0; j < num_parameters; ++j) {
          const auto& g = tile_grads[j + 1];
          if (g.defined()) {
            auto& sum = task_parameter_grads[j];
            sum = sum.defined() ? sum.add_(g) : g.clone();
          }
        }
      }
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
  // Each task's share of the parameters' gradients, summed in task order afterwards: the same
  // inputs give the same gradients, whichever worker finishes first.
  std::vector<std::vector<torch::Tensor>> grads_by_task(plan.outer * plan.num_head_batches());
  for_each_head_batch(plan, q.device(), [&](const HeadBatch& at) {
    auto& task_parameter_grads = grads_by_task[at.pair];
    task_parameter_grads.resize(num_parameters);
    for (int64_t q0 = 0; q0 < plan.num_queries; q0 += plan.query_block) {
      visit_query_block(at, q0, std::min(plan.query_block, plan.num_queries - q0),
                        task_parameter_grads);
    }
  });
  for (const auto& task_parameter_grads : grads_by_task) {
    for (size_t j = 0; j < task_parameter_grads.size(); ++j) {
      auto& sum = parameter_grads[j];
      const auto& g = task_parameter_grads[j];
      if (g.defined())
        sum = sum.defined() ? sum.add_(g) : g;
    }
  }
  std::vector<torch::Tensor> grads{shaped_like(grad_q4, q), shaped_like(grad_k4, k),
                                   shaped_like(grad_v4, v)};
  for (size_t j = 0; j < num_parameters; ++j) {
    grads.push_back(parameter_grads[j].defined() ? parameter_grads[j]
                                                 : torch::zeros_like(parameters[j]));
  }
  return grads;
}

namespace {

struct ChunkedAttention : public torch::autograd::Function<ChunkedAttention> {
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<ChunkedProblem> call,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, at::TensorList score_mod_parameters) {
    torch::Tensor lse4;
    auto out = chunked_forward(*call, q, k, v, &lse4);
    SavedTiles{call, q, k, v, out, lse4, score_mod_parameters.vec()}.save(ctx);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = SavedTiles::load(ctx);
    auto computed = chunked_backward(saved.problem_as<ChunkedProblem>(), saved.query, saved.key,
                                     saved.value, saved.out, saved.lse, grads[0], saved.parameters);
    variable_list grads_in{torch::Tensor()};
    grads_in.insert(grads_in.end(), computed.begin(), computed.end());
    return grads_in;
  }
};

}  // namespace

namespace {

// The chunked kernel's settings for a call with `options` on (..., n, hd) inputs; dropout
// unset (the callers draw or pass its seed).
c10::intrusive_ptr<ChunkedProblem> problem_of(const torch::Tensor& query, const torch::Tensor& key,
                                              const functional::AttentionOptions& options) {
  auto call = c10::make_intrusive<ChunkedProblem>();
  call->mask = options.mask();
  // The block mask's device is the attention's.
  const int64_t tokens = std::max(query.size(-2), key.size(-2));
  const int64_t query_block = block_for(options.query_block_size(), tokens);
  call->blocks = tile_block_mask(options.mask(), query, key.size(-2), query_block, query.device());
  call->score_mod = options.score_mod();
  call->scale = options.scale().value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1))));
  call->query_block = query_block;
  call->key_block = block_for(options.key_block_size(), tokens);
  call->dropout.p = options.dropout_p();
  return call;
}

// The split form (the PyTorch operators): forward and backward on the call's (b, h, n, hd)
// inputs, the dropout seed the call's.
SplitKernel chunked_split() {
  const auto problem_for = [](const KernelInput& in) {
    auto options = in.call.options;
    auto problem = problem_of(in.call.query, in.call.key, options.mask(in.mask()));
    problem->dropout.p = in.dropout_p();
    problem->dropout.seed = in.dropout_p() > 0.0 ? in.call.dropout_seed : -1;
    return problem;
  };
  return {[problem_for](const KernelInput& in) {
            const auto& call = in.call;
            torch::Tensor lse;  // (b, h, n, 1)
            auto out = chunked_forward(*problem_for(in), call.query, call.key, call.value, &lse);
            return SplitOutputs{out, lse.squeeze(-1), {}};
          },
          [problem_for](const KernelInput& in, const SplitSaved& saved) {
            const auto& call = in.call;
            return chunked_backward(*problem_for(in), call.query, call.key, call.value, saved.out,
                                    saved.lse.unsqueeze(-1), saved.grad_out, saved.parameters);
          }};
}

}  // namespace

torch::Tensor chunked_kernel(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value,
                             const functional::AttentionOptions& options) {
  auto call = problem_of(query, key, options);
  if (options.training() && options.dropout_p() > 0.0)
    call->dropout.seed = TileDropout::draw_seed();
  std::vector<torch::Tensor> parameters;
  if (call->score_mod && torch::GradMode::is_enabled())
    parameters = score_mod_parameters(call->score_mod, query.options());
  return ChunkedAttention::apply(call, query, key, value, at::TensorList(parameters));
}

// The chunked kernel's spec.

KernelSpec chunked_spec() {
  return {"chunked", AttentionBackend::kChunked, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            std::string why;
            if (input.call.with_weights) {
              why = "the chunked backend returns no weights (the math backend builds them)";
            } else if (input.call.step == StepKind::kRagged && input.query_tokens() == 1) {
              // One query per row scores one row per head: the math core costs no quadratic
              // memory there and has the least overhead, where tiles would be read row by row.
              why = "a one-query ragged step runs best on the math core";
            }
            return KernelDecision{
                std::move(why),
                [](const KernelInput& in) {
                  const auto& call = in.call;
                  auto options = call.options;
                  return functional::AttentionOutput{
                      chunked_kernel(call.query, call.key, call.value, options.mask(in.mask())),
                      {}};
                },
                chunked_split()};
          }};
}

}  // namespace attnkit::detail
