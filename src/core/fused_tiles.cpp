// The fused CPU tile kernel: the chunked kernel's walk over a block mask's tiles (tile_walk.h)
// with everything between its matrix products done in the tile's rows. Per query block and
// key tile: S = (scale Q) K^T by one GEMM, then, row by row while the row is in L1, the score
// function (a ScoreVariant: softcap, ALiBi, a relative-position table), the mask bits (a
// partial tile only), the online softmax (running maximum and sum, the output rows
// corrected), and then P V by one GEMM into the output block (P times the tile's dropout
// factors, with dropout). Backward recomputes P from the log-sum-exp in the same rows, and its
// five products per tile are GEMMs on the tile.
//
// Why: the chunked kernel spends about 16 LibTorch operations per tile, each a pass over the
// whole tile (a few MiB, beyond L1 and often L2); here the tile's rows are read once after
// each GEMM, and the only LibTorch calls in the tile loop are the GEMMs themselves
// (at::mm_out / addmm_ on the inputs in place, which reach the BLAS) and, for a partial tile
// of a mask that has no host form (a tensor, a mask_mod), its entries (Mask::tile_allowed);
// the named kinds and Python's packed tiles write theirs directly (MaskNode::fill_tile).
//
// Layout: float32 or float64 (a 16-bit call arrives as float32: the planner computes it so;
// AVX2 row loops for float32 where the CPU has them, portable loops otherwise), inputs as
// (outer, heads, n, f) slices with unit-stride rows, read in place. Grouped-query attention
// reads each key/value head for its query heads without copies. Forward's tasks are (outer,
// head, query block), the last blocks first; backward's are (outer, key/value head, key
// range), each owning its range's key and value gradients (one range where the pairs are
// enough for the workers; key_ranges.h), with the table's gradient summed in task order
// (every outer slice in one task where a bias over (heads, n, n) is written in place).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "core/attention_layout.h"
#include "core/kernels.h"
#include "core/key_ranges.h"
#include "core/loop_nest_kernel.h"
#include "core/mask_node.h"
#include "core/parallel.h"
#include "core/row_score.h"
#include "core/row_softmax.h"
#include "core/score_program.h"
#include "core/score_variants.h"
#include "core/tile_walk.h"

namespace attnkit::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The most memory backward's per-task copies of the score function's tensor gradients may
// take (float64); above it, one copy per worker.
constexpr int64_t kTaskGradBytes = int64_t{256} << 20;

// Backward's tasks per worker, at least, where key ranges can make them (key_ranges.h); up
// to kMostBackwardTasksPerWorker where the further ranges cost no dQ slots (documents: 16
// equal tasks left one of 2 workers waiting 5.5 ms of a 70 ms backward for the other's last,
// 64 left it 0.75 ms; docs/threads.md).
constexpr int64_t kBackwardTasksPerWorker = 8;
constexpr int64_t kMostBackwardTasksPerWorker = 32;
// The most the tasks' copies of summed gradients (a table's) may take for those further
// tasks: documents with a relative table (8 x 257, 16 KiB a copy) ran their backward in 92.3
// against 97.7 ms with them (2 threads, n 4,096). A large tensor's copies are each cleared and
// added, a cost that grows with the tasks (not measured).
constexpr int64_t kFreeRangesGradBytes = int64_t{4} << 20;

// ---- the problem ---------------------------------------------------------------------------

// The kernel's settings for one call, shared by its forward and its backward.
struct TileProblem : torch::CustomClassHolder {
  Mask mask;
  BlockMask blocks;  // defined when the mask is not none
  ScoreVariant variant;
  double scale = 1.0;
  int64_t query_block = 128;  // the block mask's query block when there is one
  int64_t key_block = 1024;
  double dropout_p = 0.0;
  int64_t dropout_seed = -1;  // drawn per call (split calls: the call's)
};

// (outer, heads, rows, cols) slices with unit-stride rows.
template <typename T>
struct Slices {
  T* data;
  int64_t outer_stride, head_stride, row_stride;
  explicit Slices(const torch::Tensor& t4)
      : data(t4.data_ptr<T>()),
        outer_stride(t4.stride(0)),
        head_stride(t4.stride(1)),
        row_stride(t4.stride(2)) {}
  T* row(int64_t o, int64_t h, int64_t r) const {
    return data + o * outer_stride + h * head_stride + r * row_stride;
  }
};

// Zeroes rows [first, last) of slice (o, h), each `cols` wide.
template <typename T>
void clear_rows(const Slices<T>& s, int64_t o, int64_t h, int64_t first, int64_t last,
                int64_t cols) {
  for (int64_t r = first; r < last; ++r)
    std::memset(s.row(o, h, r), 0, static_cast<size_t>(cols) * sizeof(T));
}

// rows x cols of a matrix with unit-stride rows, as a tensor for the BLAS calls.
template <typename T>
torch::Tensor matrix(T* data, int64_t rows, int64_t cols, int64_t row_stride) {
  return torch::from_blob(data, {rows, cols}, {row_stride, 1},
                          torch::dtype(c10::CppTypeToScalarType<T>::value));
}

// The plan both passes follow: shapes, blocks and the tiles of each query block.
struct TilePlan {
  const TileProblem& problem;
  int64_t outer, heads, group_size, num_queries, num_keys, head_dim, value_dim;
  int64_t query_block, widest_tile;

  TilePlan(const TileProblem& problem, const torch::Tensor& q4, const torch::Tensor& k4,
           const torch::Tensor& v4)
      : problem(problem),
        outer(q4.size(0)),
        heads(q4.size(1)),
        group_size(q4.size(1) / k4.size(1)),
        num_queries(q4.size(2)),
        num_keys(k4.size(2)),
        head_dim(q4.size(3)),
        value_dim(v4.size(3)),
        query_block(problem.blocks.defined() ? problem.blocks.q_block_size() : problem.query_block),
        widest_tile(std::max(problem.key_block, problem.blocks.defined()
                                                    ? problem.blocks.kv_block_size()
                                                    : int64_t{1})) {}

  int64_t num_query_blocks() const { return (num_queries + query_block - 1) / query_block; }

  std::vector<TileVisit> tiles(int64_t o, int64_t h, int64_t qi) const {
    return key_tiles(problem.blocks, o, h, 1, qi, num_keys, problem.key_block,
                     /*merge_partial=*/false);
  }

  // A partial tile's mask entries, (queries, keys) row-major, written into `buffer` (bq *
  // widest_tile entries) by the mask's kinds, or else evaluated into `evaluated`; nullptr for
  // any other tile.
  const bool* allowed(const TileVisit& visit, int64_t o, int64_t h, int64_t q0, int64_t bq,
                      bool* buffer, torch::Tensor& evaluated) const {
    if (visit.kind != TileKind::kPartial)
      return nullptr;
    const Tile tile{o, h, 1, q0, bq, visit.key_begin, visit.keys};
    if (fill_tile(problem.mask, tile, buffer))
      return buffer;
    evaluated = problem.mask.tile_allowed(tile, torch::kCPU)
                    .expand({1, bq, visit.keys})
                    .reshape({bq, visit.keys})
                    .contiguous();
    return evaluated.data_ptr<bool>();
  }

  // The dropout factors of a tile, (bq, keys) row-major: 0 or 1 / (1 - p), from a CPU
  // generator seeded by the call's seed and the tile's place, so backward redraws forward's
  // (as the chunked kernel draws its blocks); undefined without dropout.
  template <typename T>
  torch::Tensor dropout_factors(int64_t o, int64_t h, int64_t q0, int64_t bq,
                                const TileVisit& visit) const {
    if (problem.dropout_p <= 0.0)
      return {};
    const auto place = ((o * heads + h) * num_queries + q0) * num_keys + visit.key_begin;
    auto generator = at::detail::createCPUGenerator(static_cast<uint64_t>(problem.dropout_seed) +
                                                    static_cast<uint64_t>(place));
    auto keep = torch::empty({bq, visit.keys}, torch::dtype(c10::CppTypeToScalarType<T>::value));
    keep.bernoulli_(1.0 - problem.dropout_p, generator);
    return keep.mul_(1.0 / (1.0 - problem.dropout_p));
  }

  // (bq, head_dim) queries of a block, times the scale, into `scaled`.
  template <typename T>
  void scaled_queries(const Slices<T>& q, int64_t o, int64_t h, int64_t q0, int64_t bq,
                      T* scaled) const {
    const auto scale = static_cast<T>(problem.scale);
    for (int64_t i = 0; i < bq; ++i) {
      const T* row = q.row(o, h, q0 + i);
      for (int64_t d = 0; d < head_dim; ++d)
        scaled[i * head_dim + d] = row[d] * scale;
    }
  }

  // Scores of a tile: S = Qs K^T with the score function and the mask applied, in `scores`
  // (bq rows of visit.keys); each row's modified scores are handed to `row_done(i, row)`.
  // `raw` (when given) keeps the rows as they were before the score function. `mask_bits`:
  // room for a partial tile's entries (query_block * widest_tile).
  template <typename T, typename RowDone>
  void tile_scores(const torch::Tensor& scaled_q, const Slices<T>& k, int64_t o, int64_t h,
                   int64_t q0, int64_t bq, const TileVisit& visit, T* scores,
                   const RowScore<T>& score, ScoreProgram::Workspace& work, bool* mask_bits, T* raw,
                   RowDone&& row_done) const {
    const int64_t k0 = visit.key_begin, bk = visit.keys;
    auto s = matrix(scores, bq, bk, bk);
    at::mm_out(s, scaled_q, matrix(k.row(o, h / group_size, k0), bk, head_dim, k.row_stride).t());
    torch::Tensor evaluated;
    const bool* bits = allowed(visit, o, h, q0, bq, mask_bits, evaluated);
    for (int64_t i = 0; i < bq; ++i) {
      T* row = scores + i * bk;
      if (raw != nullptr)
        std::memcpy(raw + i * bk, row, bk * sizeof(T));
      score.apply(row, bk, o, h, q0 + i, k0, work);
      if (bits != nullptr) {
        const bool* row_bits = bits + i * bk;
        for (int64_t j = 0; j < bk; ++j)
          row[j] = row_bits[j] ? row[j] : minus_infinity<T>();
      }
      row_done(i, row);
    }
  }
};

// Forward on (outer, heads, n, f) slices of T: the output (outer, heads, n, dv) and the
// rows' log-sum-exp (outer, heads, n), +inf for a row that sees no key.
template <typename T>
std::pair<torch::Tensor, torch::Tensor> tiles_forward(const TileProblem& problem,
                                                      const torch::Tensor& q4,
                                                      const torch::Tensor& k4,
                                                      const torch::Tensor& v4) {
  const TilePlan plan(problem, q4, k4, v4);
  const RowScore<T> score(problem.variant);
  auto out4 =
      torch::empty({plan.outer, plan.heads, plan.num_queries, plan.value_dim}, q4.options());
  auto lse = torch::empty({plan.outer, plan.heads, plan.num_queries}, q4.options());
  const Slices<T> q(q4), k(k4), v(v4), out(out4);
  T* lse_data = lse.data_ptr<T>();
  const int64_t blocks = plan.num_query_blocks(), pairs = plan.outer * plan.heads;
  const int64_t dv = plan.value_dim;
  run_tasks(pairs * blocks, q4.device(), [&](int64_t task) {
    const int64_t qi = blocks - 1 - task / pairs, pair = task % pairs;
    const int64_t o = pair / plan.heads, h = pair % plan.heads;
    const int64_t q0 = qi * plan.query_block;
    const int64_t bq = std::min(plan.query_block, plan.num_queries - q0);
    const auto options = q4.options();
    auto scaled_q = torch::empty({bq, plan.head_dim}, options);
    plan.scaled_queries(q, o, h, q0, bq, scaled_q.data_ptr<T>());
    auto scores = torch::empty({bq * plan.widest_tile}, options);
    auto acc = torch::zeros({bq, dv}, options);
    T* acc_data = acc.data_ptr<T>();
    std::vector<T> running_max(bq, minus_infinity<T>()), running_sum(bq, 0);
    auto work = score.workspace(plan.widest_tile);
    std::unique_ptr<bool[]> mask_bits(new bool[plan.query_block * plan.widest_tile]);
    for (const auto& visit : plan.tiles(o, h, qi)) {
      const auto factors = plan.template dropout_factors<T>(o, h, q0, bq, visit);
      const T* factor = factors.defined() ? factors.template data_ptr<T>() : nullptr;
      plan.tile_scores(scaled_q, k, o, h, q0, bq, visit, scores.data_ptr<T>(), score, work,
                       mask_bits.get(), static_cast<T*>(nullptr), [&](int64_t i, T* row) {
                         const T new_max = std::max(running_max[i], row_max(row, visit.keys));
                         if (new_max == minus_infinity<T>()) {  // no key seen yet: weights 0
                           std::fill(row, row + visit.keys, T(0));
                           return;
                         }
                         const T correction = std::exp(running_max[i] - new_max);
                         running_sum[i] =
                             running_sum[i] * correction + exp_shifted(row, visit.keys, new_max);
                         running_max[i] = new_max;
                         if (correction != 1) {
                           T* acc_row = acc_data + i * dv;
                           for (int64_t d = 0; d < dv; ++d)
                             acc_row[d] *= correction;
                         }
                         // The sum counts every weight; only the output's are dropped.
                         if (factor != nullptr) {
                           const T* row_factor = factor + i * visit.keys;
                           for (int64_t j = 0; j < visit.keys; ++j)
                             row[j] *= row_factor[j];
                         }
                       });
      acc.addmm_(
          matrix(scores.data_ptr<T>(), bq, visit.keys, visit.keys),
          matrix(v.row(o, h / plan.group_size, visit.key_begin), visit.keys, dv, v.row_stride));
    }
    for (int64_t i = 0; i < bq; ++i) {
      T* out_row = out.row(o, h, q0 + i);
      const T* acc_row = acc_data + i * dv;
      const bool seen = running_sum[i] > 0;
      const T inverse = seen ? 1 / running_sum[i] : 0;
      for (int64_t d = 0; d < dv; ++d)
        out_row[d] = acc_row[d] * inverse;
      lse_data[(o * plan.heads + h) * plan.num_queries + q0 + i] =
          seen ? running_max[i] + std::log(running_sum[i]) : std::numeric_limits<T>::infinity();
    }
  });
  return {out4, lse};
}

// Backward: the gradients of q4, k4, v4 ((outer, heads or key/value heads, n, f), in T)
// and of the tensors the score function reads (ScoreVariant::tensors(), each its tensor's
// shape, float64 or, for a tensor each score reads its own entry of, its dtype; undefined
// where not wanted) from forward's output and log-sum-exp.
struct TileGrads {
  torch::Tensor query, key, value;
  std::vector<torch::Tensor> tensors;
};

template <typename T>
TileGrads tiles_backward(const TileProblem& problem, const torch::Tensor& q4,
                         const torch::Tensor& k4, const torch::Tensor& v4,
                         const torch::Tensor& out4, const torch::Tensor& lse,
                         const torch::Tensor& grad_out4, const std::vector<bool>& wanted) {
  const TilePlan plan(problem, q4, k4, v4);
  const RowScore<T> score(problem.variant);
  const int64_t kv_heads = k4.size(1), dv = plan.value_dim, hd = plan.head_dim;
  // The gradients are cleared, and D computed, by the tasks that own their rows: fresh pages
  // of a freed gradient are faulted in on first touch, and a serial pass here held a second
  // thread idle for it (docs/threads.md).
  auto grad_q4 = torch::empty(q4.sizes(), q4.options());
  auto grad_k4 = torch::empty(k4.sizes(), k4.options());
  auto grad_v4 = torch::empty(v4.sizes(), v4.options());
  const Slices<T> q(q4), k(k4), v(v4), out(out4), grad_out(grad_out4), grad_q(grad_q4),
      grad_k(grad_k4), grad_v(grad_v4);
  const T* lse_data = lse.data_ptr<T>();
  const auto tensors = problem.variant.tensors();
  const int64_t blocks = plan.num_query_blocks(), lists = plan.outer * plan.heads * blocks;
  // A tensor each score reads its own entry of (a bias over (heads, n, n)) has its gradient
  // written in place, each entry by the one task that reads it: no copies. In float64 for a
  // float64 tensor, else float32 (a 16-bit tensor's is rounded to its dtype after). Read at
  // (h, q_idx, kv_idx) by a batch of several, it is written in place when each task runs every
  // batch slice of its key/value head and key range, adding the slices' terms in order.
  const auto own_entries = [&](size_t t, bool batch_in_task) {
    return wanted[t] && problem.variant.program &&
           problem.variant.program->reads_an_entry_per_score(t, plan.outer == 1 || batch_in_task);
  };
  bool batch_in_task = false;
  for (size_t t = 0; t < tensors.size() && plan.outer > 1; ++t)
    batch_in_task = batch_in_task || (!own_entries(t, false) && own_entries(t, true));
  const int64_t task_batches = batch_in_task ? plan.outer : 1;
  // The tensors not written in place: each task's share of their gradients, summed in task
  // order afterwards (the same inputs give the same gradients); where one copy per task would
  // pass kTaskGradBytes, one copy per worker, summed in float64 in the order the tasks fell to
  // the workers. grad_bytes: one copy.
  int64_t grad_bytes = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (wanted[t] && !own_entries(t, batch_in_task))
      grad_bytes += tensors[t].numel() * int64_t{sizeof(double)};
  }
  // Too few (batch, key/value head) tasks for the workers: each split into key ranges
  // (key_ranges.h), whose dQ slots may take up to dQ's own rows; and into more, smaller ones
  // where they take no more slots and the tasks' copies of the summed gradients stay small
  // (each is cleared and added after the loop).
  const int64_t pairs = plan.outer / task_batches * kv_heads;
  const int64_t most_workers = worker_count(plan.outer * kv_heads * blocks, q4.device());
  const auto ranges_for = [&](int64_t tasks_per_worker) {
    return most_workers == 1 ? 1 : (tasks_per_worker * most_workers + pairs - 1) / pairs;
  };
  const int64_t most_free_ranges = ranges_for(kMostBackwardTasksPerWorker);
  const auto split = split_keys(
      ranges_for(kBackwardTasksPerWorker),
      grad_bytes * pairs * most_free_ranges <= kFreeRangesGradBytes
          ? most_free_ranges
          : ranges_for(kBackwardTasksPerWorker),
      problem.blocks.defined() ? problem.blocks.kv_block_size() : plan.query_block, plan.num_keys,
      lists, plan.query_block,
      [&](int64_t list) {
        return plan.tiles(list / (plan.heads * blocks), list / blocks % plan.heads, list % blocks);
      },
      plan.outer * plan.heads * plan.num_queries);
  const int64_t ranges = split.ranges.count(), tasks = pairs * ranges;
  auto slots = torch::empty({split.slot_rows, hd}, q4.options());
  T* slot_data = slots.template data_ptr<T>();
  std::vector<torch::Tensor> own_entry_grads(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (own_entries(t, batch_in_task))
      own_entry_grads[t] =
          torch::zeros(tensors[t].sizes(),
                       tensors[t].scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);
  }
  const bool per_task = grad_bytes * tasks <= kTaskGradBytes;
  const int64_t workers = worker_count(tasks, q4.device());
  std::vector<std::vector<torch::Tensor>> share_grads(
      static_cast<size_t>(per_task ? tasks : std::max<int64_t>(at::get_num_threads(), 1)));
  run_tasks(tasks, q4.device(), [&](int64_t task) {
    const int64_t pair = task / ranges, r = task % ranges;
    const int64_t first_batch = pair / kv_heads * task_batches, kh = pair % kv_heads;
    const int64_t keys_begin = split.ranges.begin(r), keys_end = split.ranges.end(r, plan.num_keys);
    const auto options = q4.options();
    auto scaled_q = torch::empty({plan.query_block, hd}, options);
    auto scores = torch::empty({plan.query_block * plan.widest_tile}, options);
    auto grad_scores = torch::empty({plan.query_block * plan.widest_tile}, options);
    // What the score function's backward reads (the probabilities overwrite the scores).
    using Kept = typename RowScore<T>::Kept;
    const Kept keeps = score.backward_keeps();
    auto kept = keeps != Kept::kNothing
                    ? torch::empty({plan.query_block * plan.widest_tile}, options)
                    : torch::Tensor();
    auto work = score.workspace(plan.widest_tile);
    std::unique_ptr<bool[]> mask_bits(new bool[plan.query_block * plan.widest_tile]);
    std::vector<T> delta(static_cast<size_t>(plan.query_block));
    std::vector<GradSink> tensor_grads(tensors.size());
    const int64_t share = per_task ? task : workers == 1 ? 0 : at::get_thread_num();
    TORCH_CHECK(share < static_cast<int64_t>(share_grads.size()), "[fused_tiles] worker ", share,
                " of ", share_grads.size());
    auto& grads = share_grads[static_cast<size_t>(share)];
    if (grads.empty())
      grads.resize(tensors.size());
    for (size_t t = 0; t < tensors.size(); ++t) {
      const auto& own = own_entry_grads[t];
      if (own.defined() && own.scalar_type() == torch::kFloat) {
        tensor_grads[t].entries = own.data_ptr<float>();
      } else if (own.defined()) {
        tensor_grads[t].sums = own.data_ptr<double>();
      } else if (wanted[t]) {
        if (!grads[t].defined())
          grads[t] = torch::zeros(tensors[t].sizes(), torch::kDouble);
        tensor_grads[t].sums = grads[t].data_ptr<double>();
      }
    }
    // Every batch slice the task holds, and each query head that reads its key/value head.
    for (int64_t slice = 0; slice < task_batches * plan.group_size; ++slice) {
      const int64_t o = first_batch + slice / plan.group_size;
      const int64_t h = kh * plan.group_size + slice % plan.group_size;
      if (h == kh * plan.group_size) {  // a new batch slice: its key rows are this task's
        clear_rows(grad_k, o, kh, keys_begin, keys_end, hd);
        clear_rows(grad_v, o, kh, keys_begin, keys_end, dv);
      }
      for (int64_t qi = 0; qi < blocks; ++qi) {
        const int64_t q0 = qi * plan.query_block;
        const int64_t bq = std::min(plan.query_block, plan.num_queries - q0);
        const int64_t list = (o * plan.heads + h) * blocks + qi;
        // This range's dQ goes to the gradient (its owner clears it, seen or not) or a slot.
        const bool owns = split.owner_of(list) == r;
        if (owns)
          clear_rows(grad_q, o, h, q0, q0 + bq, hd);
        const auto visits = split.ranges.part(plan.tiles(o, h, qi), r, plan.num_keys);
        if (visits.empty())
          continue;
        auto grad_q_block =
            owns ? matrix(grad_q.row(o, h, q0), bq, hd, grad_q.row_stride)
                 : matrix(slot_data + split.slot_of(list, r) * hd, bq, hd, hd).zero_();
        auto q_block = scaled_q.narrow(0, 0, bq);
        plan.scaled_queries(q, o, h, q0, bq, q_block.data_ptr<T>());
        const auto grad_out_block = matrix(grad_out.row(o, h, q0), bq, dv, grad_out.row_stride);
        const T* row_lse = lse_data + (o * plan.heads + h) * plan.num_queries + q0;
        // D_i = dO_i . O_i, the softmax's backward term.
        for (int64_t i = 0; i < bq; ++i)
          delta[static_cast<size_t>(i)] =
              dot(grad_out.row(o, h, q0 + i), out.row(o, h, q0 + i), dv);
        const T* row_delta = delta.data();
        for (const auto& [visit, whole] : visits) {
          const int64_t k0 = visit.key_begin, bk = visit.keys;
          T* p_data = scores.data_ptr<T>();
          T* kept_data = kept.defined() ? kept.template data_ptr<T>() : nullptr;
          // P = e^(modified scores - lse): 0 where masked, and for a row that sees no key.
          plan.tile_scores(q_block, k, o, h, q0, bq, visit, p_data, score, work, mask_bits.get(),
                           keeps == Kept::kRaw ? kept_data : nullptr, [&](int64_t i, T* row) {
                             if (keeps == Kept::kModified)
                               std::memcpy(kept_data + i * bk, row, bk * sizeof(T));
                             exp_shifted(row, bk, row_lse[i]);
                           });
          const auto p = matrix(p_data, bq, bk, bk);
          // With dropout, P Z (Z the tile's factors, drawn for the whole tile as forward drew
          // them) is what forward multiplied into V.
          auto factors = plan.template dropout_factors<T>(o, h, q0, bq, whole);
          if (factors.defined() && bk != whole.keys)
            factors = factors.narrow(1, k0 - whole.key_begin, bk).contiguous();
          const T* factor = factors.defined() ? factors.template data_ptr<T>() : nullptr;
          const auto dropped = factors.defined() ? p * factors : p;
          const auto k_tile = matrix(k.row(o, kh, k0), bk, hd, k.row_stride);
          const auto v_tile = matrix(v.row(o, kh, k0), bk, dv, v.row_stride);
          // dP = dO V^T, (bq, bk)
          T* ds_data = grad_scores.data_ptr<T>();
          auto ds = matrix(ds_data, bq, bk, bk);
          at::mm_out(ds, grad_out_block, v_tile.t());
          matrix(grad_v.row(o, kh, k0), bk, dv, grad_v.row_stride)
              .addmm_(dropped.t(), grad_out_block);
          // dS = P (dP Z - D), then back through the score function.
          for (int64_t i = 0; i < bq; ++i) {
            T* ds_row = ds_data + i * bk;
            const T* p_row = p_data + i * bk;
            const T d = row_delta[i];
            if (factor != nullptr) {
              const T* row_factor = factor + i * bk;
              for (int64_t j = 0; j < bk; ++j)
                ds_row[j] = p_row[j] * (ds_row[j] * row_factor[j] - d);
            } else {
              for (int64_t j = 0; j < bk; ++j)
                ds_row[j] = p_row[j] * (ds_row[j] - d);
            }
            score.backward(ds_row, kept_data != nullptr ? kept_data + i * bk : nullptr, bk, o, h,
                           q0 + i, k0, work, tensor_grads);
          }
          grad_q_block.addmm_(ds, k_tile, /*beta=*/1, /*alpha=*/plan.problem.scale);
          matrix(grad_k.row(o, kh, k0), bk, hd, grad_k.row_stride).addmm_(ds.t(), q_block);
        }
      }
    }
  });
  // The later ranges' dQ, added in range order.
  if (split.slot_rows > 0) {
    run_tasks(plan.outer * plan.heads, q4.device(), [&](int64_t pair) {
      const int64_t o = pair / plan.heads, h = pair % plan.heads;
      for (int64_t qi = 0; qi < blocks; ++qi) {
        const int64_t q0 = qi * plan.query_block;
        const int64_t bq = std::min(plan.query_block, plan.num_queries - q0);
        auto grad_q_block = matrix(grad_q.row(o, h, q0), bq, hd, grad_q.row_stride);
        for (int64_t r = 0; r < ranges; ++r) {
          const int64_t row = split.slot_of(pair * blocks + qi, r);
          if (row >= 0)
            grad_q_block.add_(matrix(slot_data + row * hd, bq, hd, hd));
        }
      }
    });
  }
  std::vector<torch::Tensor> tensor_grads(own_entry_grads);
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (!wanted[t] || tensor_grads[t].defined())
      continue;
    for (const auto& grads : share_grads) {
      if (grads.empty() || !grads[t].defined())
        continue;
      tensor_grads[t] = tensor_grads[t].defined() ? tensor_grads[t].add_(grads[t]) : grads[t];
    }
    if (!tensor_grads[t].defined())  // no task ran (an empty batch)
      tensor_grads[t] = torch::zeros(tensors[t].sizes(), torch::kDouble);
  }
  return {grad_q4, grad_k4, grad_v4, std::move(tensor_grads)};
}

// (..., n, f) -> (outer, heads, n, f) with unit-stride rows (a view when it can be).
torch::Tensor slices_of(const torch::Tensor& t) {
  return loop_nest::unit_stride_slices(t);
}

// The passes in the inputs' dtype (float32 or float64, as tiles_decline admits).
std::pair<torch::Tensor, torch::Tensor> tiles_forward(const TileProblem& problem,
                                                      const torch::Tensor& q4,
                                                      const torch::Tensor& k4,
                                                      const torch::Tensor& v4) {
  return q4.scalar_type() == torch::kDouble ? tiles_forward<double>(problem, q4, k4, v4)
                                            : tiles_forward<float>(problem, q4, k4, v4);
}

// The backward of a call whose score function's tensors `parameters` want gradients (each
// one of ScoreVariant::tensors(), or a tensor the function does not read): the gradients of
// q4, k4, v4, then of each parameter (zeros for one the function does not read).
std::vector<torch::Tensor> tiles_backward(const TileProblem& problem, const torch::Tensor& q4,
                                          const torch::Tensor& k4, const torch::Tensor& v4,
                                          const torch::Tensor& out4, const torch::Tensor& lse,
                                          const torch::Tensor& grad_out4,
                                          const std::vector<torch::Tensor>& parameters) {
  const auto tensors = problem.variant.tensors();
  std::vector<bool> wanted(tensors.size(), false);
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const auto& parameter : parameters)
      wanted[t] = wanted[t] || parameter.is_same(tensors[t]);
  }
  const auto run =
      q4.scalar_type() == torch::kDouble ? tiles_backward<double> : tiles_backward<float>;
  const auto grads = run(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
  std::vector<torch::Tensor> result{grads.query, grads.key, grads.value};
  for (const auto& parameter : parameters) {
    torch::Tensor grad;
    for (size_t t = 0; t < tensors.size() && !grad.defined(); ++t) {
      if (parameter.is_same(tensors[t]))
        grad = grads.tensors[t].to(parameter.options());
    }
    result.push_back(grad.defined() ? grad : torch::zeros_like(parameter));
  }
  return result;
}

struct FusedTileAttention : public torch::autograd::Function<FusedTileAttention> {
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<TileProblem> problem,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, at::TensorList parameters) {
    auto [out4, lse] = tiles_forward(*problem, slices_of(q), slices_of(k), slices_of(v));
    variable_list to_save{q, k, v, out4, lse};
    to_save.insert(to_save.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["problem"] = c10::IValue::make_capsule(problem);
    return shaped_like(out4, q);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto capsule = ctx->saved_data["problem"].toCapsule();
    const auto& problem = *static_cast<const TileProblem*>(capsule.get());
    const std::vector<torch::Tensor> parameters(saved.begin() + 5, saved.end());
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& v = saved[2];
    auto computed = tiles_backward(problem, slices_of(q), slices_of(k), slices_of(v), saved[3],
                                   saved[4], slices_of(grads[0]), parameters);
    variable_list grads_in{torch::Tensor(), shaped_like(computed[0], q),
                           shaped_like(computed[1], k), shaped_like(computed[2], v)};
    grads_in.insert(grads_in.end(), computed.begin() + 3, computed.end());
    return grads_in;
  }
};

// What the kernel lacks for `input`: "" or why.
std::string tiles_decline(const KernelInput& input, const std::optional<ScoreVariant>& variant,
                          const std::string& why_not_variant) {
  const auto& call = input.call;
  if (!call.query.device().is_cpu())
    return "the fused tile kernel runs on the CPU";
  if (call.query.scalar_type() != torch::kFloat && call.query.scalar_type() != torch::kDouble)
    return c10::str(
        "the fused tile kernel computes in float32 or float64 (16-bit calls arrive as"
        " float32), not ",
        call.query.scalar_type());
  if (call.with_weights)
    return "the fused tile kernel returns no weights (the math backend builds them)";
  if (!variant.has_value())
    return c10::str(
        "the fused tile kernel evaluates named score functions and ScoreGraphs "
        "only, not ",
        why_not_variant, " (the chunked kernel evaluates any score function)");
  const auto& table = variant->table;
  if (variant->kind == ScoreVariant::Kind::kAlibi &&
      (table.dim() != 1 || table.size(0) != call.query.size(1)))
    return c10::str("the fused tile kernel takes ALiBi slopes of one per head (",
                    call.query.size(1), "), not ", shape_string(table));
  if (variant->kind == ScoreVariant::Kind::kRelativeBias && table.size(0) != 1 &&
      table.size(0) != call.query.size(1))
    return c10::str("the fused tile kernel takes a relative-position table of 1 or ",
                    call.query.size(1), " rows, not ", shape_string(table));
  if (variant->kind == ScoreVariant::Kind::kGraph) {
    // A graph LibTorch refuses on one score (a result of another dtype than the score's, an
    // index out of range) stays with the chunked kernel, which raises LibTorch's error.
    try {
      const auto zero = torch::zeros({1, 1, 1, 1}, torch::kInt64);
      apply_score_mod(call.options.score_mod(),
                      torch::zeros({1, 1, 1, 1}, call.query.scalar_type()),
                      {zero, zero, zero, zero});
    } catch (const c10::Error& error) {
      return c10::str(
          "the fused tile kernel leaves a score graph that fails on one score to "
          "the chunked kernel: ",
          error.what_without_backtrace());
    }
  }
  if (call.step == StepKind::kRagged && input.query_tokens() == 1)
    return "a one-query ragged step runs best on the math core";
  return "";
}

c10::intrusive_ptr<TileProblem> problem_of(const KernelInput& input,
                                           const std::optional<ScoreVariant>& variant) {
  const auto& call = input.call;
  const auto& options = call.options;
  auto problem = c10::make_intrusive<TileProblem>();
  problem->mask = input.mask();
  problem->blocks = tile_block_mask(problem->mask, call.query, call.key.size(-2),
                                    options.query_block_size(), torch::kCPU);
  problem->variant = variant.value_or(ScoreVariant{});
  problem->scale = input.scale();
  problem->query_block = options.query_block_size();
  problem->key_block = options.key_block_size();
  problem->dropout_p = input.dropout_p();
  // A split call brings its seed (backward is a second call); any other draws one from the
  // global generator, so torch::manual_seed fixes the masks.
  if (problem->dropout_p > 0.0)
    problem->dropout_seed =
        call.split ? call.dropout_seed
                   : torch::randint(0, int64_t{1} << 62, {1}, torch::kInt64).item<int64_t>();
  return problem;
}

}  // namespace

KernelSpec fused_tiles_spec() {
  return {"fused_tiles", AttentionBackend::kChunked, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            // A graph's program reads its tensors on the CPU: made for CPU calls only (a CUDA
            // call's bias tensor is not copied to be declined).
            std::string why_not_variant;
            const auto variant =
                input.call.query.device().is_cpu()
                    ? score_variant_of(input.call.options.score_mod(), &why_not_variant)
                    : std::nullopt;
            auto declined = tiles_decline(input, variant, why_not_variant);
            // A declined call makes no block mask here (the planner asks on to the next
            // kernel); its plan is made if it is run regardless (the mutation test).
            const auto made =
                declined.empty() ? problem_of(input, variant) : c10::intrusive_ptr<TileProblem>();
            const auto problem_for = [made, variant](const KernelInput& in) {
              return made ? made : problem_of(in, variant);
            };
            SplitKernel split{
                [problem_for](const KernelInput& in) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  auto [out4, lse] = tiles_forward(*problem, slices_of(call.query),
                                                   slices_of(call.key), slices_of(call.value));
                  return std::pair{shaped_like(out4, call.query), lse};
                },
                [problem_for](const KernelInput& in, const SplitSaved& saved) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  auto grads = tiles_backward(*problem, slices_of(call.query), slices_of(call.key),
                                              slices_of(call.value), slices_of(saved.out),
                                              saved.lse.contiguous(), slices_of(saved.grad_out),
                                              saved.parameters);
                  grads[0] = shaped_like(grads[0], call.query);
                  grads[1] = shaped_like(grads[1], call.key);
                  grads[2] = shaped_like(grads[2], call.value);
                  return grads;
                }};
            return KernelDecision{
                std::move(declined),
                [problem_for](const KernelInput& in) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  std::vector<torch::Tensor> parameters;
                  for (const auto& t : problem->variant.tensors()) {
                    if (t.is_floating_point() && t.requires_grad() && torch::GradMode::is_enabled())
                      parameters.push_back(t);
                  }
                  return functional::AttentionOutput{
                      FusedTileAttention::apply(problem, call.query, call.key, call.value,
                                                at::TensorList(parameters)),
                      {}};
                },
                std::move(split)};
          }};
}

}  // namespace attnkit::detail
