// ScoreProgram (score_program.h): its compiled steps (score_program.cpp) run over one row of a
// tile, forward and backward.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/base/checks.h"
#include "core/base/row_softmax.h"
#include "core/scores/score_program.h"
#include "core/scores/score_program_steps.h"

// The row loops compiled twice, for AVX2 and for any x86-64, the loader picking one (GCC's
// function multiversioning): AVX2 doubles the lanes of each step's loop. No FMA, so that both
// round alike. What they call must be inlined into them to be compiled for AVX2 as well.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ATTNKIT_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#define ATTNKIT_ALWAYS_INLINE __attribute__((always_inline)) inline
#define ATTNKIT_ALWAYS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define ATTNKIT_AVX2_CLONES
#define ATTNKIT_ALWAYS_INLINE inline
#define ATTNKIT_ALWAYS_INLINE_LAMBDA
#endif

namespace attnkit::detail {

using namespace score_steps;

namespace {

// What a step reads for an operand it does not have (a unary step's second).
const double kNoOperand = 0.0;

// Reads an operand at a row position: a row's entry j, a uniform value or constant (stride 0).
struct Reader {
  const double* data = &kNoOperand;
  int64_t stride = 0;
  double operator()(int64_t j) const { return data[j * stride]; }
};

// out[j] = f(a[j]) and f(a[j], b[j]) for j < n, one loop per pattern of strides, so that
// the compiler vectorizes the loops whose operands are rows.
template <typename F>
ATTNKIT_ALWAYS_INLINE void map1(double* __restrict out, int64_t n, const Reader& a, F f) {
  if (a.stride == 0) {
    std::fill_n(out, n, f(a.data[0]));
    return;
  }
  const double* __restrict x = a.data;
  for (int64_t j = 0; j < n; ++j)
    out[j] = f(x[j]);
}

template <typename F>
ATTNKIT_ALWAYS_INLINE void map2(double* __restrict out, int64_t n, const Reader& a, const Reader& b,
                                F f) {
  const double* __restrict x = a.data;
  const double* __restrict y = b.data;
  if (a.stride != 0 && b.stride != 0) {
    for (int64_t j = 0; j < n; ++j)
      out[j] = f(x[j], y[j]);
  } else if (a.stride != 0) {
    const double y0 = y[0];
    for (int64_t j = 0; j < n; ++j)
      out[j] = f(x[j], y0);
  } else if (b.stride != 0) {
    const double x0 = x[0];
    for (int64_t j = 0; j < n; ++j)
      out[j] = f(x0, y[j]);
  } else {
    std::fill_n(out, n, f(x[0], y[0]));
  }
}

// x, or +0 where `keep` is false, with no branch.
ATTNKIT_ALWAYS_INLINE double zero_unless(bool keep, double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= uint64_t{0} - static_cast<uint64_t>(keep);
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// A reader's values along n entries: its row, or a uniform value repeated into `scratch`.
ATTNKIT_ALWAYS_INLINE const double* as_row(const Reader& r, int64_t n, double* scratch) {
  if (r.stride != 0 || n == 1)
    return r.data;
  std::fill_n(scratch, n, r.data[0]);
  return scratch;
}

// A step's operands as readers: a fixed array, since a row's steps allocate nothing.
struct Readers {
  std::array<Reader, kMaxOperands> at;
  size_t size = 0;
  const Reader& operator[](size_t k) const { return at[k]; }
};

}  // namespace

namespace {

// An index step's flat offsets into its (contiguous) tensor: `base` from the indices that
// are uniform, plus row[j] from those that vary along the row (`row` is the workspace's
// buffer), or plus j * step where the only index that varies is kv_idx itself (a bias
// tensor's last dimension: a strided, often contiguous, read). LibTorch's rules: a negative
// index counts from the end; one out of range is an error. Each row index is checked by its
// extremes, then converted in one pass.
struct Offsets {
  int64_t base = 0;
  const int64_t* row = nullptr;
  int64_t step = 0;
  int64_t operator()(int64_t j) const { return base + (row != nullptr ? row[j] : j * step); }
};

// Slot 4 holds kv_idx: k0, k0 + 1, ... along the row.
constexpr int64_t kKeySlot = 4;

Offsets index_offsets(const ScoreProgram::Step& step, const Readers& in, int64_t n,
                      int64_t* row_buffer) {
  Offsets offsets;
  int64_t varying = 0;
  for (size_t d = 0; d < in.size; ++d)
    varying += in[d].stride != 0 ? 1 : 0;
  const auto refuse = [&](double value, size_t d) {
    TORCH_CHECK(false, "[ScoreGraph] index ", static_cast<int64_t>(value),
                " is out of bounds for dimension ", d, " with size ", step.sizes[d],
                " of captured tensor $", step.tensor);
  };
  for (size_t d = 0; d < in.size; ++d) {
    const int64_t size = step.sizes[d], stride = step.strides[d];
    const double* x = in[d].data;
    const int64_t count = in[d].stride != 0 ? n : 1;
    const bool keys = step.args[d].kind == Arg::Kind::kSlot && step.args[d].slot == kKeySlot;
    double low = x[0], high = x[0];
    if (keys) {  // ascending
      high = x[count - 1];
    } else {
      for (int64_t j = 1; j < count; ++j) {
        low = std::min(low, x[j]);
        high = std::max(high, x[j]);
      }
    }
    if (low < static_cast<double>(-size) || high >= static_cast<double>(size)) {
      for (int64_t j = 0; j < count; ++j) {  // the first that is out of range, as LibTorch
        if (x[j] < static_cast<double>(-size) || x[j] >= static_cast<double>(size))
          refuse(x[j], d);
      }
    }
    const bool wraps = low < 0;
    const auto offset = [&](double value) {
      const auto i = static_cast<int64_t>(value);
      return (wraps && i < 0 ? i + size : i) * stride;
    };
    if (in[d].stride == 0) {
      offsets.base += offset(x[0]);
      continue;
    }
    if (keys && varying == 1 && !wraps) {
      offsets.base += offset(x[0]);
      offsets.step = stride;
      continue;
    }
    if (offsets.row == nullptr) {
      std::fill_n(row_buffer, n, int64_t{0});
      offsets.row = row_buffer;
    }
    for (int64_t j = 0; j < n; ++j)
      row_buffer[j] += offset(x[j]);
  }
  return offsets;
}

// A captured tensor's element as a number: 16-bit floats through float.
template <typename T>
using float_or_double =
    std::conditional_t<std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, T>;

}  // namespace

namespace {

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
__attribute__((target("avx2,fma"))) void tanh_row_avx2(float* x, int64_t count) {
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes)
    _mm256_storeu_ps(x + j, tanh_avx2(_mm256_loadu_ps(x + j)));
  for (; j < count; ++j)
    x[j] = std::tanh(x[j]);
}
#endif

// tanh of a row in float32 with AVX2, for a workspace that asks for it (a float32 call, whose
// graph LibTorch evaluates in float32 too): false where it does not, or the CPU lacks AVX2.
bool tanh_in_float(double* out, int64_t n, const Reader& a, ScoreProgram::Workspace& work) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if (work.floats.empty() || a.stride == 0 || !has_avx2_fma())
    return false;
  float* x = work.floats.data();
  for (int64_t j = 0; j < n; ++j)
    x[j] = static_cast<float>(a.data[j]);
  tanh_row_avx2(x, n);
  for (int64_t j = 0; j < n; ++j)
    out[j] = x[j];
  return true;
#else
  return false;
#endif
}

}  // namespace

ScoreProgram::Workspace ScoreProgram::workspace(int64_t widest, bool float_tanh) const {
  Workspace work;
  work.widest = widest;
  if (float_tanh)
    work.floats.resize(static_cast<size_t>(widest));
  work.values.resize(uniform_.size() * static_cast<size_t>(widest));
  work.adjoints.resize(uniform_.size() * static_cast<size_t>(widest));
  work.offsets.resize(static_cast<size_t>(widest));
  work.splats.resize(2 * static_cast<size_t>(widest));
  return work;
}

ATTNKIT_AVX2_CLONES void ScoreProgram::run_forward(int64_t count, int64_t b, int64_t h, int64_t q,
                                                   int64_t k0, Workspace& work) const {
  const int64_t widest = work.widest;
  double* values = work.values.data();
  const auto slot = [&](int64_t s) { return values + s * widest; };
  slot(1)[0] = static_cast<double>(b);
  slot(2)[0] = static_cast<double>(h);
  slot(3)[0] = static_cast<double>(q);
  // k0 + j through int32 lanes, which convert to double vectorized (a row is far below 2^31)
  const double first_key = static_cast<double>(k0);
  double* keys = slot(kKeySlot);
  for (int64_t j = 0; j < count; ++j)
    keys[j] = first_key + static_cast<double>(static_cast<int32_t>(j));
  for (const auto& step : steps_) {
    const int64_t n = uniform_[step.out] ? 1 : count;
    double* out = slot(step.out);
    Readers in;
    for (const auto& arg : step.args) {
      in.at[in.size++] = arg.kind == Arg::Kind::kSlot
                             ? Reader{slot(arg.slot), uniform_[arg.slot] ? 0 : 1}
                             : Reader{&arg.number, 0};
    }
    const auto fill = [&](auto f) ATTNKIT_ALWAYS_INLINE_LAMBDA {
      for (int64_t j = 0; j < n; ++j)
        out[j] = f(j);
    };
    const Category c = step.operand_category;
    switch (step.code) {
      // clang-format off
      case Code::kNeg: map1(out, n, in[0], [&](double x) { return -x; }); break;
      case Code::kAbs: map1(out, n, in[0], [&](double x) { return std::abs(x); }); break;
      case Code::kExp: map1(out, n, in[0], [&](double x) { return std::exp(x); }); break;
      case Code::kExp2: map1(out, n, in[0], [&](double x) { return std::exp2(x); }); break;
      case Code::kExpm1: map1(out, n, in[0], [&](double x) { return std::expm1(x); }); break;
      case Code::kLog: map1(out, n, in[0], [&](double x) { return std::log(x); }); break;
      case Code::kLog2: map1(out, n, in[0], [&](double x) { return std::log2(x); }); break;
      case Code::kLog1p: map1(out, n, in[0], [&](double x) { return std::log1p(x); }); break;
      case Code::kTanh:
        if (!tanh_in_float(out, n, in[0], work))
          map1(out, n, in[0], [&](double x) { return std::tanh(x); });
        break;
      case Code::kSigmoid: map1(out, n, in[0], [&](double x) { return 1 / (1 + std::exp(-x)); }); break;
      case Code::kRelu: map1(out, n, in[0], [&](double x) { return std::max(x, 0.0); }); break;
      case Code::kErf: map1(out, n, in[0], [&](double x) { return std::erf(x); }); break;
      case Code::kSin: map1(out, n, in[0], [&](double x) { return std::sin(x); }); break;
      case Code::kCos: map1(out, n, in[0], [&](double x) { return std::cos(x); }); break;
      case Code::kTan: map1(out, n, in[0], [&](double x) { return std::tan(x); }); break;
      case Code::kSqrt: map1(out, n, in[0], [&](double x) { return std::sqrt(x); }); break;
      case Code::kRsqrt: map1(out, n, in[0], [&](double x) { return 1 / std::sqrt(x); }); break;
      case Code::kReciprocal: map1(out, n, in[0], [&](double x) { return 1 / x; }); break;
      case Code::kFloor: map1(out, n, in[0], [&](double x) { return std::floor(x); }); break;
      case Code::kCeil: map1(out, n, in[0], [&](double x) { return std::ceil(x); }); break;
      case Code::kRound: map1(out, n, in[0], [&](double x) { return std::nearbyint(x); }); break;
      case Code::kSign:
        map1(out, n, in[0], [&](double x) { return double((x > 0) - (x < 0)); });
        break;
      case Code::kLogicalNot: map1(out, n, in[0], [&](double x) { return double(x == 0); }); break;
      case Code::kBitwiseNot:
        if (c == Category::kBool)
          map1(out, n, in[0], [&](double x) { return double(x == 0); });
        else
          map1(out, n, in[0], [&](double x) { return double(~static_cast<int64_t>(x)); });
        break;
      case Code::kFloat: map1(out, n, in[0], [&](double x) { return x; }); break;
      case Code::kAdd: map2(out, n, in[0], in[1], [&](double x, double y) { return x + y; }); break;
      case Code::kSub: map2(out, n, in[0], in[1], [&](double x, double y) { return x - y; }); break;
      case Code::kMul: map2(out, n, in[0], in[1], [&](double x, double y) { return x * y; }); break;
      case Code::kDiv:
        if (in[1].stride == 0) {  // by a uniform value: one division, then products
          const double inverse = 1 / in[1].data[0];
          map1(out, n, in[0], [&](double x) { return x * inverse; });
        } else {
          map2(out, n, in[0], in[1], [&](double x, double y) { return x / y; });
        }
        break;
      case Code::kFloorDivide:
        map2(out, n, in[0], in[1], [&](double x, double y) { return floor_divide(x, y, c); });
        break;
      case Code::kRemainder:
        map2(out, n, in[0], in[1], [&](double x, double y) { return remainder(x, y, c); });
        break;
      case Code::kPow: map2(out, n, in[0], in[1], [&](double x, double y) { return std::pow(x, y); }); break;
      case Code::kMaximum: map2(out, n, in[0], in[1], [&](double x, double y) { return std::max(x, y); }); break;
      case Code::kMinimum: map2(out, n, in[0], in[1], [&](double x, double y) { return std::min(x, y); }); break;
      case Code::kAtan2: map2(out, n, in[0], in[1], [&](double x, double y) { return std::atan2(x, y); }); break;
      case Code::kEq: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x == y); }); break;
      case Code::kNe: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x != y); }); break;
      case Code::kLt: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x < y); }); break;
      case Code::kLe: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x <= y); }); break;
      case Code::kGt: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x > y); }); break;
      case Code::kGe: map2(out, n, in[0], in[1], [&](double x, double y) { return double(x >= y); }); break;
      case Code::kLogicalAnd:
        map2(out, n, in[0], in[1], [&](double x, double y) { return double(x != 0 && y != 0); });
        break;
      case Code::kLogicalOr:
        map2(out, n, in[0], in[1], [&](double x, double y) { return double(x != 0 || y != 0); });
        break;
      case Code::kBitwiseAnd: case Code::kBitwiseOr: case Code::kBitwiseXor:
        map2(out, n, in[0], in[1], [&](double x, double y) { return bitwise(step.code, x, y); });
        break;
      case Code::kWhere:
        fill([&](int64_t j) { return in[0](j) != 0 ? in[1](j) : in[2](j); });
        break;
      // clang-format on
      case Code::kClamp: {
        const auto& low = step.args[1];
        const auto& high = step.args[2];
        fill([&](int64_t j) {
          double x = in[0](j);
          if (low.kind != Arg::Kind::kAbsent)
            x = std::max(x, in[1](j));
          if (high.kind != Arg::Kind::kAbsent)
            x = std::min(x, in[2](j));
          return x;
        });
        break;
      }
      case Code::kIndex: {
        const auto& tensor = tensor_values_[step.tensor];
        const auto offsets = index_offsets(step, in, n, work.offsets.data());
        AT_DISPATCH_ALL_TYPES_AND3(
            at::kBool, at::kHalf, at::kBFloat16, tensor.scalar_type(), "ScoreProgram index", [&] {
              const scalar_t* data = tensor.data_ptr<scalar_t>();
              const auto number = [](scalar_t x) {
                return static_cast<double>(static_cast<float_or_double<scalar_t>>(x));
              };
              if (offsets.row == nullptr && offsets.step == 1) {  // contiguous: vectorized
                const scalar_t* from = data + offsets.base;
                for (int64_t j = 0; j < n; ++j)
                  out[j] = number(from[j]);
              } else {
                for (int64_t j = 0; j < n; ++j)
                  out[j] = number(data[offsets(j)]);
              }
            });
        break;
      }
    }
  }
}

ATTNKIT_AVX2_CLONES void ScoreProgram::run_backward(
    int64_t count, Workspace& work, const std::vector<GradSink>& tensor_grads) const {
  const int64_t widest = work.widest;
  const double* values = work.values.data();
  double* adjoints = work.adjoints.data();
  const auto value = [&](int64_t s) -> Reader {
    return {values + s * widest, uniform_[s] ? 0 : 1};
  };
  for (auto step = steps_.rbegin(); step != steps_.rend(); ++step) {
    if (!carries_grad_[step->out])
      continue;
    const int64_t n = uniform_[step->out] ? 1 : count;
    const Reader grad_out{adjoints + step->out * widest, uniform_[step->out] ? 0 : 1};
    const Reader out_value = value(step->out);
    Readers in;
    for (const auto& arg : step->args)
      in.at[in.size++] = arg.kind == Arg::Kind::kSlot ? value(arg.slot) : Reader{&arg.number, 0};
    if (step->code == Code::kIndex) {
      const auto& sink = tensor_grads[step->tensor];
      if (!sink.wanted())
        continue;
      const auto offsets = index_offsets(*step, in, n, work.offsets.data());
      const auto add = [&](auto* grad) {
        using Entry = std::remove_pointer_t<decltype(grad)>;
        for (int64_t j = 0; j < n; ++j) {
          const double g = grad_out(j);
          if (g != 0)
            grad[offsets(j)] += static_cast<Entry>(g);
        }
      };
      if (sink.entries != nullptr)
        add(sink.entries);
      else
        add(sink.sums);
      continue;
    }
    for (size_t k = 0; k < step->args.size(); ++k) {
      const auto& arg = step->args[k];
      if (arg.kind != Arg::Kind::kSlot || !carries_grad_[arg.slot])
        continue;
      double* grad_in = adjoints + arg.slot * widest;
      const bool sums = uniform_[arg.slot];
      // grad_in += grad_out * d out / d operand k, the derivative partial(a, b, y, j) chosen
      // once per step; an entry whose gradient is 0 adds 0 (not 0 times an infinite slope).
      // Operands as rows (a uniform one repeated into the workspace), so that the loops
      // below read plain arrays and vectorize.
      const double* __restrict a_row = as_row(in[0], n, work.splats.data());
      const double* __restrict b_row =
          in.size > 1 ? as_row(in[1], n, work.splats.data() + widest) : a_row;
      const double* __restrict y_row = out_value.data;
      const double* __restrict g_row = grad_out.data;
      const auto accumulate = [&](auto partial) ATTNKIT_ALWAYS_INLINE_LAMBDA {
        // Computed, then cleared by a bit mask: a conditional product stays a branch per
        // entry, which keeps the loop from vectorizing (GCC does not speculate
        // floating-point operations that may trap, and turns a select back into the branch).
        const auto term = [&](int64_t j) ATTNKIT_ALWAYS_INLINE_LAMBDA {
          return zero_unless(g_row[j] != 0, g_row[j] * partial(a_row[j], b_row[j], y_row[j], j));
        };
        if (sums) {
          double sum = 0;
          for (int64_t j = 0; j < n; ++j)
            sum += term(j);
          grad_in[0] += sum;
        } else {
          double* __restrict into = grad_in;
          for (int64_t j = 0; j < n; ++j)
            into[j] += term(j);
        }
      };
      const bool first = k == 0;
      using D = double;
      switch (step->code) {
        // clang-format off
        case Code::kNeg: accumulate([](D, D, D, int64_t) { return -1.0; }); break;
        case Code::kAbs: accumulate([](D a, D, D, int64_t) { return D((a > 0) - (a < 0)); }); break;
        case Code::kExp: accumulate([](D, D, D y, int64_t) { return y; }); break;
        case Code::kExp2: accumulate([](D, D, D y, int64_t) { return y * kLn2; }); break;
        case Code::kExpm1: accumulate([](D, D, D y, int64_t) { return y + 1; }); break;
        case Code::kLog: accumulate([](D a, D, D, int64_t) { return 1 / a; }); break;
        case Code::kLog2: accumulate([](D a, D, D, int64_t) { return 1 / (a * kLn2); }); break;
        case Code::kLog1p: accumulate([](D a, D, D, int64_t) { return 1 / (1 + a); }); break;
        case Code::kTanh: accumulate([](D, D, D y, int64_t) { return 1 - y * y; }); break;
        case Code::kSigmoid: accumulate([](D, D, D y, int64_t) { return y * (1 - y); }); break;
        case Code::kRelu: accumulate([](D, D, D y, int64_t) { return y > 0 ? 1.0 : 0.0; }); break;
        case Code::kErf:
          accumulate([](D a, D, D, int64_t) { return kTwoOverSqrtPi * std::exp(-a * a); });
          break;
        case Code::kSin: accumulate([](D a, D, D, int64_t) { return std::cos(a); }); break;
        case Code::kCos: accumulate([](D a, D, D, int64_t) { return -std::sin(a); }); break;
        case Code::kTan: accumulate([](D, D, D y, int64_t) { return 1 + y * y; }); break;
        case Code::kSqrt: accumulate([](D, D, D y, int64_t) { return 1 / (2 * y); }); break;
        case Code::kRsqrt: accumulate([](D, D, D y, int64_t) { return -0.5 * y * y * y; }); break;
        case Code::kReciprocal: accumulate([](D, D, D y, int64_t) { return -y * y; }); break;
        case Code::kFloat: case Code::kAdd: accumulate([](D, D, D, int64_t) { return 1.0; }); break;
        case Code::kSub: accumulate([&](D, D, D, int64_t) { return first ? 1.0 : -1.0; }); break;
        case Code::kMul: accumulate([&](D a, D b, D, int64_t) { return first ? b : a; }); break;
        case Code::kDiv:
          accumulate([&](D a, D b, D, int64_t) { return first ? 1 / b : -a / (b * b); });
          break;
        case Code::kRemainder:
          accumulate([&](D a, D b, D, int64_t) { return first ? 1 : -std::floor(a / b); });
          break;
        // clang-format on
        case Code::kPow:  // LibTorch's: 0 where the exponent is 0, or the base is 0 (exponent)
          accumulate([&](D a, D b, D y, int64_t) {
            if (first)
              return b == 0 ? 0 : b * std::pow(a, b - 1);
            return a == 0 && b >= 0 ? 0 : y * std::log(a);
          });
          break;
        case Code::kMaximum:
          accumulate([&](D a, D b, D, int64_t) {
            return first ? wins(a > b, a == b) : wins(b > a, a == b);
          });
          break;
        case Code::kMinimum:
          accumulate([&](D a, D b, D, int64_t) {
            return first ? wins(a < b, a == b) : wins(b < a, a == b);
          });
          break;
        case Code::kAtan2:
          accumulate([&](D a, D b, D, int64_t) { return (first ? b : -a) / (a * a + b * b); });
          break;
        case Code::kWhere:
          accumulate([&](D a, D, D, int64_t) { return (k == 1) == (a != 0) ? 1.0 : 0.0; });
          break;
        case Code::kClamp: {
          // maximum(x, low), then minimum(that, high), as ScoreGraph::evaluate computes it.
          const bool has_low = step->args[1].kind != Arg::Kind::kAbsent;
          const bool has_high = step->args[2].kind != Arg::Kind::kAbsent;
          accumulate([&](D a, D, D, int64_t j) {
            const double lo = in[1](j), hi = in[2](j);
            const double m = has_low ? std::max(a, lo) : a;
            if (k == 2)
              return wins(hi < m, m == hi);
            const double through_high = has_high ? wins(m < hi, m == hi) : 1.0;
            if (k == 1)
              return through_high * wins(lo > a, a == lo);
            return has_low ? through_high * wins(a > lo, a == lo) : through_high;
          });
          break;
        }
        default:  // piecewise constant, bool and integer results carry no gradient
          break;
      }
    }
  }
}

template <typename T>
void ScoreProgram::apply(T* s, int64_t count, int64_t b, int64_t h, int64_t q, int64_t k0,
                         Workspace& work) const {
  double* score = work.values.data();
  for (int64_t j = 0; j < count; ++j)
    score[j] = static_cast<double>(s[j]);
  run_forward(count, b, h, q, k0, work);
  const int64_t result = steps_.back().out;
  const double* value = work.values.data() + result * work.widest;
  const int64_t stride = uniform_[result] ? 0 : 1;
  for (int64_t j = 0; j < count; ++j)
    s[j] = static_cast<T>(adds_score_ ? score[j] + value[j * stride] : value[j * stride]);
}

template <typename T>
void ScoreProgram::backward(T* ds, const T* raw, int64_t count, int64_t b, int64_t h, int64_t q,
                            int64_t k0, Workspace& work,
                            const std::vector<GradSink>& tensor_grads) const {
  double* score = work.values.data();
  for (int64_t j = 0; j < count; ++j)
    score[j] = static_cast<double>(raw[j]);
  run_forward(count, b, h, q, k0, work);
  const int64_t widest = work.widest;
  for (size_t s = 0; s < uniform_.size(); ++s) {
    if (carries_grad_[s])
      std::fill_n(work.adjoints.data() + s * widest, uniform_[s] ? 1 : count, 0.0);
  }
  const int64_t result = steps_.back().out;
  double* grad_result = work.adjoints.data() + result * widest;
  double* grad_score = work.adjoints.data();
  if (uniform_[result]) {  // a result that reads no score: its gradient is the row's sum
    double sum = 0;
    for (int64_t j = 0; j < count; ++j)
      sum += static_cast<double>(ds[j]);
    grad_result[0] = sum;
  } else {
    for (int64_t j = 0; j < count; ++j)
      grad_result[j] = static_cast<double>(ds[j]);
  }
  if (adds_score_) {
    for (int64_t j = 0; j < count; ++j)
      grad_score[j] += static_cast<double>(ds[j]);
  }
  if (carries_grad_[result])
    run_backward(count, work, tensor_grads);
  for (int64_t j = 0; j < count; ++j)
    ds[j] = ds[j] == 0 ? T(0) : static_cast<T>(grad_score[j]);
}

template void ScoreProgram::apply<float>(float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                         Workspace&) const;
template void ScoreProgram::apply<double>(double*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          Workspace&) const;
template void ScoreProgram::backward<float>(float*, const float*, int64_t, int64_t, int64_t,
                                            int64_t, int64_t, Workspace&,
                                            const std::vector<GradSink>&) const;
template void ScoreProgram::backward<double>(double*, const double*, int64_t, int64_t, int64_t,
                                             int64_t, int64_t, Workspace&,
                                             const std::vector<GradSink>&) const;

}  // namespace attnkit::detail
