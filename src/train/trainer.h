#pragma once

// attnkit-train's engine: resolved configuration, the training loop, held-out evaluation,
// checkpoints (atomic, resumable) and the metrics file. The CLI (apps/train.cpp) and the
// tests drive it.

#include <atomic>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "distributed.h"
#include "model.h"
#include "tasks.h"

namespace attnkit::train {

/// Everything a run is made of. Zero means "the task's default" where noted.
/// ModelConfig's defaults with layers 0: the task's default, which resolve() fills in.
inline ModelConfig task_default_model() {
  ModelConfig model;
  model.layers = 0;
  return model;
}

struct TrainConfig {
  // task
  std::string task = "copy";
  std::string data = "data/the-verdict.txt";
  int64_t seq_len = 0;   // 0: default_task_length(task)
  bool pack = false;     // text: rows of packed documents (paragraphs), kept apart by a mask
  int64_t sample = 0;    // text: bytes to generate after training
  bool kv_cache = true;  // generate the sample with KV caches (mha, mha-combined, gqa, mqa, mla)
  std::string prompts;   // text: a file whose lines --sample continues, in one batch
  // model: the attention module and the network around it. model_config_of fills in what the
  // task decides (vocab_size, context_length, causal); model.layers 0 (the default here): 2
  // for recall and text, else 1 (resolve()).
  ModelConfig model = task_default_model();
  // optimisation
  int64_t steps = 0;  // 0: the task's default
  int64_t batch_size = 64;
  double lr = 3e-3;
  double weight_decay = 0.01;
  double clip_norm = 1.0;
  /// GB that attnkit's quadratic allocations and the run's check before step 1 may plan for
  /// (attnkit/memory_budget.h); 0: the default, half of physical memory.
  double memory_budget_gb = 0.0;
  /// float32, or bfloat16 | float16: forward and backward in that dtype on a working copy,
  /// float32 master weights and AdamW state (mixed_precision.h).
  std::string dtype = "float32";
  /// With a 16-bit dtype: no working copy; the float32 model's forward runs under LibTorch's
  /// autocast in that dtype (data-parallel ranks allowed).
  bool autocast = false;
  // run
  uint64_t seed = 1;
  std::string device = "auto";
  int64_t threads = 0;     // 0: the usable cores / this machine's ranks (trainer.cpp)
  int64_t eval_every = 0;  // 0: steps / 10
  std::string save;
  std::string resume;
  std::string metrics;
  std::string dump_attention;
  /// Data-parallel runs: the c10d backend, gloo or nccl; auto (resolve()) picks nccl for a
  /// CUDA device where the build has it, else gloo.
  std::string dist_backend = "auto";
  /// Data-parallel runs: 0 = one allreduce of every gradient after backward; else buckets of
  /// this many MB whose allreduce starts during backward (gradient_sync.h).
  double bucket_mb = 0.0;
  /// Ranks that share each sequence (context parallelism, zigzag shards): the run's ranks
  /// form world_size / context_parallel data-parallel groups of this many. 1: none.
  int64_t context_parallel = 1;
  bool quiet = false;
  /// Redraw a progress bar in place (the CLI sets this when stdout is a terminal);
  /// otherwise print one plain line per evaluation.
  bool progress_bar = false;
};

/// Fills the task defaults, checks every value (one-line c10::Error naming the flag) and
/// resolves --device ("auto" picks CUDA when available).
TrainConfig resolve(TrainConfig config);

/// The device a resolved config runs on; fails for cuda without CUDA.
torch::Device resolve_device(const std::string& device);

/// `| Parameter | Value |` table of a resolved config.
void print_config_table(std::ostream& out, const TrainConfig& config, const Task& task);

/// The model a run trains: config.model with what the task decides (vocab size, context
/// length, causality); a context beyond attnkit-train's longest is refused, naming --seq-len.
ModelConfig model_config_of(const TrainConfig& config, const Task& task);

/// Refuses, before the model is built, a run that could not fit attnkit's memory budget on
/// this process (one of `world_size` ranks): a lower bound on what its first step holds.
void check_run_memory(const TrainConfig& config, const ModelConfig& model, int world_size);

/// Held-out metrics.
struct Evaluation {
  double loss = 0.0;           // mean cross-entropy (nats) over scored positions
  double accuracy = 0.0;       // fraction of scored positions predicted exactly
  double bits_per_byte = 0.0;  // text: loss / ln 2
};

struct TrainResult {
  Evaluation final_evaluation;
  int64_t last_step = 0;
  double train_seconds = 0.0;  // training only, evaluation excluded
  double wall_seconds = 0.0;
  double tokens_per_second = 0.0;
  std::vector<double> losses;  // training loss of every step run here (over every rank)
  bool interrupted = false;
  /// A held-out evaluation has run (here, or before the checkpoint this run resumed): only
  /// then is there a best checkpoint (--save's PATH.best).
  bool evaluated = false;
  int world_size = 1;
  double allreduce_seconds = 0.0;  // of train_seconds: summing the gradients over the ranks
  int64_t skipped_steps = 0;       // --dtype 16-bit: steps skipped for non-finite gradients
};

/// Raised when the loss becomes NaN or infinite; the last good checkpoint stays in place.
struct NonFiniteLoss : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Runs a resolved config. `stop` is polled between steps (SIGINT/SIGTERM): when set,
/// the current step finishes, a checkpoint is saved (with --save) and the result says
/// `interrupted`. Progress goes to `out`.
///
/// With `ranks` of a data-parallel group (see distributed.h), every rank draws the same
/// global batch of --batch-size sequences from the shared data stream and trains on its own
/// contiguous share of it; the gradients are summed over the ranks, so each update is the
/// one a single process makes on the whole batch. Rank 0 broadcasts the initial weights,
/// evaluates, prints, writes metrics and checkpoints (with every rank's dropout stream);
/// a stop seen by any rank stops all of them after the same step. The ranks must be started
/// with the same flags (checked first).
TrainResult train(const TrainConfig& config, std::ostream& out,
                  const std::atomic<bool>* stop = nullptr, Collectives* ranks = nullptr);

/// Fails unless a global batch of `batch_size` sequences gives each of `data_ranks`
/// data-parallel ranks at least one: the ranks themselves, or with --context-parallel R > 1
/// their groups of R that share a sequence.
void check_global_batch(int64_t batch_size, int data_ranks, int64_t context_parallel = 1);

/// Fails unless `world_size` ranks form whole context-parallel groups of `context_parallel`.
void check_context_parallel_ranks(int64_t context_parallel, int world_size);

/// Fails unless a task's sequences of `input_length` tokens divide into the 2 R equal chunks
/// of R = `context_parallel` zigzag shards.
void check_context_parallel_length(const TrainConfig& config, int64_t input_length);

/// Fails for a 16-bit --dtype with more than one rank unless --autocast: the working copy is
/// single-process (the gradient buckets hook the float32 parameters, which its backward does
/// not reach).
void check_dtype_ranks(const std::string& dtype, bool autocast, int world_size);

/// The flags that every rank of a data-parallel run must share, one "name=value" per line.
std::string rank_agreement_text(const TrainConfig& config);

}  // namespace attnkit::train
