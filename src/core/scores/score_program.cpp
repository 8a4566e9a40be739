// ScoreProgram (score_program.h): a ScoreGraph compiled to steps over one row of a tile. The
// steps run in score_program_rows.cpp.

#include "core/scores/score_program.h"

#include <algorithm>
#include <map>

#include "core/base/checks.h"
#include "core/scores/score_program_steps.h"

namespace attnkit::detail {

using namespace score_steps;

namespace {

const std::map<std::string, Code>& codes() {
  static const std::map<std::string, Code> table{
      {"neg", Code::kNeg},
      {"abs", Code::kAbs},
      {"exp", Code::kExp},
      {"exp2", Code::kExp2},
      {"expm1", Code::kExpm1},
      {"log", Code::kLog},
      {"log2", Code::kLog2},
      {"log1p", Code::kLog1p},
      {"tanh", Code::kTanh},
      {"sigmoid", Code::kSigmoid},
      {"relu", Code::kRelu},
      {"erf", Code::kErf},
      {"sin", Code::kSin},
      {"cos", Code::kCos},
      {"tan", Code::kTan},
      {"sqrt", Code::kSqrt},
      {"rsqrt", Code::kRsqrt},
      {"reciprocal", Code::kReciprocal},
      {"floor", Code::kFloor},
      {"ceil", Code::kCeil},
      {"round", Code::kRound},
      {"sign", Code::kSign},
      {"logical_not", Code::kLogicalNot},
      {"bitwise_not", Code::kBitwiseNot},
      {"float", Code::kFloat},
      {"add", Code::kAdd},
      {"sub", Code::kSub},
      {"mul", Code::kMul},
      {"div", Code::kDiv},
      {"floor_divide", Code::kFloorDivide},
      {"remainder", Code::kRemainder},
      {"pow", Code::kPow},
      {"maximum", Code::kMaximum},
      {"minimum", Code::kMinimum},
      {"atan2", Code::kAtan2},
      {"eq", Code::kEq},
      {"ne", Code::kNe},
      {"lt", Code::kLt},
      {"le", Code::kLe},
      {"gt", Code::kGt},
      {"ge", Code::kGe},
      {"logical_and", Code::kLogicalAnd},
      {"logical_or", Code::kLogicalOr},
      {"bitwise_and", Code::kBitwiseAnd},
      {"bitwise_or", Code::kBitwiseOr},
      {"bitwise_xor", Code::kBitwiseXor},
      {"where", Code::kWhere},
      {"clamp", Code::kClamp},
      {"index", Code::kIndex},
  };
  return table;
}

// Results that keep their operands' category (promoted); the rest of the unary and binary
// operations give floating values (exp, div, ...) or bools (comparisons, logical ones).
bool keeps_category(Code code) {
  return in(code, {Code::kNeg,       Code::kAbs,        Code::kFloor,       Code::kCeil,
                   Code::kRound,     Code::kSign,       Code::kBitwiseNot,  Code::kAdd,
                   Code::kSub,       Code::kMul,        Code::kFloorDivide, Code::kRemainder,
                   Code::kPow,       Code::kMaximum,    Code::kMinimum,     Code::kBitwiseAnd,
                   Code::kBitwiseOr, Code::kBitwiseXor, Code::kWhere,       Code::kClamp});
}

bool gives_bool(Code code) {
  return in(code, {Code::kEq, Code::kNe, Code::kLt, Code::kLe, Code::kGt, Code::kGe,
                   Code::kLogicalAnd, Code::kLogicalOr, Code::kLogicalNot});
}

// Operations whose derivative is 0 almost everywhere: autograd's gradient through them is 0.
bool piecewise_constant(Code code) {
  return in(code, {Code::kFloor, Code::kCeil, Code::kRound, Code::kSign, Code::kFloorDivide});
}

}  // namespace

std::shared_ptr<const ScoreProgram> ScoreProgram::compile(const ScoreGraph& graph,
                                                          std::vector<torch::Tensor> tensors,
                                                          bool adds_score, std::string* why) {
  std::shared_ptr<ScoreProgram> program(new ScoreProgram());
  const auto refuse = [&](const std::string& reason) {
    if (why != nullptr)
      *why = reason;
    return std::shared_ptr<const ScoreProgram>();
  };
  std::vector<Category> tensor_category;
  for (const auto& t : tensors) {
    if (t.is_complex())
      return refuse("a captured tensor that is complex");
    tensor_category.push_back(t.scalar_type() == torch::kBool ? Category::kBool
                              : t.is_floating_point()         ? Category::kFloat
                                                              : Category::kInt);
    program->tensor_values_.push_back(t.detach().to(torch::kCPU).contiguous());
    program->wants_grad_.push_back(t.is_floating_point() && t.requires_grad());
  }
  program->tensors_ = std::move(tensors);
  program->adds_score_ = adds_score;
  // Slots 0..4: score, b, h, q_idx, kv_idx.
  std::vector<Category> category{Category::kFloat, Category::kInt, Category::kInt, Category::kInt,
                                 Category::kInt};
  auto& uniform = program->uniform_;
  auto& grad = program->carries_grad_;
  uniform = {false, true, true, true, false};
  grad = {true, false, false, false, false};
  std::vector<int64_t> slot_of_value{0, 1, 2, 3, 4};
  const auto new_slot = [&](Category c, bool is_uniform, bool carries) {
    category.push_back(c);
    uniform.push_back(is_uniform);
    grad.push_back(carries);
    return static_cast<int64_t>(category.size()) - 1;
  };
  for (const auto& node : graph.nodes()) {
    Step step;
    step.code = codes().at(node.op);
    using Kind = ScoreGraph::Operand::Kind;
    bool all_uniform = true, any_grad = false;
    std::vector<Category> operand_categories;
    for (size_t i = 0; i < node.operands.size(); ++i) {
      const auto& operand = node.operands[i];
      if (step.code == Code::kIndex && i == 0) {
        if (operand.kind != Kind::kTensor)
          return refuse("an index of a value, not of a captured tensor");
        step.tensor = operand.index;
        continue;
      }
      Arg arg;
      switch (operand.kind) {
        case Kind::kValue: {
          arg.slot = slot_of_value[static_cast<size_t>(operand.index)];
          operand_categories.push_back(category[arg.slot]);
          all_uniform = all_uniform && uniform[arg.slot];
          any_grad = any_grad || grad[arg.slot];
          break;
        }
        case Kind::kTensor: {
          // A one-element tensor as an operand: its element, read by an index step of no
          // indices (so that its gradient is summed like a table's).
          const auto t = operand.index;
          if (program->tensor_values_[t].numel() != 1)
            return refuse("a captured tensor of more than one element outside an index");
          Step read;
          read.code = Code::kIndex;
          read.tensor = t;
          read.category = tensor_category[t];
          read.out = new_slot(read.category, true, program->wants_grad_[t]);
          program->steps_.push_back(read);
          arg.slot = read.out;
          operand_categories.push_back(read.category);
          any_grad = any_grad || program->wants_grad_[t];
          break;
        }
        case Kind::kFloat:
          arg.kind = Arg::Kind::kConstant;
          arg.number = operand.number;
          operand_categories.push_back(Category::kFloat);
          break;
        case Kind::kInt:
        case Kind::kBool:
          arg.kind = Arg::Kind::kConstant;
          arg.number = static_cast<double>(operand.index);
          operand_categories.push_back(operand.kind == Kind::kInt ? Category::kInt
                                                                  : Category::kBool);
          break;
        case Kind::kWhole:
          if (step.code != Code::kClamp)
            return refuse("an index that takes a whole dimension ('_')");
          arg.kind = Arg::Kind::kAbsent;
          break;
      }
      step.args.push_back(arg);
    }
    // The operands' promoted category (where's condition and an index's indices aside).
    const size_t first = step.code == Code::kWhere ? 1 : 0;
    Category promoted = Category::kBool;
    for (size_t i = first; i < operand_categories.size(); ++i)
      promoted = std::max(promoted, operand_categories[i]);
    step.operand_category = promoted;
    if (step.code == Code::kIndex) {
      const auto& values = program->tensor_values_[step.tensor];
      if (static_cast<int64_t>(step.args.size()) != values.dim() || values.dim() > kMaxOperands)
        return refuse(c10::str("an index of ", step.args.size(), " indices into a tensor of ",
                               values.dim(), " dimensions"));
      for (const auto c : operand_categories) {
        if (c != Category::kInt)
          return refuse("an index that is not an integer");
      }
      step.category = tensor_category[step.tensor];
      step.sizes = values.sizes().vec();
      step.strides = values.strides().vec();
      any_grad = any_grad || program->wants_grad_[step.tensor];
    } else if (gives_bool(step.code)) {
      step.category = Category::kBool;
    } else if (keeps_category(step.code)) {
      step.category = promoted;
    } else {
      step.category = Category::kFloat;
    }
    const bool bitwise_op =
        in(step.code, {Code::kBitwiseAnd, Code::kBitwiseOr, Code::kBitwiseXor, Code::kBitwiseNot});
    if (bitwise_op && promoted == Category::kFloat)
      return refuse(c10::str(node.op, " of floating values"));
    if (!bitwise_op && keeps_category(step.code) && step.code != Code::kWhere &&
        step.code != Code::kClamp && promoted == Category::kBool)
      return refuse(c10::str(node.op, " of bools"));
    const bool carries = any_grad && step.category == Category::kFloat &&
                         !piecewise_constant(step.code) && !gives_bool(step.code);
    step.out = new_slot(step.category, all_uniform, carries);
    slot_of_value.push_back(step.out);
    program->steps_.push_back(std::move(step));
  }
  if (!adds_score && program->steps_.back().category != Category::kFloat)
    return refuse("a result that is not floating");
  if (!adds_score && program->uniform_[program->steps_.back().out])
    return refuse("a result that reads neither the score nor kv_idx");
  return program;
}

bool ScoreProgram::reads_an_entry_per_score(size_t tensor, bool slices_in_one_task) const {
  // Slots 1..4 are b, h, q_idx, kv_idx.
  const std::vector<int64_t> every{1, 2, 3, 4}, head_slots{2, 3, 4};
  int64_t reads = 0;
  bool own_entry = false;
  for (const auto& step : steps_) {
    if (step.code != Code::kIndex || step.tensor != static_cast<int64_t>(tensor))
      continue;
    ++reads;
    std::vector<int64_t> slots;
    for (const auto& arg : step.args)
      slots.push_back(arg.kind == Arg::Kind::kSlot ? arg.slot : -1);
    own_entry = slots == every || (slices_in_one_task && slots == head_slots);
  }
  return reads == 1 && own_entry;
}

}  // namespace attnkit::detail
