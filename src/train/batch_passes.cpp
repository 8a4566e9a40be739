// A batch's passes through the model (batch_passes.h).

#include "batch_passes.h"

#include <algorithm>
#include <cmath>

#include "attnkit/threads.h"

namespace attnkit::train {

// `divide_by` > 0: the loss is the sum over scored positions divided by it (a context-parallel
// rank's part of the whole batch's mean, which its shard may score no position of), else the
// mean.
BatchScore score(AttentionModel& model, const Batch& batch, const torch::Device& device,
                 bool count_correct, int64_t divide_by) {
  // Unscored positions get a target cross_entropy ignores, which is cheaper than gathering
  // the scored rows with a boolean index (a nonzero, a gather and a scatter in backward).
  constexpr int64_t kIgnored = -100;
  const auto document_ids =
      batch.document_ids.defined() ? batch.document_ids.to(device) : torch::Tensor();
  const auto logits = model->forward(batch.inputs.to(device), document_ids);  // (b, n, vocab)
  const auto targets =
      batch.targets.masked_fill(batch.loss_mask.logical_not(), kIgnored).to(device);  // (b, n)
  namespace nnf = torch::nn::functional;
  // The loss in float32 whatever the model's dtype (--dtype): log-softmax over the vocabulary.
  auto options = nnf::CrossEntropyFuncOptions().ignore_index(kIgnored);
  if (divide_by > 0)
    options.reduction(torch::kSum);
  auto loss =
      nnf::cross_entropy(logits.flatten(0, 1).to(torch::kFloat), targets.flatten(), options);
  BatchScore result{divide_by > 0 ? loss / static_cast<double>(divide_by) : loss, 0,
                    batch.loss_mask.sum().item<int64_t>()};
  if (count_correct) {
    // An ignored target (-100) never equals an arg max.
    result.correct = logits.argmax(-1).eq(targets).sum().item<int64_t>();
  }
  return result;
}

namespace {

// Rows [begin, end) of part `part` when `rows` rows are cut into `parts` contiguous parts
// whose sizes differ by at most one.
std::pair<int64_t, int64_t> part_rows(int64_t rows, int64_t part, int64_t parts) {
  return {rows * part / parts, rows * (part + 1) / parts};
}

}  // namespace

// Part `part` of `parts` of a batch's rows (part_rows).
Batch part_of(const Batch& batch, int64_t part, int64_t parts) {
  if (parts == 1)
    return batch;
  const auto [begin, end] = part_rows(batch.inputs.size(0), part, parts);
  const auto& ids = batch.document_ids;
  return {batch.inputs.slice(0, begin, end), batch.targets.slice(0, begin, end),
          batch.loss_mask.slice(0, begin, end), ids.defined() ? ids.slice(0, begin, end) : ids};
}

// Rank `rank`'s tokens of every row of a batch (SequenceShards::shard). The document ids stay
// whole: the model builds the whole sequence's mask from them.
Batch sequence_shard(const Batch& batch, const SequenceShards& shards, int rank) {
  return {shards.shard(batch.inputs, rank, 1), shards.shard(batch.targets, rank, 1),
          shards.shard(batch.loss_mask, rank, 1), batch.document_ids};
}

// A training step's loss and its gradients (written to `gradients`, the optimizer's flat
// buffer) with the batch cut into `shares` parts, each run forward and backward on its own
// worker. Why: at toy sizes a batch's ops are too small to spread over cores (each op's
// OpenMP region costs more than it saves, and the idle workers spin on the cores the BLAS
// wants), while whole forward and backward passes keep every core busy. Inside a worker
// LibTorch's ops run serially and the BLAS on one thread (attnkit::run_tasks). The parts'
// gradients are summed in part order, so a run repeats exactly at a given share count.
BatchScore forward_backward_in_shares(AttentionModel& model, const Batch& batch,
                                      const torch::Device& device, bool count_correct,
                                      int64_t shares, torch::Tensor& gradients, double loss_scale) {
  const auto parameters = model->parameters();  // the optimizer's flat layout, in order
  const auto scored = batch.loss_mask.sum().item<int64_t>();
  std::vector<torch::Tensor> losses(shares), flat_gradients(shares);
  std::vector<int64_t> corrects(shares);
  attnkit::run_tasks(shares, device, [&](int64_t part) {
    torch::AutoGradMode grad_mode(true);  // run_tasks turns it off in its workers
    const auto s = score(model, part_of(batch, part, shares), device, count_correct);
    // This part's share of the mean over the whole batch's scored positions.
    losses[part] = s.loss * (static_cast<double>(s.scored) / std::max<int64_t>(scored, 1));
    const auto grads = torch::autograd::grad({losses[part] * loss_scale}, parameters,
                                             /*grad_outputs=*/{},
                                             /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    std::vector<torch::Tensor> pieces;  // each (numel) of its parameter
    for (size_t k = 0; k < grads.size(); ++k) {
      pieces.push_back(grads[k].defined()
                           ? grads[k].reshape({-1})
                           : torch::zeros({parameters[k].numel()}, parameters[k].options()));
    }
    flat_gradients[part] = torch::cat(pieces);
    corrects[part] = s.correct;
  });
  torch::NoGradGuard no_grad;
  gradients.copy_(flat_gradients[0]);
  auto loss = losses[0].detach();
  int64_t correct = corrects[0];
  for (int64_t part = 1; part < shares; ++part) {
    gradients.add_(flat_gradients[part]);
    loss = loss + losses[part].detach();
    correct += corrects[part];
  }
  return {loss, correct, scored};
}

Evaluation evaluate(AttentionModel& model, const std::vector<Batch>& batches,
                    const torch::Device& device, int64_t shares) {
  torch::NoGradGuard no_grad;
  model->eval();
  double loss_sum = 0.0;
  int64_t correct = 0, scored = 0;
  for (const auto& batch : batches) {
    // Each part on its own worker, as in training (forward_backward_in_shares).
    const int64_t parts = std::min<int64_t>(shares, batch.inputs.size(0));
    std::vector<BatchScore> part_scores(parts);
    attnkit::run_tasks(parts, device, [&](int64_t part) {
      part_scores[part] = score(model, part_of(batch, part, parts), device, true);
    });
    for (const auto& s : part_scores) {
      loss_sum += s.loss.item<double>() * static_cast<double>(s.scored);
      correct += s.correct;
      scored += s.scored;
    }
  }
  model->train();
  Evaluation e;
  e.loss = loss_sum / static_cast<double>(scored);
  e.accuracy = static_cast<double>(correct) / static_cast<double>(scored);
  e.bits_per_byte = e.loss / std::log(2.0);
  return e;
}

}  // namespace attnkit::train
