#pragma once
// tiny_gpt --hf DIR --serve PROMPTS: a Hugging Face checkpoint serving a file of prompts
// (one per line, token ids separated by spaces), every prompt submitted at once, by
// attnkit::Scheduler's continuous batching on paged caches, or (--one-at-a-time) by
// attnkit::generate one prompt after another with the contiguous caches. Prints each
// request's time to first token and latency, then the throughput.

#include <string>

#include <torch/torch.h>

namespace tiny_gpt {

struct ServeSettings {
  std::string prompts_path;
  int64_t new_tokens = 32;  // greedy tokens per request
  bool one_at_a_time = false;
  int64_t page_size = 16;
  int64_t max_running = 32;
};

/// Returns the exit code: 0, or 1 for a prompts file it cannot use.
int serve(const std::string& dir, torch::Device device, torch::ScalarType dtype,
          const ServeSettings& settings);

}  // namespace tiny_gpt
