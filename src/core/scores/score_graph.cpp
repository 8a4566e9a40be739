// attnkit::ScoreGraph: parse, print and evaluate a score function's small graph. Each
// operation is one LibTorch call, so autograd differentiates a tile's graph as it would the
// C++ function; constants are wrapped numbers, which take part in type promotion as Python's
// numbers do (an int index times 0.5 is float32, a float32 score plus 1 stays float32).

#include "attnkit/score_graph.h"

#include "core/scores/score_variants.h"

#include <algorithm>
#include <functional>
#include <map>
#include <sstream>

namespace attnkit {

namespace {

using Unary = torch::Tensor (*)(const torch::Tensor&);
using Binary = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&);

const std::map<std::string, Unary>& unary_operations() {
  static const std::map<std::string, Unary> table{
      {"neg", [](const torch::Tensor& x) { return x.neg(); }},
      {"abs", [](const torch::Tensor& x) { return x.abs(); }},
      {"exp", [](const torch::Tensor& x) { return x.exp(); }},
      {"exp2", [](const torch::Tensor& x) { return torch::exp2(x); }},
      {"expm1", [](const torch::Tensor& x) { return x.expm1(); }},
      {"log", [](const torch::Tensor& x) { return x.log(); }},
      {"log2", [](const torch::Tensor& x) { return x.log2(); }},
      {"log1p", [](const torch::Tensor& x) { return x.log1p(); }},
      {"tanh", [](const torch::Tensor& x) { return x.tanh(); }},
      {"sigmoid", [](const torch::Tensor& x) { return x.sigmoid(); }},
      {"relu", [](const torch::Tensor& x) { return x.relu(); }},
      {"erf", [](const torch::Tensor& x) { return x.erf(); }},
      {"sin", [](const torch::Tensor& x) { return x.sin(); }},
      {"cos", [](const torch::Tensor& x) { return x.cos(); }},
      {"tan", [](const torch::Tensor& x) { return x.tan(); }},
      {"sqrt", [](const torch::Tensor& x) { return x.sqrt(); }},
      {"rsqrt", [](const torch::Tensor& x) { return x.rsqrt(); }},
      {"reciprocal", [](const torch::Tensor& x) { return x.reciprocal(); }},
      {"floor", [](const torch::Tensor& x) { return x.floor(); }},
      {"ceil", [](const torch::Tensor& x) { return x.ceil(); }},
      {"round", [](const torch::Tensor& x) { return x.round(); }},
      {"sign", [](const torch::Tensor& x) { return x.sign(); }},
      {"logical_not", [](const torch::Tensor& x) { return x.logical_not(); }},
      {"bitwise_not", [](const torch::Tensor& x) { return x.bitwise_not(); }},
      {"float", [](const torch::Tensor& x) { return x.to(torch::kFloat); }},
  };
  return table;
}

const std::map<std::string, Binary>& binary_operations() {
  static const std::map<std::string, Binary> table{
      {"add", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::add(a, b); }},
      {"sub", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::sub(a, b); }},
      {"mul", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mul(a, b); }},
      {"div", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::div(a, b); }},
      {"floor_divide",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::floor_divide(a, b); }},
      {"remainder",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::remainder(a, b); }},
      {"pow", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::pow(a, b); }},
      {"maximum",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::maximum(a, b); }},
      {"minimum",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::minimum(a, b); }},
      {"atan2", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::atan2(a, b); }},
      {"eq", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::eq(a, b); }},
      {"ne", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::ne(a, b); }},
      {"lt", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::lt(a, b); }},
      {"le", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::le(a, b); }},
      {"gt", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::gt(a, b); }},
      {"ge", [](const torch::Tensor& a, const torch::Tensor& b) { return torch::ge(a, b); }},
      {"logical_and",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::logical_and(a, b); }},
      {"logical_or",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::logical_or(a, b); }},
      {"bitwise_and",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::bitwise_and(a, b); }},
      {"bitwise_or",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::bitwise_or(a, b); }},
      {"bitwise_xor",
       [](const torch::Tensor& a, const torch::Tensor& b) { return torch::bitwise_xor(a, b); }},
  };
  return table;
}

const char* const kParseFn = "[ScoreGraph::parse]";

ScoreGraph::Operand parse_operand(const std::string& token, size_t line, int64_t values) {
  using Kind = ScoreGraph::Operand::Kind;
  ScoreGraph::Operand operand;
  const auto number_after = [&](size_t skip, auto convert) {
    const std::string digits = token.substr(skip);
    size_t used = 0;
    try {
      const auto value = convert(digits, &used);
      TORCH_CHECK(used == digits.size() && !digits.empty(), "");
      return value;
    } catch (...) {
      TORCH_CHECK(false, kParseFn, " line ", line, ": operand '", token, "' is not a number");
    }
  };
  const auto to_int = [](const std::string& s, size_t* used) { return std::stoll(s, used); };
  if (token == "_") {
    operand.kind = Kind::kWhole;
  } else if (token.rfind('%', 0) == 0) {
    operand.kind = Kind::kValue;
    operand.index = number_after(1, to_int);
    TORCH_CHECK(operand.index >= 0 && operand.index < values, kParseFn, " line ", line,
                ": operand '", token, "' names no earlier value (there are ", values, ")");
  } else if (token.rfind('$', 0) == 0) {
    operand.kind = Kind::kTensor;
    operand.index = number_after(1, to_int);
    TORCH_CHECK(operand.index >= 0, kParseFn, " line ", line, ": operand '", token,
                "' must be $0 or more");
  } else if (token.rfind("f:", 0) == 0) {
    operand.kind = Kind::kFloat;
    operand.number =
        number_after(2, [](const std::string& s, size_t* used) { return std::stod(s, used); });
  } else if (token.rfind("i:", 0) == 0) {
    operand.kind = Kind::kInt;
    operand.index = number_after(2, to_int);
  } else if (token == "b:0" || token == "b:1") {
    operand.kind = Kind::kBool;
    operand.index = token == "b:1";
  } else {
    TORCH_CHECK(false, kParseFn, " line ", line, ": operand '", token,
                "' is none of %N, $N, f:<float>, i:<int>, b:0, b:1, _");
  }
  return operand;
}

std::string operand_text(const ScoreGraph::Operand& operand) {
  using Kind = ScoreGraph::Operand::Kind;
  switch (operand.kind) {
    case Kind::kValue:
      return c10::str("%", operand.index);
    case Kind::kTensor:
      return c10::str("$", operand.index);
    case Kind::kFloat: {
      std::ostringstream out;
      out.precision(17);
      out << "f:" << operand.number;
      return out.str();
    }
    case Kind::kInt:
      return c10::str("i:", operand.index);
    case Kind::kBool:
      return c10::str("b:", operand.index);
    case Kind::kWhole:
      return "_";
  }
  return "";
}

// How many operands an operation takes; -1: one or more (index).
int arity(const std::string& op) {
  if (unary_operations().count(op))
    return 1;
  if (binary_operations().count(op))
    return 2;
  if (op == "where" || op == "clamp")
    return 3;
  if (op == "index")
    return -1;
  return 0;
}

}  // namespace

const std::vector<std::string>& ScoreGraph::operations() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (const auto& item : unary_operations())
      all.push_back(item.first);
    for (const auto& item : binary_operations())
      all.push_back(item.first);
    all.insert(all.end(), {"where", "clamp", "index"});
    return all;
  }();
  return names;
}

ScoreGraph ScoreGraph::parse(const std::string& text) {
  ScoreGraph graph;
  std::istringstream lines(text);
  std::string line_text;
  size_t line = 0;
  while (std::getline(lines, line_text)) {
    ++line;
    std::istringstream words(line_text);
    Operation operation;
    if (!(words >> operation.op))
      continue;  // a blank line
    const int expected = arity(operation.op);
    if (expected == 0) {
      std::string known;
      for (const auto& name : operations())
        known += (known.empty() ? "" : ", ") + name;
      TORCH_CHECK(false, kParseFn, " line ", line, ": unknown operation '", operation.op,
                  "'; known: ", known);
    }
    const int64_t values = 5 + static_cast<int64_t>(graph.nodes_.size());
    for (std::string token; words >> token;)
      operation.operands.push_back(parse_operand(token, line, values));
    const auto count = static_cast<int>(operation.operands.size());
    TORCH_CHECK(expected < 0 ? count >= 2 : count == expected, kParseFn, " line ", line, ": ",
                operation.op, " takes ", expected < 0 ? "a tensor and one or more indices" : "",
                expected < 0 ? "" : c10::str(expected, " operand(s)"), ", got ", count);
    for (size_t i = 0; i < operation.operands.size(); ++i) {
      const auto& operand = operation.operands[i];
      TORCH_CHECK(operand.kind != Operand::Kind::kWhole || (operation.op == "index" && i > 0) ||
                      (operation.op == "clamp" && i > 0),
                  kParseFn, " line ", line,
                  ": '_' is an index's whole dimension or clamp's "
                  "missing bound, not an operand of ",
                  operation.op);
      if (operand.kind == Operand::Kind::kTensor)
        graph.num_tensors_ = std::max(graph.num_tensors_, operand.index + 1);
    }
    graph.nodes_.push_back(std::move(operation));
  }
  TORCH_CHECK(!graph.nodes_.empty(), kParseFn, " a score graph needs at least one operation");
  return graph;
}

std::string ScoreGraph::to_string() const {
  std::string text;
  for (const auto& node : nodes_) {
    text += node.op;
    for (const auto& operand : node.operands) {
      // Piece by piece: GCC 12 took `" " + string&&` here for an overflow (-Wstringop-overflow,
      // a false positive in the pip build).
      text += ' ';
      text += operand_text(operand);
    }
    text += '\n';
  }
  return text;
}

torch::Tensor ScoreGraph::evaluate(const torch::Tensor& score, const torch::Tensor& b,
                                   const torch::Tensor& h, const torch::Tensor& q_idx,
                                   const torch::Tensor& kv_idx,
                                   const std::vector<torch::Tensor>& tensors) const {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) >= num_tensors_, "[ScoreGraph] the graph reads ",
              num_tensors_, " captured tensor(s), got ", tensors.size());
  std::vector<torch::Tensor> values{score, b, h, q_idx, kv_idx};
  values.reserve(values.size() + nodes_.size());
  // A constant as a wrapped number, as LibTorch wraps a Python number: it takes part in type
  // promotion as Python's numbers do (an int tensor times 8.0 is float32, not float64).
  const auto constant = [](const c10::Scalar& value) {
    auto t = c10::scalar_to_tensor(value);
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  };
  const auto tensor_of = [&](const Operand& operand) -> torch::Tensor {
    switch (operand.kind) {
      case Operand::Kind::kValue:
        return values[static_cast<size_t>(operand.index)];
      case Operand::Kind::kTensor:
        return tensors[static_cast<size_t>(operand.index)];
      case Operand::Kind::kFloat:
        return constant(operand.number);
      case Operand::Kind::kInt:
        return constant(operand.index);
      case Operand::Kind::kBool:
        return constant(operand.index != 0);
      case Operand::Kind::kWhole:
        break;
    }
    return {};
  };
  for (const auto& node : nodes_) {
    const auto& in = node.operands;
    torch::Tensor result;
    if (auto unary = unary_operations().find(node.op); unary != unary_operations().end()) {
      result = unary->second(tensor_of(in[0]));
    } else if (auto binary = binary_operations().find(node.op);
               binary != binary_operations().end()) {
      result = binary->second(tensor_of(in[0]), tensor_of(in[1]));
    } else if (node.op == "where") {
      result = torch::where(tensor_of(in[0]), tensor_of(in[1]), tensor_of(in[2]));
    } else if (node.op == "clamp") {
      result = tensor_of(in[0]);
      if (in[1].kind != Operand::Kind::kWhole)
        result = torch::maximum(result, tensor_of(in[1]));
      if (in[2].kind != Operand::Kind::kWhole)
        result = torch::minimum(result, tensor_of(in[2]));
    } else {  // index: advanced indexing, a whole dimension as an absent index
      c10::List<c10::optional<torch::Tensor>> indices;
      for (size_t i = 1; i < in.size(); ++i) {
        if (in[i].kind == Operand::Kind::kWhole) {
          indices.push_back(c10::nullopt);
        } else {
          indices.push_back(tensor_of(in[i]).to(values[1].device()));
        }
      }
      result = torch::index(tensor_of(in[0]), indices);
    }
    values.push_back(std::move(result));
  }
  return values.back();
}

std::optional<ScoreGraph> ScoreGraph::additive_bias() const {
  const auto& last = nodes_.back();
  if (last.op != "add")
    return std::nullopt;
  // Which values read the score, directly or through another value.
  std::vector<bool> reads_score{true, false, false, false, false};
  for (const auto& node : nodes_) {
    bool reads = false;
    for (const auto& operand : node.operands)
      reads = reads || (operand.kind == Operand::Kind::kValue && reads_score[operand.index]);
    reads_score.push_back(reads);
  }
  // add %0 %j or add %j %0, %j an operation's value computed without the score.
  const auto& a = last.operands[0];
  const auto& b = last.operands[1];
  const bool score_first = a.kind == Operand::Kind::kValue && a.index == 0;
  const auto& other = score_first ? b : a;
  const auto& score = score_first ? a : b;
  if (score.kind != Operand::Kind::kValue || score.index != 0 ||
      other.kind != Operand::Kind::kValue || other.index < 5 || reads_score[other.index])
    return std::nullopt;
  ScoreGraph bias;
  bias.nodes_.assign(nodes_.begin(), nodes_.begin() + (other.index - 5 + 1));
  bias.num_tensors_ = num_tensors_;
  return bias;
}

namespace {

using Operand = ScoreGraph::Operand;
using Operation = ScoreGraph::Operation;

bool is_value(const Operand& operand, int64_t index) {
  return operand.kind == Operand::Kind::kValue && operand.index == index;
}

// The number an operand holds, if it is a constant.
std::optional<double> number_of(const Operand& operand) {
  if (operand.kind == Operand::Kind::kFloat)
    return operand.number;
  if (operand.kind == Operand::Kind::kInt)
    return static_cast<double>(operand.index);
  return std::nullopt;
}

// The operation that defines an operand's value (an operation's result, not an argument).
const Operation* definition(const std::vector<Operation>& nodes, const Operand& operand) {
  if (operand.kind != Operand::Kind::kValue || operand.index < 5)
    return nullptr;
  return &nodes[operand.index - 5];
}

// `op a b` with {a, b} matched by `first` and `second` in either order.
template <typename First, typename Second>
bool either_order(const Operation& node, const std::string& op, First&& first, Second&& second) {
  return node.op == op && node.operands.size() == 2 &&
         ((first(node.operands[0]) && second(node.operands[1])) ||
          (first(node.operands[1]) && second(node.operands[0])));
}

// kv_idx - q_idx
bool is_distance(const std::vector<Operation>& nodes, const Operand& operand) {
  const auto* node = definition(nodes, operand);
  return node != nullptr && node->op == "sub" && node->operands.size() == 2 &&
         is_value(node->operands[0], 4) && is_value(node->operands[1], 3);
}

// $t[h] for a 1-D captured tensor: the tensor's number.
std::optional<int64_t> per_head_tensor(const std::vector<Operation>& nodes,
                                       const Operand& operand) {
  const auto* node = definition(nodes, operand);
  if (node == nullptr || node->op != "index" || node->operands.size() != 2 ||
      node->operands[0].kind != Operand::Kind::kTensor || !is_value(node->operands[1], 2))
    return std::nullopt;
  return node->operands[0].index;
}

// cap * tanh(score / cap), as a graph of div, tanh and mul: the cap.
std::optional<double> softcap_of(const std::vector<Operation>& nodes) {
  if (nodes.size() != 3)
    return std::nullopt;
  const auto& divide = nodes[0];
  const auto& tanh = nodes[1];
  const auto cap =
      divide.op == "div" && divide.operands.size() == 2 && is_value(divide.operands[0], 0)
          ? number_of(divide.operands[1])
          : std::nullopt;
  if (!cap || *cap <= 0.0 || tanh.op != "tanh" || !is_value(tanh.operands[0], 5))
    return std::nullopt;
  const bool multiplies = either_order(
      nodes[2], "mul", [](const Operand& o) { return is_value(o, 6); },
      [&](const Operand& o) { return number_of(o) == cap; });
  return multiplies ? cap : std::nullopt;
}

// The bias graph (ScoreGraph::additive_bias) as a form a kernel evaluates itself: ALiBi's
// `$t[h] * (kv_idx - q_idx)`, or a table's `$t[h, clamp(kv_idx - q_idx, -D, D) + D]` for a
// (heads, 2 D + 1) tensor; monostate for any other bias.
detail::BiasForm bias_form(const std::vector<Operation>& nodes,
                           const std::vector<torch::Tensor>& tensors) {
  const auto& last = nodes.back();
  std::optional<int64_t> slopes;
  if (either_order(
          last, "mul",
          [&](const Operand& o) { return (slopes = per_head_tensor(nodes, o)).has_value(); },
          [&](const Operand& o) { return is_distance(nodes, o); }) &&
      tensors[*slopes].dim() == 1)
    return detail::AlibiBias{tensors[*slopes]};
  if (last.op != "index" || last.operands.size() != 3 ||
      last.operands[0].kind != Operand::Kind::kTensor || !is_value(last.operands[1], 2))
    return std::monostate{};
  const auto& table = tensors[last.operands[0].index];
  const auto* shift = definition(nodes, last.operands[2]);
  std::optional<double> offset;
  const Operation* clamp = nullptr;
  if (shift == nullptr ||
      !either_order(
          *shift, "add",
          [&](const Operand& o) {
            clamp = definition(nodes, o);
            return clamp != nullptr && clamp->op == "clamp";
          },
          [&](const Operand& o) { return (offset = number_of(o)).has_value(); }))
    return std::monostate{};
  if (clamp->operands.size() != 3 || !is_distance(nodes, clamp->operands[0]))
    return std::monostate{};
  const auto low = number_of(clamp->operands[1]), high = number_of(clamp->operands[2]);
  const auto d = static_cast<int64_t>(*offset);
  if (!low || !high || *low != -*offset || *high != *offset || *offset < 0 ||
      static_cast<double>(d) != *offset || table.dim() != 2 || table.size(1) != 2 * d + 1)
    return std::monostate{};
  return detail::RelativeBias{table, d};
}

}  // namespace

ScoreMod ScoreGraph::bind(std::vector<torch::Tensor> tensors) const {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == num_tensors_,
              "[ScoreGraph::bind] the graph "
              "reads ",
              num_tensors_, " captured tensor(s), got ", tensors.size());
  // A softcap binds as detail::SoftcapScore, and an additive bias as detail::AdditiveScore
  // (with its form where it is ALiBi's or a relative-position table): values that kernels
  // read (the fused tile kernel evaluates them itself; LibTorch's SDPA takes a bias as a
  // float mask).
  if (const auto cap = softcap_of(nodes_))
    return detail::SoftcapScore{*cap};
  if (auto bias = additive_bias()) {
    auto form = bias_form(bias->nodes_, tensors);
    auto bias_graph = detail::GraphScore{std::make_shared<const ScoreGraph>(std::move(*bias)),
                                         std::move(tensors)};
    if (std::holds_alternative<std::monostate>(form))
      form = bias_graph;
    return detail::AdditiveScore{std::move(bias_graph), std::move(form)};
  }
  return detail::GraphScore{std::make_shared<const ScoreGraph>(*this), std::move(tensors)};
}

}  // namespace attnkit
