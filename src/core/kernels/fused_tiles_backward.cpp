// The fused tile kernel's backward (fused_tiles.cpp describes the kernel): per (outer,
// key/value head, key range) task, P recomputed from the log-sum-exp in the tile's rows and
// the five products per tile as GEMMs: S = Q K^T, dP = dO V^T, dV += (P Z)^T dO, dQ += dS K,
// dK += dS^T Q. Each task owns its range's key and value gradients (one range where the pairs
// are enough for the workers; key_ranges.h); a query block's dQ goes to its gradient from the
// range that owns it and to a slot from the others, added in range order after the loop. The
// table's gradient is summed in task order (every outer slice in one task where a bias over
// (heads, n, n) is written in place).
//
// bfloat16 and float16 multiply on the matrix units (matrix_units.h): K^T, V^T and K packed
// once per (outer, key/value head); P Z and scale dS rounded to the input dtype for their
// products, as FlexAttention's math does; D, dS, the summed score-function gradients and the
// dQ, dK, dV sums in float32, each gradient rounded once.

#include <memory>
#include <utility>

#include "core/base/matrix_units.h"
#include "core/base/parallel.h"
#include "core/kernels/fused_tiles.h"
#include "core/kernels/key_ranges.h"

namespace attnkit::detail {

namespace {

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

// Rows [q0, q0 + bq) of slice (o, h), each `cols` wide, transposed into `out` (cols x
// paired_rows, row-major), columns [bq, paired_rows) zero.
template <typename In>
void transpose_rows(const Slices<In>& s, int64_t o, int64_t h, int64_t q0, int64_t bq, int64_t cols,
                    int64_t paired_rows, In* out) {
  for (int64_t i = 0; i < paired_rows; ++i) {
    const In* row = i < bq ? s.row(o, h, q0 + i) : nullptr;
    for (int64_t c = 0; c < cols; ++c)
      out[c * paired_rows + i] = row != nullptr ? row[c] : In(0.0f);
  }
}

// A (cols x keys) float32 sum, transposed and rounded into rows [first, first + keys) of
// slice (o, h).
template <typename In>
void round_transposed(const float* sums, int64_t cols, int64_t keys, const Slices<In>& s, int64_t o,
                      int64_t h, int64_t first) {
  for (int64_t j = 0; j < keys; ++j) {
    In* row = s.row(o, h, first + j);
    for (int64_t c = 0; c < cols; ++c)
      row[c] = In(sums[c * keys + j]);
  }
}

template <typename In>
TileGrads backward_of(const FusedTileProblem& problem, const torch::Tensor& q4,
                      const torch::Tensor& k4, const torch::Tensor& v4, const torch::Tensor& out4,
                      const torch::Tensor& lse, const torch::Tensor& grad_out4,
                      const std::vector<bool>& wanted) {
  using T = ComputeType<In>;
  constexpr bool kUnits = kSixteenBit<In>;
  const TilePlan plan(problem, q4, k4, v4);
  const RowScore<T> score(problem.variant);
  const int64_t kv_heads = k4.size(1), dv = plan.value_dim, hd = plan.head_dim;
  const auto compute = q4.options().dtype(c10::CppTypeToScalarType<T>::value);
  // The gradients are cleared, and D computed, by the tasks that own their rows: fresh pages
  // of a freed gradient are faulted in on first touch, and a serial pass here held a second
  // thread idle for it (docs/threads.md). 16-bit: dQ sums in float32 and is rounded once at
  // the end; each task sums its keys' dK^T and dV^T in float32 and rounds them.
  auto grad_q4 = torch::empty(q4.sizes(), compute);
  auto grad_k4 = torch::empty(k4.sizes(), k4.options());
  auto grad_v4 = torch::empty(v4.sizes(), v4.options());
  const Slices<In> q(q4), k(k4), v(v4), grad_out(grad_out4), grad_k(grad_k4), grad_v(grad_v4);
  const Slices<T> out(out4), grad_q(grad_q4);
  const T* lse_data = lse.template data_ptr<T>();
  // 16-bit: K^T (for S), V^T (for dP) and K (for dQ) as the matrix units take them.
  torch::Tensor keys_t, values_t, keys;
  if constexpr (kUnits) {
    keys_t = packed_slices(k4, /*transposed=*/true);
    values_t = packed_slices(v4, /*transposed=*/true);
    keys = packed_slices(k4, /*transposed=*/false);
  }
  const auto tensors = problem.variant.tensors();
  const int64_t blocks = plan.num_query_blocks(), lists = plan.outer * plan.heads * blocks;
  // A tensor each score reads its own entry of (a bias over (heads, n, n)) has its gradient
  // written in place, each entry by the one task that reads it: no copies. In float64 for a
  // float64 tensor, else float32 (a 16-bit tensor's is rounded to its dtype after). Read at
  // (h, q_idx, kv_idx) by a batch of several, it is written in place when each task runs every
  // batch slice of its key/value head and key range, adding the slices' terms in order.
  const auto own_entries = [&](size_t t, bool batch_in_task) {
    return wanted[t] && problem.variant.program() != nullptr &&
           problem.variant.program()->reads_an_entry_per_score(t, plan.outer == 1 || batch_in_task);
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
  auto slots = torch::empty({split.slot_rows, hd}, compute);
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
    const int64_t widest = (plan.widest_tile + 1) / 2 * 2,
                  paired_block = (plan.query_block + 1) / 2 * 2;
    auto scaled_q = kUnits ? torch::Tensor() : torch::empty({plan.query_block, hd}, compute);
    auto scores = torch::empty({plan.query_block * plan.widest_tile}, compute);
    auto grad_scores = torch::empty({plan.query_block * plan.widest_tile}, compute);
    // 16-bit: the block's Q^T and dO^T (A of dK^T and dV^T), the tile's P Z and scale dS in
    // pairs of query rows (their B) and scale dS by rows (A of dQ), and the range's dK^T and
    // dV^T in float32.
    torch::Tensor queries_t, grad_out_t, weight_pairs, grad_pairs, grad_rows, grad_keys_t,
        grad_values_t, dropped_rows;
    const int64_t range_keys = keys_end - keys_begin;
    if constexpr (kUnits) {
      const auto in = q4.options();
      queries_t = torch::empty({hd * paired_block}, in);
      grad_out_t = torch::empty({dv * paired_block}, in);
      weight_pairs = torch::empty({paired_block * widest}, in);
      grad_pairs = torch::empty({paired_block * widest}, in);
      grad_rows = torch::empty({plan.query_block * widest}, in);
      grad_keys_t = torch::empty({hd * range_keys}, compute);
      grad_values_t = torch::empty({dv * range_keys}, compute);
      dropped_rows = torch::empty({2 * plan.widest_tile}, compute);
    }
    // What the score function's backward reads (the probabilities overwrite the scores).
    using Kept = typename RowScore<T>::Kept;
    const Kept keeps = score.backward_keeps();
    auto kept = keeps != Kept::kNothing
                    ? torch::empty({plan.query_block * plan.widest_tile}, compute)
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
        if constexpr (kUnits) {
          grad_keys_t.zero_();
          grad_values_t.zero_();
        } else {
          clear_rows(grad_k, o, kh, keys_begin, keys_end, hd);
          clear_rows(grad_v, o, kh, keys_begin, keys_end, dv);
        }
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
        torch::Tensor q_block, grad_out_block;
        const int64_t paired_rows = (bq + 1) / 2 * 2;
        if constexpr (kUnits) {
          transpose_rows(q, o, h, q0, bq, hd, paired_rows, queries_t.template data_ptr<In>());
          transpose_rows(grad_out, o, h, q0, bq, dv, paired_rows,
                         grad_out_t.template data_ptr<In>());
        } else {
          q_block = scaled_q.narrow(0, 0, bq);
          plan.scaled_queries(q, o, h, q0, bq, q_block.template data_ptr<T>());
          grad_out_block = matrix(grad_out.row(o, h, q0), bq, dv, grad_out.row_stride);
        }
        const T* row_lse = lse_data + (o * plan.heads + h) * plan.num_queries + q0;
        // D_i = dO_i . O_i, the softmax's backward term (16-bit: O before its rounding).
        for (int64_t i = 0; i < bq; ++i) {
          if constexpr (kUnits) {
            const In* grad_row = grad_out.row(o, h, q0 + i);
            const T* out_row = out.row(o, h, q0 + i);
            T sum = 0;
            for (int64_t d = 0; d < dv; ++d)
              sum += static_cast<T>(grad_row[d]) * out_row[d];
            delta[static_cast<size_t>(i)] = sum;
          } else {
            delta[static_cast<size_t>(i)] =
                dot(grad_out.row(o, h, q0 + i), out.row(o, h, q0 + i), dv);
          }
        }
        const T* row_delta = delta.data();
        for (const auto& [visit, whole] : visits) {
          const int64_t k0 = visit.key_begin, bk = visit.keys;
          T* p_data = scores.template data_ptr<T>();
          T* kept_data = kept.defined() ? kept.template data_ptr<T>() : nullptr;
          // P = e^(modified scores - lse): 0 where masked, and for a row that sees no key.
          const auto multiply = [&](T* s) {
            if constexpr (kUnits) {
              const In* keys_tile =
                  keys_t.template data_ptr<In>() + (o * kv_heads + kh) * keys_t.size(2);
              matmul_16bit(bq, bk, hd, q.row(o, h, q0), q.row_stride, keys_tile + k0 * 2,
                           plan.num_keys, s, bk, /*accumulate=*/false);
            } else {
              auto product = matrix(s, bq, bk, bk);
              at::mm_out(product, q_block, matrix(k.row(o, kh, k0), bk, hd, k.row_stride).t());
            }
          };
          plan.tile_scores(multiply, kUnits ? static_cast<T>(problem.scale) : T(1), o, h, q0, bq,
                           visit, p_data, score, work, mask_bits.get(),
                           keeps == Kept::kRaw ? kept_data : nullptr, [&](int64_t i, T* row) {
                             if (keeps == Kept::kModified)
                               std::memcpy(kept_data + i * bk, row, bk * sizeof(T));
                             exp_shifted(row, bk, row_lse[i]);
                           });
          // With dropout, P Z (Z the tile's factors, drawn for the whole tile as forward drew
          // them) is what forward multiplied into V.
          auto factors = plan.template dropout_factors<T>(o, h, q0, bq, whole);
          if (factors.defined() && bk != whole.keys)
            factors = factors.narrow(1, k0 - whole.key_begin, bk).contiguous();
          const T* factor = factors.defined() ? factors.template data_ptr<T>() : nullptr;
          // dP = dO V^T, (bq, bk); dV += (P Z)^T dO.
          T* ds_data = grad_scores.template data_ptr<T>();
          const int64_t paired = (bk + 1) / 2 * 2, k_at = k0 - keys_begin;
          if constexpr (kUnits) {
            const In* values_tile =
                values_t.template data_ptr<In>() + (o * kv_heads + kh) * values_t.size(2);
            matmul_16bit(bq, bk, dv, grad_out.row(o, h, q0), grad_out.row_stride,
                         values_tile + k0 * 2, plan.num_keys, ds_data, bk, /*accumulate=*/false);
            In* pairs_data = weight_pairs.template data_ptr<In>();
            for (int64_t i = 0; i < paired_rows; i += 2) {
              const T* first = p_data + i * bk;
              const T* second = i + 1 < bq ? first + bk : nullptr;
              if (factor != nullptr) {  // P Z
                T* dropped = dropped_rows.template data_ptr<T>();
                for (int64_t pair_row = 0; pair_row < (second != nullptr ? 2 : 1); ++pair_row) {
                  const int64_t at = (i + pair_row) * bk;
                  for (int64_t j = 0; j < bk; ++j)
                    dropped[pair_row * bk + j] = p_data[at + j] * factor[at + j];
                }
                first = dropped;
                second = second != nullptr ? dropped + bk : nullptr;
              }
              round_row_pair(first, second, bk, pairs_data + i * bk);
            }
            matmul_16bit(dv, bk, paired_rows, grad_out_t.template data_ptr<In>(), paired_rows,
                         pairs_data, bk, grad_values_t.template data_ptr<T>() + k_at, range_keys,
                         /*accumulate=*/true);
          } else {
            const auto p = matrix(p_data, bq, bk, bk);
            const auto dropped = factors.defined() ? p * factors : p;
            auto product = matrix(ds_data, bq, bk, bk);
            at::mm_out(product, grad_out_block, matrix(v.row(o, kh, k0), bk, dv, v.row_stride).t());
            matrix(grad_v.row(o, kh, k0), bk, dv, grad_v.row_stride)
                .addmm_(dropped.t(), grad_out_block);
          }
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
          if constexpr (kUnits) {
            // dQ += (scale dS) K and dK^T += Q^T (scale dS): scale dS rounded once.
            const T scale = static_cast<T>(problem.scale);
            In* rows_data = grad_rows.template data_ptr<In>();
            In* pairs_data = grad_pairs.template data_ptr<In>();
            for (int64_t i = 0; i < bq; ++i) {
              T* ds_row = ds_data + i * bk;
              for (int64_t j = 0; j < bk; ++j)
                ds_row[j] *= scale;
              round_row(ds_row, bk, rows_data + i * paired);
              if (paired != bk)
                rows_data[i * paired + bk] = In(0.0f);
            }
            for (int64_t i = 0; i < paired_rows; i += 2)
              round_row_pair(ds_data + i * bk, i + 1 < bq ? ds_data + (i + 1) * bk : nullptr, bk,
                             pairs_data + i * bk);
            const In* key_rows = keys.template data_ptr<In>() + (o * kv_heads + kh) * keys.size(2);
            matmul_16bit(bq, hd, paired, rows_data, paired, key_rows + k0 * hd, hd,
                         grad_q_block.template data_ptr<T>(), grad_q_block.stride(0),
                         /*accumulate=*/true);
            matmul_16bit(hd, bk, paired_rows, queries_t.template data_ptr<In>(), paired_rows,
                         pairs_data, bk, grad_keys_t.template data_ptr<T>() + k_at, range_keys,
                         /*accumulate=*/true);
          } else {
            const auto ds = matrix(ds_data, bq, bk, bk);
            grad_q_block.addmm_(ds, matrix(k.row(o, kh, k0), bk, hd, k.row_stride), /*beta=*/1,
                                /*alpha=*/plan.problem.scale);
            matrix(grad_k.row(o, kh, k0), bk, hd, grad_k.row_stride).addmm_(ds.t(), q_block);
          }
        }
      }
      // The slice's last query head: its key rows' dK and dV are complete.
      if constexpr (kUnits) {
        if (h == (kh + 1) * plan.group_size - 1) {
          round_transposed(grad_keys_t.template data_ptr<T>(), hd, range_keys, grad_k, o, kh,
                           keys_begin);
          round_transposed(grad_values_t.template data_ptr<T>(), dv, range_keys, grad_v, o, kh,
                           keys_begin);
        }
      }
    }
    if constexpr (kUnits)
      release_matrix_units();
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
  return {kUnits ? grad_q4.to(q4.scalar_type()) : grad_q4, grad_k4, grad_v4,
          std::move(tensor_grads)};
}

}  // namespace

TileGrads tiles_backward(const FusedTileProblem& problem, const torch::Tensor& q4,
                         const torch::Tensor& k4, const torch::Tensor& v4,
                         const torch::Tensor& out4, const torch::Tensor& lse,
                         const torch::Tensor& grad_out4, const std::vector<bool>& wanted) {
  switch (q4.scalar_type()) {
    case torch::kDouble:
      return backward_of<double>(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
    case torch::kBFloat16:
      return backward_of<c10::BFloat16>(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
    case torch::kHalf:
      return backward_of<c10::Half>(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
    default:
      return backward_of<float>(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
  }
}

}  // namespace attnkit::detail
