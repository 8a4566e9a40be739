#pragma once

// What compiling a ScoreGraph (score_program.cpp) and running its steps over a row
// (score_program_rows.cpp) share: the operations, their operands, and one step.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/scores/score_program.h"

namespace attnkit::detail {

namespace score_steps {

enum class Category { kBool, kInt, kFloat };

enum class Code {
  // unary
  kNeg,
  kAbs,
  kExp,
  kExp2,
  kExpm1,
  kLog,
  kLog2,
  kLog1p,
  kTanh,
  kSigmoid,
  kRelu,
  kErf,
  kSin,
  kCos,
  kTan,
  kSqrt,
  kRsqrt,
  kReciprocal,
  kFloor,
  kCeil,
  kRound,
  kSign,
  kLogicalNot,
  kBitwiseNot,
  kFloat,
  // binary
  kAdd,
  kSub,
  kMul,
  kDiv,
  kFloorDivide,
  kRemainder,
  kPow,
  kMaximum,
  kMinimum,
  kAtan2,
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kLogicalAnd,
  kLogicalOr,
  kBitwiseAnd,
  kBitwiseOr,
  kBitwiseXor,
  // others
  kWhere,
  kClamp,
  kIndex
};

inline bool in(Code code, std::initializer_list<Code> set) {
  return std::find(set.begin(), set.end(), code) != set.end();
}

// An operand: a value (its slot), a constant, or a clamp's absent bound.
struct Arg {
  enum class Kind { kSlot, kConstant, kAbsent };
  Kind kind = Kind::kSlot;
  int64_t slot = 0;
  double number = 0.0;
};

// The most operands a step reads (an index's indices: one per dimension of its tensor).
constexpr int64_t kMaxOperands = 8;

// The arithmetic of steps whose LibTorch semantics take more than one operator.

// Python's floor division (integer operands: exact, by zero refused).
inline double floor_divide(double a, double b, Category category) {
  if (category != Category::kFloat) {
    TORCH_CHECK(b != 0, "[ScoreGraph] integer floor_divide by zero");
    const auto x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
    const int64_t quotient = x / y;
    return static_cast<double>(quotient - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0));
  }
  return std::floor(a / b);
}

// Python's remainder: the sign of the divisor.
inline double remainder(double a, double b, Category category) {
  if (category != Category::kFloat) {
    TORCH_CHECK(b != 0, "[ScoreGraph] integer remainder by zero");
    const auto x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
    const int64_t r = x % y;
    return static_cast<double>(r != 0 && ((r < 0) != (y < 0)) ? r + y : r);
  }
  const double r = std::fmod(a, b);
  return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
}

inline double bitwise(Code code, double a, double b) {
  const auto x = static_cast<int64_t>(a), y = static_cast<int64_t>(b);
  switch (code) {
    case Code::kBitwiseAnd:
      return static_cast<double>(x & y);
    case Code::kBitwiseOr:
      return static_cast<double>(x | y);
    default:
      return static_cast<double>(x ^ y);
  }
}

// LibTorch's split of a tie in maximum(a, b) / minimum(a, b): half the gradient to each.
inline double wins(bool better, bool tie) {
  return better ? 1.0 : tie ? 0.5 : 0.0;
}

constexpr double kLn2 = 0.69314718055994530942;
constexpr double kTwoOverSqrtPi = 1.12837916709551257390;

}  // namespace score_steps

struct ScoreProgram::Step {
  using Code = score_steps::Code;
  using Category = score_steps::Category;
  using Arg = score_steps::Arg;

  Code code;
  std::vector<Arg> args;                // index: the indices, one per dimension of the tensor
  int64_t tensor = -1;                  // index: the captured tensor
  std::vector<int64_t> sizes, strides;  // index: the tensor's (tensor_values_)
  int64_t out = 0;                      // the slot of its value
  Category category = Category::kFloat;
  Category operand_category = Category::kFloat;  // the operands' promoted category
};

}  // namespace attnkit::detail
