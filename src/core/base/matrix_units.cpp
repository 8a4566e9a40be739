// 16-bit matrix products on the CPU's matrix units (matrix_units.h).

#include "core/base/matrix_units.h"

#include "core/base/parallel.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include <torch/version.h>
#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define ATTNKIT_X86_CONVERSIONS 1
#endif

// LibTorch's oneDNN micro-kernel with 16-bit operands and float32 accumulation, from 2.6 on
// (1.13 has none). The one LibTorch version split outside sdpa_kernel.cpp.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#include <ATen/native/CPUBlas.h>
#define ATTNKIT_HAVE_BRGEMM 1
#endif

namespace attnkit::detail {

namespace {

// The CPU's 16-bit instructions, from CPUID leaf 7.
struct SixteenBitInstructions {
  bool avx512_bf16 = false, avx512_fp16 = false, amx_bf16 = false, amx_fp16 = false;
};

SixteenBitInstructions cpu_instructions() {
  SixteenBitInstructions found;
#ifdef ATTNKIT_X86_CONVERSIONS
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    const bool amx_tile = (edx >> 24) & 1;
    found.amx_bf16 = amx_tile && ((edx >> 22) & 1);
    found.avx512_fp16 = (edx >> 23) & 1;
    const unsigned leaves = eax;
    if (leaves >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
      found.avx512_bf16 = (eax >> 5) & 1;
      found.amx_fp16 = amx_tile && ((eax >> 21) & 1);
    }
  }
#endif
  return found;
}

const SixteenBitInstructions& instructions() {
  static const SixteenBitInstructions found = cpu_instructions();
  return found;
}

#ifdef ATTNKIT_HAVE_BRGEMM
// Whether brgemm multiplies `dtype` here: one small product, checked against its answer (it
// refuses where oneDNN's ukernel is off or mkldnn is disabled).
bool brgemm_answers(torch::ScalarType dtype) {
  try {
    const auto a = torch::arange(1, 5, torch::kFloat).view({2, 2}).to(dtype);
    const auto b = torch::arange(1, 33, torch::kFloat).view({2, 16}).to(dtype);
    auto packed = torch::zeros({32}, dtype);
    auto c = torch::zeros({2, 16});
    const auto expected = a.to(torch::kFloat).mm(b.to(torch::kFloat));
    if (dtype == torch::kBFloat16) {
      pack_pairs(b.data_ptr<c10::BFloat16>(), 16, 1, 2, 16, 16, packed.data_ptr<c10::BFloat16>());
      matmul_16bit(2, 16, 2, a.data_ptr<c10::BFloat16>(), 2, packed.data_ptr<c10::BFloat16>(), 16,
                   c.data_ptr<float>(), 16, false);
    } else {
      pack_pairs(b.data_ptr<c10::Half>(), 16, 1, 2, 16, 16, packed.data_ptr<c10::Half>());
      matmul_16bit(2, 16, 2, a.data_ptr<c10::Half>(), 2, packed.data_ptr<c10::Half>(), 16,
                   c.data_ptr<float>(), 16, false);
    }
    release_matrix_units();
    return torch::equal(c, expected);
  } catch (const c10::Error&) {
    return false;
  }
}
#endif

}  // namespace

std::string cpu_16bit_matmul_units(torch::ScalarType dtype) {
  const auto& has = instructions();
  if (dtype == torch::kBFloat16)
    return has.amx_bf16 ? "AMX-BF16" : has.avx512_bf16 ? "AVX-512 BF16" : "";
  if (dtype == torch::kHalf)
    return has.amx_fp16 ? "AMX-FP16" : has.avx512_fp16 ? "AVX-512 FP16" : "";
  return "";
}

std::string cpu_16bit_forced_float32() {
  const char* setting = std::getenv("ATTNKIT_CPU_16BIT_MATMUL");
  if (setting != nullptr && std::strcmp(setting, "float32") == 0)
    return "ATTNKIT_CPU_16BIT_MATMUL=float32 asks for float32";
  return "";
}

std::string cpu_16bit_matmul_lacks(torch::ScalarType dtype) {
  if (auto forced = cpu_16bit_forced_float32(); !forced.empty())
    return forced;
#ifndef ATTNKIT_HAVE_BRGEMM
  (void)dtype;
  return "this LibTorch has no 16-bit brgemm (LibTorch 2.x's at::native::cpublas::brgemm)";
#else
  if (dtype != torch::kBFloat16 && dtype != torch::kHalf)
    return c10::str(dtype, " is not a 16-bit dtype");
  if (cpu_16bit_matmul_units(dtype).empty()) {
    return dtype == torch::kBFloat16 ? "this CPU has neither AMX-BF16 nor AVX-512 BF16"
                                     : "this CPU has neither AMX-FP16 nor AVX-512 FP16";
  }
  static std::once_flag probed;
  static bool answers[2] = {false, false};
  std::call_once(probed, [] {
    answers[0] = brgemm_answers(torch::kBFloat16);
    answers[1] = brgemm_answers(torch::kHalf);
  });
  if (!answers[dtype == torch::kBFloat16 ? 0 : 1])
    return c10::str("LibTorch's brgemm does not multiply ", dtype,
                    " here (oneDNN's ukernel off, or mkldnn disabled)");
  return "";
#endif
}

template <typename In>
void matmul_16bit(int64_t m, int64_t n, int64_t k, const In* a, int64_t ld_a, const In* b,
                  int64_t ld_b, float* c, int64_t ld_c, bool accumulate) {
#ifdef ATTNKIT_HAVE_BRGEMM
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, accumulate, a, b, c, /*is_vnni=*/true);
#else
  (void)m, (void)n, (void)k, (void)a, (void)ld_a, (void)b, (void)ld_b, (void)c, (void)ld_c,
      (void)accumulate;
  TORCH_CHECK(false, "[matmul_16bit] ", cpu_16bit_matmul_lacks(torch::kBFloat16));
#endif
}

void release_matrix_units() {
#ifdef ATTNKIT_HAVE_BRGEMM
  at::native::cpublas::brgemm_release(/*is_vnni=*/true);
#endif
}

namespace {

// C = (or +=) A B through LibTorch's GEMM, on views of the buffers.
void matmul_float32_by_mm(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a,
                          const float* b, int64_t ld_b, float* c, int64_t ld_c, bool accumulate) {
  const auto view = [](const float* data, int64_t rows, int64_t cols, int64_t ld) {
    return torch::from_blob(const_cast<float*>(data), {rows, cols}, {ld, 1}, torch::kFloat);
  };
  auto product = view(c, m, n, ld_c);
  if (accumulate)
    product.addmm_(view(a, m, k, ld_a), view(b, k, n, ld_b));
  else
    at::mm_out(product, view(a, m, k, ld_a), view(b, k, n, ld_b));
}

#ifdef ATTNKIT_HAVE_BRGEMM
// Whether brgemm multiplies float32 here: one small product against its answer.
bool float32_brgemm_answers() {
  try {
    const auto a = torch::arange(1, 7, torch::kFloat).view({2, 3});
    const auto b = torch::arange(1, 49, torch::kFloat).view({3, 16});
    auto c = torch::zeros({2, 16});
    at::native::cpublas::brgemm(2, 16, 3, 3, 16, 16, false, a.data_ptr<float>(),
                                b.data_ptr<float>(), c.data_ptr<float>(), /*is_vnni=*/false);
    at::native::cpublas::brgemm_release(/*is_vnni=*/false);
    return torch::equal(c, a.mm(b));
  } catch (const c10::Error&) {
    return false;
  }
}
#endif

}  // namespace

void matmul_float32(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b,
                    int64_t ld_b, float* c, int64_t ld_c, bool accumulate) {
#ifdef ATTNKIT_HAVE_BRGEMM
  static const bool answers = float32_brgemm_answers();
  if (answers) {
    at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, accumulate, a, b, c,
                                /*is_vnni=*/false);
    return;
  }
#endif
  matmul_float32_by_mm(m, n, k, a, ld_a, b, ld_b, c, ld_c, accumulate);
}

template <typename In>
void pack_pairs(const In* src, int64_t row_stride, int64_t col_stride, int64_t k, int64_t n,
                int64_t ld, In* packed) {
  for (int64_t r = 0; r < k; r += 2) {
    In* pair = packed + r / 2 * ld * 2;
    const In* first = src + r * row_stride;
    const In* second = r + 1 < k ? first + row_stride : nullptr;
    for (int64_t c = 0; c < n; ++c) {
      pair[2 * c] = first[c * col_stride];
      pair[2 * c + 1] = second != nullptr ? second[c * col_stride] : In(0.0f);
    }
  }
}

#ifdef ATTNKIT_X86_CONVERSIONS
namespace {

// 16 floats rounded to 16 bits, to nearest even (AVX-512 BF16's conversion; F16C's for half).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m256i round16(__m512 x,
                                                                              c10::BFloat16*) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}
__attribute__((target("avx512f,avx512bw"))) inline __m256i round16(__m512 x, c10::Half*) {
  return _mm512_maskz_cvtps_ph(0xFFFF, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

template <typename In>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) int64_t round_row_avx512(const float* src,
                                                                                int64_t count,
                                                                                In* dst) {
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        round16(_mm512_loadu_ps(src + j), static_cast<In*>(nullptr)));
  }
  return j;
}

template <typename In>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) int64_t round_row_pair_avx512(
    const float* first, const float* second, int64_t count, In* dst) {
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m256i first16 = round16(_mm512_loadu_ps(first + j), static_cast<In*>(nullptr));
    const __m256i second16 = second != nullptr
                                 ? round16(_mm512_loadu_ps(second + j), static_cast<In*>(nullptr))
                                 : _mm256_setzero_si256();
    // Within each 128-bit lane: low = pairs 0-3 | 8-11, high = pairs 4-7 | 12-15.
    const __m256i low = _mm256_unpacklo_epi16(first16, second16);
    const __m256i high = _mm256_unpackhi_epi16(first16, second16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j),
                        _mm256_permute2x128_si256(low, high, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j + 16),
                        _mm256_permute2x128_si256(low, high, 0x31));
  }
  return j;
}

bool has_avx512_conversions() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
}

}  // namespace
#endif

template <typename In>
void round_row(const float* src, int64_t count, In* dst) {
  int64_t j = 0;
#ifdef ATTNKIT_X86_CONVERSIONS
  if (has_avx512_conversions())
    j = round_row_avx512(src, count, dst);
#endif
  for (; j < count; ++j)
    dst[j] = In(src[j]);
}

template <typename In>
void round_row_pair(const float* first, const float* second, int64_t count, In* dst) {
  int64_t j = 0;
#ifdef ATTNKIT_X86_CONVERSIONS
  if (has_avx512_conversions())
    j = round_row_pair_avx512(first, second, count, dst);
#endif
  for (; j < count; ++j) {
    dst[2 * j] = In(first[j]);
    dst[2 * j + 1] = second != nullptr ? In(second[j]) : In(0.0f);
  }
}

namespace {

template <typename In>
torch::Tensor packed_slices_of(const torch::Tensor& x4, bool transposed) {
  const int64_t outer = x4.size(0), g = x4.size(1), n = x4.size(2), f = x4.size(3);
  const int64_t per_slice = transposed ? (f + 1) / 2 * 2 * n : (n + 1) / 2 * 2 * f;
  auto packed = torch::empty({outer, g, per_slice}, x4.options());
  const In* data = x4.data_ptr<In>();
  In* out = packed.data_ptr<In>();
  run_tasks(outer * g, x4.device(), [&](int64_t slice) {
    const In* src = data + slice / g * x4.stride(0) + slice % g * x4.stride(1);
    const int64_t row_stride = x4.stride(2);
    if (transposed)
      pack_pairs(src, 1, row_stride, f, n, n, out + slice * per_slice);
    else
      pack_pairs(src, row_stride, 1, n, f, f, out + slice * per_slice);
  });
  return packed;
}

}  // namespace

torch::Tensor packed_slices(const torch::Tensor& x4, bool transposed) {
  TORCH_INTERNAL_ASSERT(x4.dim() == 4 && x4.stride(3) == 1, "[packed_slices] unit-stride rows");
  return x4.scalar_type() == torch::kBFloat16 ? packed_slices_of<c10::BFloat16>(x4, transposed)
                                              : packed_slices_of<c10::Half>(x4, transposed);
}

#define ATTNKIT_MATRIX_UNITS_FOR(In)                                                         \
  template void matmul_16bit<In>(int64_t, int64_t, int64_t, const In*, int64_t, const In*,   \
                                 int64_t, float*, int64_t, bool);                            \
  template void pack_pairs<In>(const In*, int64_t, int64_t, int64_t, int64_t, int64_t, In*); \
  template void round_row<In>(const float*, int64_t, In*);                                   \
  template void round_row_pair<In>(const float*, const float*, int64_t, In*);
ATTNKIT_MATRIX_UNITS_FOR(c10::BFloat16)
ATTNKIT_MATRIX_UNITS_FOR(c10::Half)
#undef ATTNKIT_MATRIX_UNITS_FOR

}  // namespace attnkit::detail
