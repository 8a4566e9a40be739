#pragma once

// attnkit-train's SIGINT and SIGTERM. The first signal asks the run to stop after its step
// (saving with --save). A step can be slow (a large model, a large batch): a run that has not
// ended within the grace period after the first signal abandons its step and exits 130 at
// once, and a second signal exits at once. Either way the last checkpoint stays as it was: a
// checkpoint is written to a temporary file and renamed (checkpoint.h), the temporary file of
// a write cut short is removed, and the grace period never cuts a write short (a write is
// bounded; a step is not).

#include <atomic>
#include <cstdint>
#include <string>

namespace attnkit::train {

/// Seconds a run has, after the first signal, to end its step and save.
constexpr int kStopGraceSeconds = 3;

/// What the run tells the signal handling: the step in progress, the last step it saved, and
/// whether a checkpoint is being written. Lock-free atomics: read by a signal handler and by
/// the grace period's thread.
struct RunProgress {
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> saved_step{-1};       // the step --save holds (-1: none of this run's)
  std::atomic<int> writing{0};               // checkpoints being written now
  std::atomic<bool> ended{false};            // train() has returned: the grace period is over
  std::atomic<bool> holds_save_lock{false};  // this process's SaveClaim holds PATH.lock
};

/// The process's run progress (one run per process).
RunProgress& run_progress();

/// Marks a checkpoint write for its lifetime: the grace period waits for it to end.
class CheckpointWrite {
 public:
  CheckpointWrite() { run_progress().writing.fetch_add(1); }
  ~CheckpointWrite() { run_progress().writing.fetch_sub(1); }
  CheckpointWrite(const CheckpointWrite&) = delete;
  CheckpointWrite& operator=(const CheckpointWrite&) = delete;
};

/// Installs the handlers of SIGINT and SIGTERM and starts the grace period's thread (once per
/// process). `save_path`: --save ("" for none), whose temporary files an exit at once
/// removes, and its lock file when this process holds it (never another run's). `announce`: whether
/// this process prints why it exits (a data-parallel run's rank 0). Returns the flag the first
/// signal sets, for train().
const std::atomic<bool>* install_stop_handlers(const std::string& save_path, bool announce);

}  // namespace attnkit::train
