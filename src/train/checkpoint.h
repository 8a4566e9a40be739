#pragma once

// attnkit-train's checkpoints (--save, --resume): a dict of tensors in torch.save's format,
// written and read by attnkit's own state-dict functions, so a checkpoint gets the same checks
// as any state dict (CRC-32 per record, tensors inside their storages, no foreign globals) and
// Python reads it with `torch.load(path)` (weights-only).
//
// Keys: "format" (int64), "settings.<flag>" (uint8 text, one per setting a resuming run must
// share), "data.<flag>" (uint8 text, the data stream's settings, which it may change), "step"
// (int64), "best_loss" (float64), "data_rng" and "cpu_rng" (generator states), "cpu_rng_by_rank"
// (world size x state bytes, data-parallel runs), "model.<state-dict key>", "optimizer.exp_avg",
// "optimizer.exp_avg_sq", "optimizer.step".

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "attnkit/serialize.h"
#include "flat_adamw.h"
#include "model.h"

namespace attnkit::train {

/// 3: a dict of tensors; 2 and before: a TorchScript archive (refused with a clear error).
constexpr int64_t kCheckpointFormat = 3;

/// The settings a checkpoint must share with the run that resumes it: (flag, value).
using CheckpointSettings = std::vector<std::pair<std::string, std::string>>;

struct TrainConfig;

/// The settings of `config` that a checkpoint records and a resuming run must share (defined
/// with the configuration, run_config.cpp).
CheckpointSettings checkpoint_settings(const TrainConfig& config);

/// The settings of `config` that a checkpoint records and a resuming run may change: its data
/// stream's (--data, --pack, --seed). A resume that changes one says so in its banner.
CheckpointSettings data_settings(const TrainConfig& config);

struct TrainingState {
  int64_t step = 0;
  double best_loss = std::numeric_limits<double>::infinity();
  /// The --dtype the steps so far ran in (the weights are float32 whatever it is); a
  /// checkpoint written before --dtype existed was float32.
  std::string dtype = "float32";
  /// data_settings of the run that wrote it (empty in a checkpoint from before they were
  /// recorded); a run saves its own.
  CheckpointSettings data = {};
};

/// The `.best` sibling of a --save path: "run.pt" -> "run.best.pt".
std::string best_checkpoint_path(const std::string& save_path);

/// One run's claim on its --save path, from start to end: an exclusive lock (flock) on
/// "PATH.lock", which holds this process's id. A second run with the same path is refused at
/// start, naming the first's process, instead of overwriting its checkpoints; the lock file
/// is removed when the claim ends, and the kernel releases the lock of a killed run. An empty
/// path claims nothing.
class SaveClaim {
 public:
  explicit SaveClaim(const std::string& path);
  ~SaveClaim();
  SaveClaim(const SaveClaim&) = delete;
  SaveClaim& operator=(const SaveClaim&) = delete;

 private:
  std::string lock_path_;
  int descriptor_ = -1;
};

/// Writes the checkpoint through detail::temporary_path(path), beside the file it replaces (a
/// symlink's target), syncs it to disk and renames it over that file: a crash leaves the old
/// file intact. `cpu_rng_by_rank`: (world size, state bytes), every rank's
/// dropout stream; undefined for one process.
void save_checkpoint(const std::string& path, const CheckpointSettings& settings,
                     AttentionModel& model, const FlatAdamW& optimizer, const TrainingState& state,
                     const at::Generator& data_generator, const torch::Tensor& cpu_rng_by_rank);

/// Restores model, optimizer, data stream and rank `rank`'s dropout stream (where the
/// checkpoint has one for it) from `dict`, read from `path` (named in errors). Every key,
/// dtype and shape is checked; errors start with "--resume: ".
TrainingState restore_checkpoint(const StateDict& dict, const std::string& path,
                                 const CheckpointSettings& settings, AttentionModel& model,
                                 FlatAdamW& optimizer, at::Generator& data_generator, int rank);

/// `restore_checkpoint(read_state_dict(path), ...)`, with the reader's errors as --resume's.
TrainingState load_checkpoint(const std::string& path, const CheckpointSettings& settings,
                              AttentionModel& model, FlatAdamW& optimizer,
                              at::Generator& data_generator, int rank);

}  // namespace attnkit::train
