// Fused attention for small sequences on CPU: one loop nest per (batch, head) slice computes
// the scores, the causal mask, the softmax, dropout and the weighted sum of the values, and
// one more computes all three gradients.
//
// Why: at the toy sizes attnkit-train runs (n = 16, hd = 16), LibTorch 1.13's CPU `bmm`
// multiplies its small matrices one at a time through the dispatcher (about 1.4 us each,
// 0.35 ms for 256 of them), and the math core spends 14 tensor ops and as many autograd
// nodes on a few microseconds of arithmetic. Here each slice's scores stay in L1 and the
// only tensors are the inputs, the outputs and the weights autograd keeps for backward.
// The inner loops are unit-stride multiply-adds that the compiler vectorizes; the key and
// value slices are transposed into a small buffer so that score rows are such loops too.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "attention_layout.h"
#include "attnkit/functional.h"

namespace attnkit::functional {

namespace {

using detail::as_outer_heads;
using detail::shaped_like;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A (rows, cols) matrix with unit-stride rows.
template <typename T>
struct Rows {
  T* data;
  int64_t stride;
  T* operator[](int64_t i) const { return data + i * stride; }
};

// The (batch, head) slices of an (outer, heads, rows, cols) tensor whose last dimension is
// unit-stride.
template <typename T>
struct Slices {
  T* data;
  int64_t outer_stride, head_stride, row_stride, heads;

  explicit Slices(const torch::Tensor& t4)
      : data(t4.data_ptr<std::remove_const_t<T>>()),
        outer_stride(t4.stride(0)),
        head_stride(t4.stride(1)),
        row_stride(t4.stride(2)),
        heads(t4.size(1)) {}
  Rows<T> operator[](int64_t slice) const {
    return {data + (slice / heads) * outer_stride + (slice % heads) * head_stride, row_stride};
  }
};

// (..., n, f) -> (outer, heads, n, f) with a unit-stride last dimension (a view when it can be).
torch::Tensor unit_stride_slices(const torch::Tensor& t) {
  auto t4 = as_outer_heads(t);
  return t4.stride(3) == 1 ? t4 : t4.contiguous();
}

// An uninitialised (outer, heads, n, f) tensor laid out as (outer, n, heads, f): the layout
// a projection split into heads has, so merging the heads back (or the backward of the
// split) needs no copy.
torch::Tensor empty_heads_interleaved(int64_t outer, int64_t heads, int64_t n, int64_t f,
                                      const torch::TensorOptions& options) {
  return torch::empty({outer, n, heads, f}, options).transpose(1, 2);
}

struct SliceSizes {
  int64_t n, m, d, dv;
  bool causal;
  // Keys query row i sees: all, or (causal, top-left aligned as causal_mask) j <= i.
  int64_t key_end(int64_t i) const { return causal ? std::min(m, i + 1) : m; }
};

// Columns per register block of weighted_row_sum: one AVX register of floats.
constexpr int64_t kBlock = 8;

int64_t round_up_to_block(int64_t x) {
  return (x + kBlock - 1) / kBlock * kBlock;
}

// out[0, width) = sum over r < count of coef[r * coef_stride] * rows[r][0, width).
// The one loop nest of the kernel (scores, context and all gradients are such sums): each
// block of kBlock output columns is summed in registers across all rows, then stored.
// Portable version: the fixed-length inner loop becomes SSE code.
template <typename T>
void weighted_row_sum_portable(int64_t count, const T* coef, int64_t coef_stride,
                               Rows<const T> rows, int64_t width, T* __restrict out) {
  int64_t c0 = 0;
  for (; c0 + kBlock <= width; c0 += kBlock) {
    T acc[kBlock] = {};
    for (int64_t r = 0; r < count; ++r) {
      const T a = coef[r * coef_stride];
      const T* __restrict x = rows[r] + c0;
      for (int64_t l = 0; l < kBlock; ++l)
        acc[l] += a * x[l];
    }
    std::copy(acc, acc + kBlock, out + c0);
  }
  for (; c0 < width; ++c0) {
    T acc = 0;
    for (int64_t r = 0; r < count; ++r)
      acc += coef[r * coef_stride] * rows[r][c0];
    out[c0] = acc;
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define ATTNKIT_HAVE_AVX2_KERNEL 1
// The same sums with one AVX register per block of eight floats (half the instructions),
// for CPUs that have AVX2; chosen at run time, so the library still runs on any x86-64.
__attribute__((target("avx2"))) void weighted_row_sum_avx2(int64_t count, const float* coef,
                                                           int64_t coef_stride,
                                                           Rows<const float> rows, int64_t width,
                                                           float* __restrict out) {
  typedef float Block __attribute__((vector_size(kBlock * sizeof(float))));
  int64_t c0 = 0;
  for (; c0 + kBlock <= width; c0 += kBlock) {
    Block acc = {};
    for (int64_t r = 0; r < count; ++r) {
      Block x;
      std::memcpy(&x, rows[r] + c0, sizeof x);  // an unaligned vector load
      acc += coef[r * coef_stride] * x;
    }
    std::memcpy(out + c0, &acc, sizeof acc);
  }
  if (c0 < width) {
    weighted_row_sum_portable(count, coef, coef_stride, {rows.data + c0, rows.stride}, width - c0,
                              out + c0);
  }
}
#endif

template <typename T>
void weighted_row_sum(int64_t count, const T* coef, int64_t coef_stride, Rows<const T> rows,
                      int64_t width, T* __restrict out) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) {
      weighted_row_sum_avx2(count, coef, coef_stride, rows, width, out);
      return;
    }
  }
#endif
  weighted_row_sum_portable(count, coef, coef_stride, rows, width, out);
}

// Per-thread buffers of the kernel.
template <typename T>
struct Scratch {
  std::vector<T> transposed;   // (f, padded_keys): k^T or v^T, zero beyond the keys
  std::vector<T> row;          // (padded_keys)
  std::vector<T> grad_scores;  // backward: (n, m) dS
  std::vector<T> dropped;      // (n, m) weights * keep, when dropout is on
  int64_t padded_keys;

  Scratch(const SliceSizes& z, int64_t f, bool backward, bool dropout)
      : transposed(f * round_up_to_block(z.m), T(0)),
        row(round_up_to_block(z.m)),
        grad_scores(backward ? z.n * z.m : 0),
        dropped(dropout ? z.n * z.m : 0),
        padded_keys(round_up_to_block(z.m)) {}

  // transposed (f, padded_keys) = rows (m, f) transposed; returns it as rows.
  Rows<const T> transpose(Rows<const T> rows, int64_t m, int64_t f) {
    for (int64_t j = 0; j < m; ++j)
      for (int64_t c = 0; c < f; ++c)
        transposed[c * padded_keys + j] = rows[j][c];
    return {transposed.data(), padded_keys};
  }
};

// `weights` (n, m) receives softmax(q k^T * scale) with zeros above the causal diagonal;
// out (n, dv) = (weights * keep) v, where `keep` (n, m) is the scaled dropout mask or null.
template <typename T>
void forward_slice(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<T> out, T* weights,
                   const T* keep, const SliceSizes& z, T scale, Scratch<T>& scratch) {
  const auto keys_t = scratch.transpose(k, z.m, z.d);  // (d, padded m)
  T* scores = scratch.row.data();
  for (int64_t i = 0; i < z.n; ++i) {
    const int64_t end = z.key_end(i);
    // Whole blocks of keys: the padding columns of keys_t are zero.
    weighted_row_sum(z.d, q[i], 1, keys_t, round_up_to_block(end), scores);
    T* p = weights + i * z.m;
    T row_max = scores[0];
    for (int64_t j = 1; j < end; ++j)
      row_max = std::max(row_max, scores[j]);
    T sum = 0;
    for (int64_t j = 0; j < end; ++j) {
      p[j] = std::exp((scores[j] - row_max) * scale);
      sum += p[j];
    }
    const T inverse = T(1) / sum;
    for (int64_t j = 0; j < end; ++j)
      p[j] *= inverse;
    std::fill(p + end, p + z.m, T(0));
    const T* used = p;
    if (keep) {
      T* dropped = scratch.row.data();
      for (int64_t j = 0; j < end; ++j)
        dropped[j] = p[j] * keep[i * z.m + j];
      used = dropped;
    }
    weighted_row_sum(end, used, 1, v, z.dv, out[i]);
  }
}

// Gradients of one slice. With P the weights, D = P * keep and dD = dO v^T:
// dV = D^T dO, dP = dD * keep, dS = P * (dP - rowsum(dP * P)) * scale, dQ = dS k,
// dK = dS^T q.
template <typename T>
void backward_slice(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<const T> grad_out,
                    const T* weights, const T* keep, Rows<T> grad_q, Rows<T> grad_k, Rows<T> grad_v,
                    const SliceSizes& z, T scale, Scratch<T>& scratch) {
  const auto values_t = scratch.transpose(v, z.m, z.dv);  // (dv, padded m)
  T* grad_dropped = scratch.row.data();
  T* grad_scores = scratch.grad_scores.data();
  for (int64_t i = 0; i < z.n; ++i) {
    const int64_t end = z.key_end(i);
    const T* p = weights + i * z.m;
    weighted_row_sum(z.dv, grad_out[i], 1, values_t, round_up_to_block(end), grad_dropped);
    T* ds = grad_scores + i * z.m;
    T row_dot = 0;
    for (int64_t j = 0; j < end; ++j) {
      ds[j] = keep ? grad_dropped[j] * keep[i * z.m + j] : grad_dropped[j];  // dP
      row_dot += ds[j] * p[j];
    }
    for (int64_t j = 0; j < end; ++j)
      ds[j] = p[j] * (ds[j] - row_dot) * scale;
    std::fill(ds + end, ds + z.m, T(0));
    weighted_row_sum(end, ds, 1, k, z.d, grad_q[i]);
  }
  const T* dropped = weights;
  if (keep) {
    for (int64_t x = 0; x < z.n * z.m; ++x)
      scratch.dropped[x] = weights[x] * keep[x];
    dropped = scratch.dropped.data();
  }
  // Column j of dS and D is zero above the diagonal: rows i >= j only, when causal.
  for (int64_t j = 0; j < z.m; ++j) {
    const int64_t first = z.causal ? std::min(j, z.n) : 0;
    const Rows<const T> q_from{q[first], q.stride}, grad_out_from{grad_out[first], grad_out.stride};
    weighted_row_sum(z.n - first, grad_scores + first * z.m + j, z.m, q_from, z.d, grad_k[j]);
    weighted_row_sum(z.n - first, dropped + first * z.m + j, z.m, grad_out_from, z.dv, grad_v[j]);
  }
}

// Slices per task of at::parallel_for: a slice is a few microseconds of work.
constexpr int64_t kSlicesPerTask = 16;

struct FusedAttention : public torch::autograd::Function<FusedAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, double dropout_p) {
    const auto q4 = unit_stride_slices(q), k4 = unit_stride_slices(k), v4 = unit_stride_slices(v);
    const int64_t outer = q4.size(0), heads = q4.size(1);
    const SliceSizes z{q4.size(2), k4.size(2), q4.size(3), v4.size(3), causal};
    auto out4 = empty_heads_interleaved(outer, heads, z.n, z.dv, q.options());
    auto weights = torch::empty({outer, heads, z.n, z.m}, q.options());
    torch::Tensor keep;
    if (dropout_p > 0.0) {
      // Drawn as torch::dropout draws its mask for (..., n, m) weights, so a seed gives the
      // math path's mask.
      keep = torch::empty_like(weights).bernoulli_(1.0 - dropout_p).div_(1.0 - dropout_p);
    }
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "fused_attention_forward", [&] {
      const Slices<const scalar_t> qs(q4), ks(k4), vs(v4);
      const Slices<scalar_t> os(out4);
      scalar_t* w = weights.data_ptr<scalar_t>();
      const scalar_t* kp = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
      const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(z.d)));
      at::parallel_for(0, outer * heads, kSlicesPerTask, [&](int64_t begin, int64_t end) {
        Scratch<scalar_t> scratch(z, z.d, /*backward=*/false, kp != nullptr);
        for (int64_t s = begin; s < end; ++s) {
          forward_slice(qs[s], ks[s], vs[s], os[s], w + s * z.n * z.m,
                        kp ? kp + s * z.n * z.m : nullptr, z, scale, scratch);
        }
      });
    });
    ctx->save_for_backward({q, k, v, weights, keep});
    ctx->saved_data["causal"] = causal;
    return shaped_like(out4, q);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto q4 = unit_stride_slices(saved[0]), k4 = unit_stride_slices(saved[1]),
               v4 = unit_stride_slices(saved[2]);
    const auto &weights = saved[3], &keep = saved[4];
    const auto grad_out4 = unit_stride_slices(grads[0]);
    const int64_t outer = q4.size(0), heads = q4.size(1);
    const SliceSizes z{q4.size(2), k4.size(2), q4.size(3), v4.size(3),
                       ctx->saved_data["causal"].toBool()};
    auto grad_q4 = empty_heads_interleaved(outer, heads, z.n, z.d, q4.options());
    auto grad_k4 = empty_heads_interleaved(outer, heads, z.m, z.d, k4.options());
    auto grad_v4 = empty_heads_interleaved(outer, heads, z.m, z.dv, v4.options());
    AT_DISPATCH_FLOATING_TYPES(q4.scalar_type(), "fused_attention_backward", [&] {
      const Slices<const scalar_t> qs(q4), ks(k4), vs(v4), gos(grad_out4);
      const Slices<scalar_t> gqs(grad_q4), gks(grad_k4), gvs(grad_v4);
      const scalar_t* w = weights.data_ptr<scalar_t>();
      const scalar_t* kp = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
      const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(z.d)));
      at::parallel_for(0, outer * heads, kSlicesPerTask, [&](int64_t begin, int64_t end) {
        Scratch<scalar_t> scratch(z, z.dv, /*backward=*/true, kp != nullptr);
        for (int64_t s = begin; s < end; ++s) {
          backward_slice(qs[s], ks[s], vs[s], gos[s], w + s * z.n * z.m,
                         kp ? kp + s * z.n * z.m : nullptr, gqs[s], gks[s], gvs[s], z, scale,
                         scratch);
        }
      });
    });
    return {shaped_like(grad_q4, saved[0]), shaped_like(grad_k4, saved[1]),
            shaped_like(grad_v4, saved[2]), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor fused_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const FusedOptions& options) {
  const char* fn = "[fused_attention]";
  detail::check_qkv_layout(fn, query, key, value);
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), fn,
              " runs on CPU only, got query on ", query.device(), ", key on ", key.device(),
              ", value on ", value.device(), "; use scaled_dot_product_attention elsewhere");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kDouble) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              fn, " expected query, key and value all float32 or all float64, got ", dtype, ", ",
              key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(options.dropout_p() >= 0.0 && options.dropout_p() < 1.0, fn,
              " dropout_p must be in [0, 1), got ", options.dropout_p());
  const double dropout_p = options.training() ? options.dropout_p() : 0.0;
  return FusedAttention::apply(query, key, value, options.is_causal(), dropout_p);
}

bool fused_attention_fits(const torch::Tensor& query, const torch::Tensor& key) {
  const auto dtype = query.scalar_type();
  return query.device().is_cpu() && (dtype == torch::kFloat || dtype == torch::kDouble) &&
         query.size(-2) * key.size(-2) <= kFusedAttentionMaxTile;
}

}  // namespace attnkit::functional
