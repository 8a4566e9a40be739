// The fused tile kernel's forward (fused_tiles.cpp describes the kernel): per (outer, head,
// query block) task, S = Q K^T per key tile by one GEMM, the rows' score function, mask and
// online softmax, and P V by one GEMM into a float accumulator.
//
// float32 multiplies on oneDNN's float32 micro-kernel (matmul_float32, K^T laid out once per
// key/value head), float64 with LibTorch's GEMM (at::mm_out, addmm_ on the inputs in place),
// the queries scaled first. bfloat16 and float16 multiply on the matrix units
// (matrix_units.h): K^T and V packed once per (outer, key/value head), the queries read in
// place and the scale applied to the float32 scores; P is rounded to the input dtype for P V
// (as FlexAttention's and PyTorch's flash kernels round it), the softmax statistics and the
// accumulator stay float32.

#include <memory>
#include <type_traits>
#include <utility>

#include "core/base/matrix_units.h"
#include "core/base/parallel.h"
#include "core/kernels/fused_tiles.h"

namespace attnkit::detail {

namespace {

template <typename In>
TileForward forward_of(const FusedTileProblem& problem, const torch::Tensor& q4,
                       const torch::Tensor& k4, const torch::Tensor& v4) {
  using T = ComputeType<In>;
  constexpr bool kUnits = kSixteenBit<In>;
  constexpr bool kFloat32 = std::is_same_v<In, float>;
  const TilePlan plan(problem, q4, k4, v4);
  const RowScore<T> score(problem.variant);
  const int64_t dv = plan.value_dim, hd = plan.head_dim, n = plan.num_keys, keys_ld = n + 16;
  auto out4 = torch::empty({plan.outer, plan.heads, plan.num_queries, dv}, q4.options());
  const auto compute = q4.options().dtype(c10::CppTypeToScalarType<T>::value);
  auto lse = torch::empty({plan.outer, plan.heads, plan.num_queries}, compute);
  auto row_max = torch::empty({plan.outer, plan.heads, plan.num_queries}, compute);
  const Slices<In> q(q4), k(k4), v(v4), out(out4);
  T* lse_data = lse.template data_ptr<T>();
  T* row_max_data = row_max.template data_ptr<T>();
  // 16-bit: the output before rounding; K^T and V as the matrix units take them, or V in
  // float32 where P stays unrounded (FusedTileProblem::unrounded_weights).
  torch::Tensor out_float4, keys_t, values, values_float;
  const bool unrounded = kUnits && problem.unrounded_weights;
  if constexpr (kUnits) {
    out_float4 = torch::empty(out4.sizes(), compute);
    keys_t = packed_slices(k4, /*transposed=*/true);
    if (unrounded)
      values_float = v4.to(torch::kFloat).contiguous();  // (outer, g, n, dv)
    else
      values = packed_slices(v4, /*transposed=*/false);
  } else if constexpr (kFloat32) {
    // (outer, g, hd, keys_ld): K^T once per head, its rows padded off a power-of-two stride
    // (rows 4,096 floats apart share the L1 cache's sets).
    keys_t = torch::empty({k4.size(0), k4.size(1), hd, keys_ld}, k4.options());
    keys_t.narrow(3, 0, n).copy_(k4.transpose(2, 3));
  }
  const int64_t blocks = plan.num_query_blocks(), pairs = plan.outer * plan.heads;
  const int64_t kv_heads = k4.size(1);
  run_tasks(pairs * blocks, q4.device(), [&](int64_t task) {
    const int64_t qi = blocks - 1 - task / pairs, pair = task % pairs;
    const int64_t o = pair / plan.heads, h = pair % plan.heads, kh = h / plan.group_size;
    const int64_t q0 = qi * plan.query_block;
    const int64_t bq = std::min(plan.query_block, plan.num_queries - q0);
    // Even widths: the matrix units multiply pairs of keys.
    const int64_t widest = (plan.widest_tile + 1) / 2 * 2;
    auto scores = torch::empty({bq * widest}, compute);
    auto acc = torch::zeros({bq, dv}, compute);
    T* acc_data = acc.template data_ptr<T>();
    torch::Tensor scaled_q, weights;
    if constexpr (kUnits) {
      weights = torch::empty({bq * widest}, q4.options());
    } else {
      scaled_q = torch::empty({bq, hd}, q4.options());
      plan.scaled_queries(q, o, h, q0, bq, scaled_q.template data_ptr<T>());
    }
    std::vector<T> running_max(bq, minus_infinity<T>()), running_sum(bq, 0);
    auto work = score.workspace(plan.widest_tile);
    std::unique_ptr<bool[]> mask_bits(new bool[plan.query_block * plan.widest_tile]);
    for (const auto& visit : plan.tiles(o, h, qi)) {
      const int64_t k0 = visit.key_begin, bk = visit.keys, paired = (bk + 1) / 2 * 2;
      const auto factors = plan.template dropout_factors<T>(o, h, q0, bq, visit);
      const T* factor = factors.defined() ? factors.template data_ptr<T>() : nullptr;
      const auto multiply = [&](T* s) {
        if constexpr (kUnits) {
          const In* keys = keys_t.template data_ptr<In>() + (o * kv_heads + kh) * keys_t.size(2);
          matmul_16bit(bq, bk, hd, q.row(o, h, q0), q.row_stride, keys + k0 * 2, plan.num_keys, s,
                       bk, /*accumulate=*/false);
        } else if constexpr (kFloat32) {
          const float* keys =
              keys_t.template data_ptr<float>() + (o * kv_heads + kh) * hd * keys_ld;
          matmul_float32(bq, bk, hd, scaled_q.template data_ptr<float>(), hd, keys + k0, keys_ld, s,
                         bk, /*accumulate=*/false);
        } else {
          auto product = matrix(s, bq, bk, bk);
          at::mm_out(product, scaled_q, matrix(k.row(o, kh, k0), bk, hd, k.row_stride).t());
        }
      };
      plan.tile_scores(multiply, kUnits ? static_cast<T>(problem.scale) : T(1), o, h, q0, bq, visit,
                       scores.template data_ptr<T>(), score, work, mask_bits.get(),
                       static_cast<T*>(nullptr), [&](int64_t i, T* row) {
                         online_softmax_row(row, bk, running_max[i], running_sum[i],
                                            acc_data + i * dv, dv,
                                            factor != nullptr ? factor + i * bk : nullptr);
                         if constexpr (kUnits) {
                           if (!unrounded) {
                             In* weight_row = weights.template data_ptr<In>() + i * paired;
                             round_row(row, bk, weight_row);
                             if (paired != bk)
                               weight_row[bk] = In(0.0f);
                           }
                         }
                       });
      if constexpr (kUnits) {
        if (unrounded) {  // P V in float32 on unrounded P
          const float* value_rows =
              values_float.template data_ptr<float>() + ((o * kv_heads + kh) * n + k0) * dv;
          matmul_float32(bq, dv, bk, scores.template data_ptr<float>(), bk, value_rows, dv,
                         acc_data, dv, /*accumulate=*/true);
        } else {
          const In* value_rows =
              values.template data_ptr<In>() + (o * kv_heads + kh) * values.size(2);
          matmul_16bit(bq, dv, paired, weights.template data_ptr<In>(), paired,
                       value_rows + k0 * dv, dv, acc_data, dv, /*accumulate=*/true);
        }
      } else if constexpr (kFloat32) {
        matmul_float32(bq, dv, bk, scores.template data_ptr<float>(), bk, v.row(o, kh, k0),
                       v.row_stride, acc_data, dv, /*accumulate=*/true);
      } else {
        acc.addmm_(matrix(scores.template data_ptr<T>(), bq, bk, bk),
                   matrix(v.row(o, kh, k0), bk, dv, v.row_stride));
      }
    }
    if constexpr (kUnits)
      release_matrix_units();
    for (int64_t i = 0; i < bq; ++i) {
      T* acc_row = acc_data + i * dv;
      const bool seen = running_sum[i] != 0;  // NaN: seen, and NaN
      const T inverse = seen ? 1 / running_sum[i] : 0;
      for (int64_t d = 0; d < dv; ++d)
        acc_row[d] *= inverse;
      if constexpr (kUnits) {
        T* float_row = out_float4.template data_ptr<T>() +
                       ((o * plan.heads + h) * plan.num_queries + q0 + i) * dv;
        std::memcpy(float_row, acc_row, dv * sizeof(T));
        round_row(acc_row, dv, out.row(o, h, q0 + i));
      } else {
        std::memcpy(out.row(o, h, q0 + i), acc_row, dv * sizeof(T));
      }
      lse_data[(o * plan.heads + h) * plan.num_queries + q0 + i] =
          seen ? running_max[i] + std::log(running_sum[i]) : std::numeric_limits<T>::infinity();
      // The maximum passes over a NaN score; the sum keeps it (online_softmax_row).
      row_max_data[(o * plan.heads + h) * plan.num_queries + q0 + i] =
          std::isnan(running_sum[i]) ? running_sum[i] : running_max[i];
    }
  });
  return {out4, lse, out_float4, row_max};
}

}  // namespace

TileForward tiles_forward(const FusedTileProblem& problem, const torch::Tensor& q4,
                          const torch::Tensor& k4, const torch::Tensor& v4) {
  switch (q4.scalar_type()) {
    case torch::kDouble:
      return forward_of<double>(problem, q4, k4, v4);
    case torch::kBFloat16:
      return forward_of<c10::BFloat16>(problem, q4, k4, v4);
    case torch::kHalf:
      return forward_of<c10::Half>(problem, q4, k4, v4);
    default:
      return forward_of<float>(problem, q4, k4, v4);
  }
}

}  // namespace attnkit::detail
