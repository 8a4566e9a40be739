#pragma once

// A ScoreGraph compiled for a kernel's rows: the fused tile kernel evaluates a general score
// function (Python's traced score_mod, a C++ ScoreGraph) on one query's row of a tile at a
// time, in double, with no LibTorch call, and differentiates it the same way for backward.
//
// Why: the chunked kernel evaluates a graph as one LibTorch op per node over a whole tile,
// under autograd; here each row's values stay in L1 between the nodes, and the tile's
// probabilities never leave the fused kernel's loop.
//
// A value is uniform (one number for the row: it reads b, h, q_idx, constants and captured
// tensors only) or a row (it reads the score or kv_idx); uniform values are computed once per
// row. Values keep the category LibTorch gives them (bool, integer, floating) so that
// integer division, bitwise operations and indices mean what they mean in LibTorch, and only
// floating values carry gradients, as under autograd.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/score_graph.h"

namespace attnkit::detail {

// Where backward adds a captured tensor's gradient (contiguous, the tensor's shape): float64
// sums, or the float32 gradient itself for a tensor each score reads its own entry of
// (ScoreProgram::reads_an_entry_per_score: each entry then gains one term per batch slice,
// from the one task that reads it). Both null where the gradient is not wanted.
struct GradSink {
  double* sums = nullptr;
  float* entries = nullptr;
  bool wanted() const { return sums != nullptr || entries != nullptr; }
};

class ScoreProgram {
 public:
  /// `graph` over its captured `tensors` (ScoreGraph::bind's), computing the graph's value, or
  /// the score plus it when `adds_score` (the bias graph of an additive score). nullptr, with
  /// `why` set, where rows cannot evaluate the graph: an index that takes a whole dimension or
  /// does not index every dimension, an index that is not an integer, bitwise operations on
  /// floating values, arithmetic on two bools, a tensor of more than one element outside an
  /// index, or a result that is not floating.
  static std::shared_ptr<const ScoreProgram> compile(const ScoreGraph& graph,
                                                     std::vector<torch::Tensor> tensors,
                                                     bool adds_score, std::string* why);

  /// The captured tensors; backward computes the gradients of the floating ones that
  /// required them when the program was compiled.
  const std::vector<torch::Tensor>& tensors() const { return tensors_; }
  bool wants_grad(size_t tensor) const { return wants_grad_[tensor]; }

  /// Whether each score reads its own entry of tensor `tensor`: one index step reads it, at
  /// (b, h, q_idx, kv_idx), or at (h, q_idx, kv_idx) when `slices_in_one_task` (the call's leading
  /// dimensions are one slice, or every slice runs in the task that reads the entry). Its
  /// gradient's entries then each gain one term per call and slice.
  bool reads_an_entry_per_score(size_t tensor, bool slices_in_one_task) const;

  /// Buffers for rows of up to `widest` keys: one per worker. With `float_tanh` (a float32
  /// call) tanh is computed in float32, vectorized, as LibTorch computes a float32 graph;
  /// everything else in float64.
  struct Workspace {
    std::vector<double> values, adjoints;
    std::vector<float> floats;
    std::vector<int64_t> offsets;  // an index's offsets along the row
    std::vector<double> splats;    // backward: two uniform operands repeated along the row
    int64_t widest = 0;
  };
  Workspace workspace(int64_t widest, bool float_tanh) const;

  /// Scores s[0, count) of batch b, head h, query q against keys k0, k0 + 1, ..., modified in
  /// place.
  template <typename T>
  void apply(T* s, int64_t count, int64_t b, int64_t h, int64_t q, int64_t k0,
             Workspace& work) const;

  /// Backward through apply: ds[0, count), the gradient with respect to the modified scores,
  /// becomes the one with respect to the scores `raw` (before apply); tensor_grads[t] (a sink
  /// that wants nothing for a tensor whose gradient is not wanted) gains the row's share. An entry
  /// whose incoming gradient is 0 (masked, or a row that sees no key) stays 0, whatever the graph's
  /// derivative is there.
  template <typename T>
  void backward(T* ds, const T* raw, int64_t count, int64_t b, int64_t h, int64_t q, int64_t k0,
                Workspace& work, const std::vector<GradSink>& tensor_grads) const;

  struct Step;  // one node of the graph, resolved (score_program_steps.h)

 private:
  ScoreProgram() = default;
  void run_forward(int64_t count, int64_t b, int64_t h, int64_t q, int64_t k0,
                   Workspace& work) const;
  void run_backward(int64_t count, Workspace& work,
                    const std::vector<GradSink>& tensor_grads) const;

  std::vector<Step> steps_;
  std::vector<torch::Tensor> tensors_;
  std::vector<torch::Tensor> tensor_values_;  // each tensor contiguous on the CPU, its dtype
  std::vector<bool> wants_grad_;
  std::vector<bool> uniform_;  // per value (5 inputs, then the steps'): one number per row
  std::vector<bool> carries_grad_;
  std::vector<double> constants_;
  bool adds_score_ = false;
};

}  // namespace attnkit::detail
