#pragma once

/// `attnkit::ScoreGraph`: a score function as data. A small graph of pointwise LibTorch
/// operations over FlexAttention's `(score, b, h, q_idx, kv_idx)` and captured tensors, which
/// the kernels evaluate per tile (autograd differentiates it there). It is what the Python
/// package traces a `score_mod` into (`torch.fx`), and what the operators take as a string
/// (docs/python.md); in C++ it is an inspectable `ScoreMod`.
///
/// Text form, one operation per line, each defining the next value:
///     <op> <operand> <operand> ...
/// Operands: `%0` .. `%4` are score, b, h, q_idx and kv_idx, `%5` onwards the lines' results in
/// order; `$i` the i-th captured tensor; `f:<double>`, `i:<int>` and `b:0`/`b:1` constants;
/// `_` a whole dimension (in `index` only). The last line's value is the result. Operations:
/// the unary and binary ones `ScoreGraph::operations()` lists, `where c a b`, `clamp x lo hi`
/// (`_` for no bound) and `index t i0 i1 ...` (`t[i0, i1, ...]`, advanced indexing).
/// Example: `ScoreGraph::parse("index $0 %2\nadd %0 %5")` is `score + bias[h]`.

#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/score_mod.h"

namespace attnkit {

class ScoreGraph {
 public:
  /// One operand of an operation.
  struct Operand {
    enum class Kind { kValue, kTensor, kFloat, kInt, kBool, kWhole };
    Kind kind = Kind::kValue;
    int64_t index = 0;  // kValue: the value; kTensor: the captured tensor; kInt, kBool: it
    double number = 0;  // kFloat
  };
  struct Operation {
    std::string op;
    std::vector<Operand> operands;
  };

  /// Parses the text form; a c10::Error names the line, the operation or operand, and what
  /// was expected.
  static ScoreGraph parse(const std::string& text);
  /// The text form (parse(to_string()) gives an equal graph).
  std::string to_string() const;

  /// The operations this graph type evaluates (unary, binary, and where, clamp, index).
  static const std::vector<std::string>& operations();

  const std::vector<Operation>& nodes() const { return nodes_; }
  /// How many captured tensors the graph reads: one past its highest `$i`.
  int64_t num_tensors() const { return num_tensors_; }

  /// The graph on broadcastable index tensors and a score, with the captured `tensors`.
  torch::Tensor evaluate(const torch::Tensor& score, const torch::Tensor& b, const torch::Tensor& h,
                         const torch::Tensor& q_idx, const torch::Tensor& kv_idx,
                         const std::vector<torch::Tensor>& tensors) const;

  /// The graph as `score + bias(b, h, q_idx, kv_idx)`, when its last operation adds the score
  /// to a value computed without it: the bias's graph (its value is its last line's); else
  /// nullopt. (An ALiBi or relative-position bias; not a softcap.)
  std::optional<ScoreGraph> additive_bias() const;

  /// A ScoreMod that evaluates this graph with `tensors` (num_tensors() of them, checked).
  /// An additive graph binds as an additive score, which the planner may hand to a kernel
  /// that takes a bias (LibTorch's SDPA, as a float mask).
  ScoreMod bind(std::vector<torch::Tensor> tensors) const;

 private:
  std::vector<Operation> nodes_;
  int64_t num_tensors_ = 0;
};

}  // namespace attnkit
