#pragma once

// A batch's passes through the model: its score (masked next-token cross-entropy), a training
// step's forward and backward cut into shares run on their own workers, and an evaluation.

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "attnkit/context_parallel.h"
#include "model.h"
#include "tasks.h"
#include "trainer.h"

namespace attnkit::train {

// Masked next-token cross-entropy and the number of correct predictions.
struct BatchScore {
  torch::Tensor loss;  // scalar, mean over scored positions
  int64_t correct = 0;
  int64_t scored = 0;
};

// `divide_by` > 0: the loss is the sum over scored positions divided by it (a context-parallel
// rank's part of the whole batch's mean, which its shard may score no position of), else the
// mean.
BatchScore score(AttentionModel& model, const Batch& batch, const torch::Device& device,
                 bool count_correct, int64_t divide_by = 0);

// Part `part` of `parts` of a batch's rows: contiguous parts whose sizes differ by at most one.
Batch part_of(const Batch& batch, int64_t part, int64_t parts);

// Rank `rank`'s tokens of every row of a batch (SequenceShards::shard). The document ids stay
// whole: the model builds the whole sequence's mask from them.
Batch sequence_shard(const Batch& batch, const SequenceShards& shards, int rank);

// A training step's loss and its gradients (written to `gradients`, the optimizer's flat
// buffer) with the batch cut into `shares` parts, each run forward and backward on its own
// worker (batch_passes.cpp says why). The parts' gradients are summed in part order, so a run
// repeats exactly at a given share count.
BatchScore forward_backward_in_shares(AttentionModel& model, const Batch& batch,
                                      const torch::Device& device, bool count_correct,
                                      int64_t shares, torch::Tensor& gradients, double loss_scale);

// The loss, accuracy and bits per byte over `batches`, each cut into `shares` parts as in
// training; the model is back in training mode after.
Evaluation evaluate(AttentionModel& model, const std::vector<Batch>& batches,
                    const torch::Device& device, int64_t shares);

}  // namespace attnkit::train
