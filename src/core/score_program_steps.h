#pragma once

// What compiling a ScoreGraph (score_program.cpp) and running its steps over a row
// (score_program_rows.cpp) share: the operations, their operands, and one step.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/score_program.h"

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
