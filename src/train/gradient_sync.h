#pragma once

// Summing the gradients over data-parallel ranks, either in one allreduce of the whole flat
// buffer after backward, or in buckets that start while backward still runs: a bucket (a
// contiguous range of FlatAdamW's flat gradient buffer, filled from the last parameters
// backwards) starts its allreduce as soon as every parameter in it has its gradient, so
// communication overlaps the rest of backward, as PyTorch's DistributedDataParallel does.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "distributed.h"

namespace attnkit::train {

class GradientSync {
 public:
  /// `parameters` in the flat buffer's order (FlatAdamW's); `flat_gradients` their gradients,
  /// back to back. `bucket_bytes` 0: one allreduce after backward; else buckets of at least
  /// that many bytes, started from hooks on the parameters' gradient accumulators.
  GradientSync(const std::vector<torch::Tensor>& parameters, torch::Tensor flat_gradients,
               Collectives& group, int64_t bucket_bytes);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  /// Call before each backward: no bucket has started.
  void before_backward();
  /// Call after backward: starts the buckets not yet started, in order, and waits for all.
  /// Returns the seconds spent here: the communication backward did not hide.
  double after_backward();

  /// The buckets' sizes in elements, in the order they start (the last parameters first).
  std::vector<int64_t> bucket_sizes() const;

  struct State;  // shared with the hooks, which the autograd graph owns

 private:
  std::shared_ptr<State> state_;
};

}  // namespace attnkit::train
