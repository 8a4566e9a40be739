#pragma once

// 16-bit matrix products on the CPU's matrix units (AMX-BF16/FP16, AVX-512 BF16/FP16) for the
// fused tile kernel: bfloat16 or float16 operands, float32 accumulation, through LibTorch's
// oneDNN micro-kernel (at::native::cpublas::brgemm, LibTorch 2.x). Its B operand is packed in
// pairs of rows ("VNNI"): element (k, n) of a K x N matrix sits at [k / 2][n][k % 2] with a
// leading dimension of `ld` columns, K rounded up to even with zeros.
//
// Where the CPU has no such unit, or this LibTorch has no brgemm, the planner computes 16-bit
// calls in float32 (cpu_16bit_matmul_lacks says why).

#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace attnkit::detail {

/// "ATTNKIT_CPU_16BIT_MATMUL=float32 asks for float32" where the environment sets it, else "":
/// every 16-bit CPU call then runs the float32 path (benchmarks compare the two paths by it).
std::string cpu_16bit_forced_float32();

/// Why bfloat16 or float16 CPU calls of `dtype` cannot multiply in their own dtype here: ""
/// where they can. Reasons: the environment's ATTNKIT_CPU_16BIT_MATMUL=float32, a LibTorch
/// without brgemm (1.13), a CPU without the instructions, a brgemm that refused (mkldnn off).
std::string cpu_16bit_matmul_lacks(torch::ScalarType dtype);

/// The instructions 16-bit `dtype` products run on: "AMX-BF16", "AVX-512 BF16", "AMX-FP16",
/// "AVX-512 FP16", or "" where none.
std::string cpu_16bit_matmul_units(torch::ScalarType dtype);

/// C (m x n, float32, row stride ld_c) = (or += with accumulate) A (m x k, row stride ld_a)
/// times B (k x n packed in pairs of rows, `ld_b` columns). k even. In = c10::BFloat16 or
/// c10::Half. Only where cpu_16bit_matmul_lacks is "".
template <typename In>
void matmul_16bit(int64_t m, int64_t n, int64_t k, const In* a, int64_t ld_a, const In* b,
                  int64_t ld_b, float* c, int64_t ld_c, bool accumulate);

/// Ends a worker's run of matmul_16bit calls (releases AMX's tile configuration).
void release_matrix_units();

/// C (m x n, row stride ld_c) = (or += with accumulate) A (m x k, row stride ld_a) times B
/// (k x n, row stride ld_b), all float32 and row-major: on oneDNN's float32 micro-kernel
/// (brgemm) where this LibTorch has it (2.6 on) and it answers a probe, else LibTorch's GEMM.
/// No tensors and no dispatcher per call; at the fused tile kernel's shapes it ran 111-115
/// GFLOP/s against at::mm's 94-96 on AVX-512 (docs/benchmarks.md).
void matmul_float32(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b,
                    int64_t ld_b, float* c, int64_t ld_c, bool accumulate);

/// Packs B (k x n, element (r, c) at src[r * row_stride + c * col_stride]) in pairs of rows
/// into `packed` ((k + 1) / 2 * ld * 2 entries; columns [n, ld) untouched), k odd: a zero row.
template <typename In>
void pack_pairs(const In* src, int64_t row_stride, int64_t col_stride, int64_t k, int64_t n,
                int64_t ld, In* packed);

/// dst[0, count) = src rounded to In (round to nearest even).
template <typename In>
void round_row(const float* src, int64_t count, In* dst);

/// Two float32 rows rounded to In and interleaved into a row pair of a packed B:
/// dst[2 j] = first[j], dst[2 j + 1] = second[j] (second may be null: zeros).
template <typename In>
void round_row_pair(const float* first, const float* second, int64_t count, In* dst);

/// Each (outer, g) slice of x4 ((outer, g, n, f), 16-bit, unit-stride rows) packed as a B
/// operand, (outer, g, packed): `transposed`, X^T (f x n: pairs of features, ld n; f even);
/// else X (n x f: pairs of rows, n rounded up to even with zeros, ld f). Slices in parallel.
torch::Tensor packed_slices(const torch::Tensor& x4, bool transposed);

}  // namespace attnkit::detail
