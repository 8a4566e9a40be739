#pragma once

// The fused CPU tile kernel's problem and plan, shared by its forward (fused_tiles_forward.cpp),
// its backward (fused_tiles_backward.cpp) and its spec and autograd (fused_tiles.cpp). The
// kernel is described in fused_tiles.cpp.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention_types.h"
#include "core/base/row_softmax.h"
#include "core/kernels/tile_problem.h"
#include "core/kernels/tile_walk.h"
#include "core/masks/mask_node.h"
#include "core/plan/kernel_spec.h"
#include "core/scores/row_score.h"
#include "core/scores/score_program.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

KernelSpec fused_tiles_spec();  // the planner's table

/// Whether In is a 16-bit dtype that the matrix units multiply (matrix_units.h); its scores,
/// softmax and accumulators are float32.
template <typename In>
constexpr bool kSixteenBit = std::is_same_v<In, c10::BFloat16> || std::is_same_v<In, c10::Half>;

/// The dtype a pass over In computes in: float32 for 16-bit inputs, else In's.
template <typename In>
using ComputeType = std::conditional_t<kSixteenBit<In>, float, In>;

// The fused kernel's settings for one call (tile_problem.h): the score function as a value.
struct FusedTileProblem : TileProblem {
  ScoreVariant variant;
  // 16-bit with a backward to follow: P V in float32 from unrounded P, so that backward's
  // D = rowsum(dO * O) equals rowsum(P * dP) as in FlexAttention's math (from P rounded for a
  // 16-bit product, a per-head bias's gradient, 0 in exact arithmetic, was 1e-2 off where
  // the math's is 1e-7). Without a backward, P is rounded for the matrix units.
  bool unrounded_weights = false;
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
  const FusedTileProblem& problem;
  int64_t outer, heads, group_size, num_queries, num_keys, head_dim, value_dim;
  int64_t query_block, widest_tile;

  TilePlan(const FusedTileProblem& problem, const torch::Tensor& q4, const torch::Tensor& k4,
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

  // The dropout factors of a tile, (bq, keys) row-major (TileDropout); undefined without
  // dropout.
  template <typename T>
  torch::Tensor dropout_factors(int64_t o, int64_t h, int64_t q0, int64_t bq,
                                const TileVisit& visit) const {
    if (!problem.dropout.on())
      return {};
    auto keep = torch::empty({bq, visit.keys}, torch::dtype(c10::CppTypeToScalarType<T>::value));
    problem.dropout.draw(
        keep, TileDropout::place(o, h, q0, visit.key_begin, heads, num_queries, num_keys));
    return keep;
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

  // Scores of a tile in `scores` (bq rows of visit.keys): `multiply(scores)` writes the
  // product of the block's queries and the tile's keys, then each row is multiplied by
  // `row_scale` (1 where the queries came scaled), the score function and the mask are
  // applied, and the row is handed to `row_done(i, row)`. `raw` (when given) keeps the rows as
  // they were before the score function. `mask_bits`: room for a partial tile's entries
  // (query_block * widest_tile).
  template <typename T, typename Multiply, typename RowDone>
  void tile_scores(Multiply&& multiply, T row_scale, int64_t o, int64_t h, int64_t q0, int64_t bq,
                   const TileVisit& visit, T* scores, const RowScore<T>& score,
                   ScoreProgram::Workspace& work, bool* mask_bits, T* raw,
                   RowDone&& row_done) const {
    const int64_t k0 = visit.key_begin, bk = visit.keys;
    multiply(scores);
    torch::Tensor evaluated;
    const bool* bits = allowed(visit, o, h, q0, bq, mask_bits, evaluated);
    for (int64_t i = 0; i < bq; ++i) {
      T* row = scores + i * bk;
      if (row_scale != T(1)) {
        for (int64_t j = 0; j < bk; ++j)
          row[j] *= row_scale;
      }
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

/// One row's step of forward's online softmax (Flash attention's): `row` (the tile's modified
/// scores) becomes its weights against the running maximum, times the row's dropout factors
/// (null: none); the running maximum and sum and the output row `acc_row` (dv) are corrected.
/// The sum counts every weight; only the output's are dropped.
template <typename T>
void online_softmax_row(T* row, int64_t keys, T& running_max, T& running_sum, T* acc_row,
                        int64_t dv, const T* row_factor) {
  // A NaN score is passed over by the maximum and kept by the exponential: the row's
  // weights, sum and output become NaN (docs/masks.md).
  const T new_max = std::max(running_max, row_max(row, keys));
  if (new_max == minus_infinity<T>()) {  // no number seen yet: masked, or NaN
    const bool has_nan = std::any_of(row, row + keys, [](T s) { return std::isnan(s); });
    std::fill(row, row + keys, has_nan ? std::numeric_limits<T>::quiet_NaN() : T(0));
    if (has_nan)
      running_sum = std::numeric_limits<T>::quiet_NaN();
    return;
  }
  const T correction = std::exp(running_max - new_max);
  running_sum = running_sum * correction + exp_shifted(row, keys, new_max);
  running_max = new_max;
  if (correction != 1) {
    for (int64_t d = 0; d < dv; ++d)
      acc_row[d] *= correction;
  }
  if (row_factor != nullptr) {
    for (int64_t j = 0; j < keys; ++j)
      row[j] *= row_factor[j];
  }
}

/// What forward returns: the output (outer, heads, n, dv) in the inputs' dtype, the rows'
/// log-sum-exp (outer, heads, n) in the compute dtype (+inf for a row that sees no key), their
/// largest scores (outer, heads, n) in the compute dtype (-inf for none, NaN where the sum
/// is NaN: a NaN score), and
/// for 16-bit inputs the output before its rounding (float32), from which backward computes
/// D = rowsum(dO * O) (the rounded output's D misses by the rounding, which a per-head bias's
/// gradient, 0 in exact arithmetic, shows).
struct TileForward {
  torch::Tensor out, lse, out_float, row_max;
};

/// The gradients of q4, k4, v4 ((outer, heads or key/value heads, n, f), in their dtype) and
/// of the tensors the score function reads (ScoreVariant::tensors(), each its tensor's
/// shape, float64 or, for a tensor each score reads its own entry of, float32; undefined
/// where not wanted).
struct TileGrads {
  torch::Tensor query, key, value;
  std::vector<torch::Tensor> tensors;
};

/// Forward on (outer, heads, n, f) slices with unit-stride rows: float64, float32, or
/// bfloat16/float16 on the matrix units.
TileForward tiles_forward(const FusedTileProblem& problem, const torch::Tensor& q4,
                          const torch::Tensor& k4, const torch::Tensor& v4);

/// Backward from forward's output (for 16-bit inputs its float32 output, or the rounded one
/// cast to float32) and log-sum-exp.
TileGrads tiles_backward(const FusedTileProblem& problem, const torch::Tensor& q4,
                         const torch::Tensor& k4, const torch::Tensor& v4,
                         const torch::Tensor& out4, const torch::Tensor& lse,
                         const torch::Tensor& grad_out4, const std::vector<bool>& wanted);

}  // namespace attnkit::detail
