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
//
// Grouped-query attention reads each key/value slice for every query head of its group;
// backward gives each query head its own key and value gradients, summed per group at the
// end (the kernel's tensors are small). A sliding window limits each row's softmax, context
// and gradient sums to the keys in its window.

#include "core/kernels/loop_nest_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "core/base/attention_layout.h"
#include "core/base/avx2.h"
#include "core/base/parallel.h"
#include "core/base/row_softmax.h"

namespace attnkit::detail::loop_nest {

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

torch::Tensor unit_stride_slices(const torch::Tensor& t) {
  auto t4 = as_outer_heads(t);
  return t4.stride(3) == 1 ? t4 : t4.contiguous();
}

torch::Tensor empty_heads_interleaved(int64_t outer, int64_t heads, int64_t n, int64_t f,
                                      const torch::TensorOptions& options) {
  return torch::empty({outer, n, heads, f}, options).transpose(1, 2);
}

struct SliceSizes {
  int64_t n, m, d, dv;
  bool causal;
  int64_t query_offset;  // key position of query row 0 (causal only)
  int64_t window;        // sliding window (causal only); 0: none
  // Keys past this one are no row's (a ragged row's valid keys end there; forward only).
  int64_t key_limit = std::numeric_limits<int64_t>::max();
  // Keys query row i sees: [key_begin(i), key_end(i)); all, or (causal, as causal_mask)
  // j <= query_offset + i, and (window) j > query_offset + i - window; none from key_limit.
  int64_t key_end(int64_t i) const {
    return std::min(causal ? std::min(m, query_offset + i + 1) : m, key_limit);
  }
  int64_t key_begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(query_offset + i - window + 1, 0, m) : 0;
  }
  // Query rows that see key j: [first_row(j), row_end(j)), within [0, n].
  int64_t first_row(int64_t j) const {
    return causal ? std::clamp<int64_t>(j - query_offset, 0, n) : 0;
  }
  int64_t row_end(int64_t j) const {
    return window > 0 ? std::clamp<int64_t>(j - query_offset + window, 0, n) : n;
  }
};

// Where a slice's keys and values are: query slice s of (outer, heads) uses key/value slice
// kv_slice(s) of (outer, heads / group_size).
struct HeadGroups {
  int64_t heads, group_size;
  int64_t kv_slice(int64_t s) const {
    return (s / heads) * (heads / group_size) + (s % heads) / group_size;
  }
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

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
using detail::first_lanes;
using detail::has_avx2_fma;
using detail::horizontal_sum;

// Blocks columns [0, kBlocks * kBlock) of the sums, with kPartials independent partial sums
// per block (rows r, r + kPartials, ...), added at the end. One accumulator would make
// every fused multiply-add wait for the one before it (4 cycles); kBlocks * kPartials = 8
// chains keep both FMA units busy.
template <int kBlocks, int kPartials>
__attribute__((target("avx2,fma"), always_inline)) inline void weighted_row_sum_block_avx2(
    int64_t count, const float* coef, int64_t coef_stride, Rows<const float> rows,
    float* __restrict out) {
  __m256 acc[kPartials][kBlocks];
  for (int p = 0; p < kPartials; ++p)
    for (int b = 0; b < kBlocks; ++b)
      acc[p][b] = _mm256_setzero_ps();
  int64_t r = 0;
  for (; r + kPartials <= count; r += kPartials) {
    for (int p = 0; p < kPartials; ++p) {
      const __m256 a = _mm256_set1_ps(coef[(r + p) * coef_stride]);
      const float* x = rows[r + p];
      for (int b = 0; b < kBlocks; ++b)
        acc[p][b] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + b * kBlock), acc[p][b]);
    }
  }
  for (; r < count; ++r) {
    const __m256 a = _mm256_set1_ps(coef[r * coef_stride]);
    for (int b = 0; b < kBlocks; ++b)
      acc[0][b] = _mm256_fmadd_ps(a, _mm256_loadu_ps(rows[r] + b * kBlock), acc[0][b]);
  }
  for (int b = 0; b < kBlocks; ++b) {
    __m256 sum = acc[0][b];
    for (int p = 1; p < kPartials; ++p)
      sum = _mm256_add_ps(sum, acc[p][b]);
    _mm256_storeu_ps(out + b * kBlock, sum);
  }
}

// The same sums with AVX2 registers and fused multiply-adds, for CPUs that have them;
// chosen at run time, so the library still runs on any x86-64.
__attribute__((target("avx2,fma"))) void weighted_row_sum_avx2(int64_t count, const float* coef,
                                                               int64_t coef_stride,
                                                               Rows<const float> rows,
                                                               int64_t width,
                                                               float* __restrict out) {
  int64_t c0 = 0;
  const auto from = [&](int64_t c) { return Rows<const float>{rows.data + c, rows.stride}; };
  for (; c0 + 4 * kBlock <= width; c0 += 4 * kBlock)
    weighted_row_sum_block_avx2<4, 2>(count, coef, coef_stride, from(c0), out + c0);
  if (c0 + 2 * kBlock <= width) {
    weighted_row_sum_block_avx2<2, 4>(count, coef, coef_stride, from(c0), out + c0);
    c0 += 2 * kBlock;
  }
  if (c0 + kBlock <= width) {
    weighted_row_sum_block_avx2<1, 4>(count, coef, coef_stride, from(c0), out + c0);
    c0 += kBlock;
  }
  if (c0 < width)
    weighted_row_sum_portable(count, coef, coef_stride, from(c0), width - c0, out + c0);
}
#endif

template <typename T>
void weighted_row_sum(int64_t count, const T* coef, int64_t coef_stride, Rows<const T> rows,
                      int64_t width, T* __restrict out) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma()) {
      weighted_row_sum_avx2(count, coef, coef_stride, rows, width, out);
      return;
    }
  }
#endif
  weighted_row_sum_portable(count, coef, coef_stride, rows, width, out);
}

// Output rows per tile of weighted_row_sums: each row read from `rows` is used for this
// many outputs while it is in registers.
constexpr int64_t kTileRows = 4;

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// kTileRows outputs by kBlocks column blocks, one register each: per row r, kBlocks loads
// serve kTileRows * kBlocks fused multiply-adds.
template <int kBlocks>
__attribute__((target("avx2,fma"), always_inline)) inline void weighted_row_sums_tile_avx2(
    int64_t count, const float* coef, int64_t coef_step, int64_t coef_stride,
    Rows<const float> rows, Rows<float> out) {
  __m256 acc[kTileRows][kBlocks];
  for (int t = 0; t < kTileRows; ++t)
    for (int b = 0; b < kBlocks; ++b)
      acc[t][b] = _mm256_setzero_ps();
  for (int64_t r = 0; r < count; ++r) {
    __m256 x[kBlocks];
    for (int b = 0; b < kBlocks; ++b)
      x[b] = _mm256_loadu_ps(rows[r] + b * kBlock);
    for (int t = 0; t < kTileRows; ++t) {
      const __m256 a = _mm256_set1_ps(coef[t * coef_step + r * coef_stride]);
      for (int b = 0; b < kBlocks; ++b)
        acc[t][b] = _mm256_fmadd_ps(a, x[b], acc[t][b]);
    }
  }
  for (int t = 0; t < kTileRows; ++t)
    for (int b = 0; b < kBlocks; ++b)
      _mm256_storeu_ps(out[t] + b * kBlock, acc[t][b]);
}

__attribute__((target("avx2,fma"))) void weighted_row_sums_avx2(
    int64_t outputs, int64_t count, const float* coef, int64_t coef_step, int64_t coef_stride,
    Rows<const float> rows, int64_t width, Rows<float> out) {
  int64_t t0 = 0;
  for (; t0 + kTileRows <= outputs; t0 += kTileRows) {
    const float* tile_coef = coef + t0 * coef_step;
    int64_t c0 = 0;
    for (; c0 + 2 * kBlock <= width; c0 += 2 * kBlock) {
      weighted_row_sums_tile_avx2<2>(count, tile_coef, coef_step, coef_stride,
                                     {rows.data + c0, rows.stride}, {out[t0] + c0, out.stride});
    }
    if (c0 + kBlock <= width) {
      weighted_row_sums_tile_avx2<1>(count, tile_coef, coef_step, coef_stride,
                                     {rows.data + c0, rows.stride}, {out[t0] + c0, out.stride});
      c0 += kBlock;
    }
    for (int64_t t = 0; c0 < width && t < kTileRows; ++t) {
      weighted_row_sum_portable(count, tile_coef + t * coef_step, coef_stride,
                                {rows.data + c0, rows.stride}, width - c0, out[t0 + t] + c0);
    }
  }
  for (; t0 < outputs; ++t0)
    weighted_row_sum_avx2(count, coef + t0 * coef_step, coef_stride, rows, width, out[t0]);
}
#endif

// Several sums over the same rows: for t < outputs,
// out[t][0, width) = sum over r < count of coef[t * coef_step + r * coef_stride] * rows[r].
// Scores, context and every gradient of a group of query rows (or key rows) are such sums.
template <typename T>
void weighted_row_sums(int64_t outputs, int64_t count, const T* coef, int64_t coef_step,
                       int64_t coef_stride, Rows<const T> rows, int64_t width, Rows<T> out) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<T, float>) {
    if (has_avx2_fma()) {
      weighted_row_sums_avx2(outputs, count, coef, coef_step, coef_stride, rows, width, out);
      return;
    }
  }
#endif
  for (int64_t t = 0; t < outputs; ++t)
    weighted_row_sum(count, coef + t * coef_step, coef_stride, rows, width, out[t]);
}

// Per-thread buffers of the kernel.
template <typename T>
struct Scratch {
  int64_t padded_keys;
  std::vector<T> transposed;   // (f, padded_keys): k^T or v^T, zero beyond the keys
  std::vector<T> tile;         // (kTileRows, padded_keys): scores, or backward's dD rows
  std::vector<T> dropped;      // forward: (kTileRows, m) of weights * keep; backward: (n, m)
  std::vector<T> grad_scores;  // backward: (n, m) dS

  Scratch(const SliceSizes& z, int64_t f, bool backward, bool dropout)
      : padded_keys(round_up_to_block(z.m)),
        transposed(f * padded_keys, T(0)),
        tile(kTileRows * padded_keys),
        dropped(dropout ? (backward ? z.n : kTileRows) * z.m : 0),
        grad_scores(backward ? z.n * z.m : 0) {}

  // transposed (f, padded_keys) = rows (m, f) transposed; returns it as rows.
  Rows<const T> transpose(Rows<const T> rows, int64_t m, int64_t f) {
    for (int64_t c = 0; c < f; ++c)
      for (int64_t j = 0; j < m; ++j)
        transposed[c * padded_keys + j] = rows[j][c];
    return {transposed.data(), padded_keys};
  }
  Rows<T> tile_rows() { return {tile.data(), padded_keys}; }
};

// The query rows [first, first + count) of a tile (at most kTileRows) and the keys any of
// them sees: [key_begin(first), key_end(last)), as both bounds grow with the row.
struct RowTile {
  int64_t first, count, key_begin, key_end;
  RowTile(const SliceSizes& z, int64_t first_row)
      : first(first_row),
        count(std::min(kTileRows, z.n - first_row)),
        key_begin(z.key_begin(first_row)),
        key_end(z.key_end(first_row + count - 1)) {}
};

// `weights` (n, m) receives softmax(q k^T * scale) with zeros outside the keys each row
// sees; out (n, dv) = (weights * keep) v, where `keep` (n, m) is the scaled dropout mask or
// null. A tile of query rows at a time, each key and value row loaded once per tile.
template <typename T>
void forward_slice(Rows<const T> q, Rows<const T> k, Rows<const T> v, Rows<T> out, T* weights,
                   const T* keep, const SliceSizes& z, T scale, Scratch<T>& scratch) {
  const auto keys_t = scratch.transpose(k, z.m, z.d);  // (d, padded m)
  const Rows<T> scores = scratch.tile_rows();          // (kTileRows, padded m)
  for (int64_t i0 = 0; i0 < z.n; i0 += kTileRows) {
    const RowTile tile(z, i0);
    // Whole blocks of keys: the padding columns of keys_t are zero.
    weighted_row_sums(tile.count, z.d, q[i0], q.stride, 1, keys_t, round_up_to_block(tile.key_end),
                      scores);
    for (int64_t t = 0; t < tile.count; ++t) {
      const int64_t i = i0 + t, begin = z.key_begin(i), end = std::max(begin, z.key_end(i));
      T* p = weights + i * z.m;
      if (end > begin)  // a ragged row's padding queries may see no key: zero weights
        softmax_row(scores[t] + begin, end - begin, scale, p + begin);
      std::fill(p, p + begin, T(0));
      std::fill(p + end, p + z.m, T(0));
      if (keep) {
        for (int64_t j = 0; j < z.m; ++j)
          scratch.dropped[t * z.m + j] = p[j] * keep[i * z.m + j];
      }
    }
    // Rows of the tile are zero outside their own keys, so all sum over the tile's keys.
    const T* used = keep ? scratch.dropped.data() : weights + i0 * z.m;
    weighted_row_sums(tile.count, std::max<int64_t>(tile.key_end - tile.key_begin, 0),
                      used + tile.key_begin, z.m, 1, {v[tile.key_begin], v.stride}, z.dv,
                      {out[i0], out.stride});
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
  const Rows<T> grad_dropped = scratch.tile_rows();       // (kTileRows, padded m)
  T* grad_scores = scratch.grad_scores.data();
  for (int64_t i0 = 0; i0 < z.n; i0 += kTileRows) {
    const RowTile tile(z, i0);
    weighted_row_sums(tile.count, z.dv, grad_out[i0], grad_out.stride, 1, values_t,
                      round_up_to_block(tile.key_end), grad_dropped);
    for (int64_t t = 0; t < tile.count; ++t) {
      const int64_t i = i0 + t, begin = z.key_begin(i), end = z.key_end(i);
      const T* p = weights + i * z.m;
      const T* dd = grad_dropped[t];
      T* ds = grad_scores + i * z.m;
      for (int64_t j = begin; j < end; ++j)
        ds[j] = keep ? dd[j] * keep[i * z.m + j] : dd[j];  // dP
      const T row_dot = dot(ds + begin, p + begin, end - begin);
      for (int64_t j = begin; j < end; ++j)
        ds[j] = p[j] * (ds[j] - row_dot) * scale;
      std::fill(ds, ds + begin, T(0));
      std::fill(ds + end, ds + z.m, T(0));
    }
    weighted_row_sums(tile.count, tile.key_end - tile.key_begin,
                      grad_scores + i0 * z.m + tile.key_begin, z.m, 1,
                      {k[tile.key_begin], k.stride}, z.d, {grad_q[i0], grad_q.stride});
  }
  const T* dropped = weights;
  if (keep) {
    for (int64_t x = 0; x < z.n * z.m; ++x)
      scratch.dropped[x] = weights[x] * keep[x];
    dropped = scratch.dropped.data();
  }
  // Column j of dS and D is zero outside the rows that see key j; a tile of keys sums over
  // the rows that see any of them, [first_row(j0), row_end(last)), as both bounds grow with j.
  for (int64_t j0 = 0; j0 < z.m; j0 += kTileRows) {
    const int64_t keys = std::min(kTileRows, z.m - j0);
    const int64_t first = z.first_row(j0);
    const int64_t rows = std::max<int64_t>(z.row_end(j0 + keys - 1) - first, 0);
    const Rows<const T> q_from{q[first], q.stride}, grad_out_from{grad_out[first], grad_out.stride};
    weighted_row_sums(keys, rows, grad_scores + first * z.m + j0, 1, z.m, q_from, z.d,
                      {grad_k[j0], grad_k.stride});
    weighted_row_sums(keys, rows, dropped + first * z.m + j0, 1, z.m, grad_out_from, z.dv,
                      {grad_v[j0], grad_v.stride});
  }
}

// Slices per task of at::parallel_for: a slice is a few microseconds of work.
constexpr int64_t kSlicesPerTask = 16;

std::pair<torch::Tensor, torch::Tensor> run_forward(
    const torch::Tensor& q4, const torch::Tensor& k4, const torch::Tensor& v4, torch::Tensor& out4,
    bool causal, int64_t query_offset, int64_t window, double dropout_p, const RowBounds* rows) {
  TORCH_INTERNAL_ASSERT(!rows || dropout_p == 0.0, "ragged rows are for inference");
  const int64_t outer = q4.size(0), heads = q4.size(1);
  const SliceSizes z{q4.size(2), k4.size(2), q4.size(3), v4.size(3), causal, query_offset, window};
  const HeadGroups groups{heads, heads / k4.size(1)};
  // Nothing reads a ragged step's weights: each task then keeps one slice's in a buffer of
  // its own (a tensor for all slices cost a fresh, page-faulting allocation per step).
  auto weights = rows ? torch::Tensor() : torch::empty({outer, heads, z.n, z.m}, q4.options());
  torch::Tensor keep;
  if (dropout_p > 0.0) {
    // Drawn as torch::dropout draws its mask for (..., n, m) weights, so a seed gives the
    // math path's mask.
    keep = torch::empty_like(weights).bernoulli_(1.0 - dropout_p).div_(1.0 - dropout_p);
  }
  AT_DISPATCH_FLOATING_TYPES(q4.scalar_type(), "loop_nest_forward", [&] {
    const Slices<const scalar_t> qs(q4), ks(k4), vs(v4);
    const Slices<scalar_t> os(out4);
    scalar_t* w = weights.defined() ? weights.data_ptr<scalar_t>() : nullptr;
    const scalar_t* kp = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
    const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(z.d)));
    at::parallel_for(0, outer * heads, kSlicesPerTask, [&](int64_t begin, int64_t end) {
      Scratch<scalar_t> scratch(z, z.d, /*backward=*/false, kp != nullptr);
      std::vector<scalar_t> slice_weights(w ? 0 : z.n * z.m);
      for (int64_t s = begin; s < end; ++s) {
        const int64_t kv = groups.kv_slice(s);
        SliceSizes sizes = z;
        if (rows) {
          const int64_t b = s / heads;
          sizes.query_offset = rows->query_offsets[b];
          sizes.key_limit = rows->key_ends[b];
          sizes.n = std::clamp<int64_t>(sizes.key_limit - sizes.query_offset, 0, z.n);
          for (int64_t i = sizes.n; i < z.n; ++i)
            std::fill(os[s][i], os[s][i] + z.dv, scalar_t(0));
        }
        forward_slice(qs[s], ks[kv], vs[kv], os[s], w ? w + s * z.n * z.m : slice_weights.data(),
                      kp ? kp + s * z.n * z.m : nullptr, sizes, scale, scratch);
      }
    });
  });
  return {weights, keep};
}

void run_backward(const torch::Tensor& q4, const torch::Tensor& k4, const torch::Tensor& v4,
                  const torch::Tensor& grad_out4, const torch::Tensor& weights,
                  const torch::Tensor& keep, bool causal, int64_t query_offset, int64_t window,
                  torch::Tensor& grad_q4, torch::Tensor& grad_k4, torch::Tensor& grad_v4) {
  const int64_t outer = q4.size(0), heads = q4.size(1);
  const SliceSizes z{q4.size(2), k4.size(2), q4.size(3), v4.size(3), causal, query_offset, window};
  const HeadGroups groups{heads, heads / k4.size(1)};
  AT_DISPATCH_FLOATING_TYPES(q4.scalar_type(), "loop_nest_backward", [&] {
    const Slices<const scalar_t> qs(q4), ks(k4), vs(v4), gos(grad_out4);
    const Slices<scalar_t> gqs(grad_q4), gks(grad_k4), gvs(grad_v4);
    const scalar_t* w = weights.data_ptr<scalar_t>();
    const scalar_t* kp = keep.defined() ? keep.data_ptr<scalar_t>() : nullptr;
    const auto scale = static_cast<scalar_t>(1.0 / std::sqrt(static_cast<double>(z.d)));
    at::parallel_for(0, outer * heads, kSlicesPerTask, [&](int64_t begin, int64_t end) {
      Scratch<scalar_t> scratch(z, z.dv, /*backward=*/true, kp != nullptr);
      for (int64_t s = begin; s < end; ++s) {
        const int64_t kv = groups.kv_slice(s);
        backward_slice(qs[s], ks[kv], vs[kv], gos[s], w + s * z.n * z.m,
                       kp ? kp + s * z.n * z.m : nullptr, gqs[s], gks[s], gvs[s], z, scale,
                       scratch);
      }
    });
  });
}

torch::Tensor sum_over_groups(const torch::Tensor& grad4, int64_t kv_heads) {
  const int64_t heads = grad4.size(1);
  if (heads == kv_heads)
    return grad4;
  // (outer, heads, m, f) -> (outer, kv_heads, heads / kv_heads, m, f)
  return grad4.unflatten(1, {kv_heads, heads / kv_heads}).sum(2);
}

}  // namespace attnkit::detail::loop_nest
