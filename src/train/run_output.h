#pragma once

// What a training run writes besides its checkpoints: the metrics file, the progress line,
// the held-out evaluation's text, the message of a loss that stopped being finite, samples
// from the model and its attention maps. The training loop (trainer.cpp) writes them; the
// configuration's checks (run_config.cpp) read --prompts early with read_prompts.

#include <chrono>
#include <cstdint>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer.h"

namespace attnkit::train {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool ends_with(const std::string& text, const std::string& suffix);

/// --metrics: one line per evaluation, JSON lines or (a name ending in .csv) CSV, flushed
/// as written; an empty path writes nothing.
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool text_task);
  /// One line, flushed; a line the file did not take in full (a full disk) ends the run with
  /// an error naming the file.
  void write(int64_t step, const Evaluation& e, double train_loss, double tokens_per_s,
             double elapsed_s, bool final);

 private:
  std::string path_;
  bool text_task_;
  bool csv_ = false;
  std::ofstream out_;
};

/// "held-out loss L, B bits/byte" (text) or "held-out loss L, accuracy A%".
std::string format_eval(const Evaluation& e, bool text);

/// The progress bar line, redrawn in place.
void draw_progress(std::ostream& out, int64_t step, int64_t steps, double loss, double accuracy,
                   bool text, double tokens_per_s, double eta_s);

/// "sample (N bytes, KV cache, T tokens/s): [prompt]continuation": `length` bytes after the
/// first 16 of a held-out sequence, temperature 0.8, seeded by --seed.
std::string sample_text(AttentionModel& model, const Task& task, const torch::Device& device,
                        const TrainConfig& config);

/// The non-empty lines of --prompts, each a prompt of bytes.
std::vector<std::string> read_prompts(const std::string& path);

/// "samples (K prompts in one batch, N bytes each, T tokens/s):" then "[prompt]continuation"
/// per line of --prompts, temperature 0.8, seeded by --seed.
std::string sample_prompts(AttentionModel& model, const torch::Device& device,
                           const TrainConfig& config);

/// --dump-attention: every layer's attention maps of one held-out example as a PNG.
void dump_attention(const std::string& path, AttentionModel& model, const Task& task,
                    const torch::Device& device);

/// Why training stopped at a loss or gradient that is no longer finite, and what was kept.
/// `saved_step`: the step --save holds, from this run or the one it resumed from (0: none).
std::string non_finite_message(const char* what, double value, int64_t step,
                               const TrainConfig& config, int64_t saved_step);

}  // namespace attnkit::train
