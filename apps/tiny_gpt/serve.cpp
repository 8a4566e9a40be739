#include "serve.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include <attnkit/attnkit.h>

#include "hf_config.h"

namespace tiny_gpt {

namespace {

using Clock = std::chrono::steady_clock;

// One prompt per non-empty line of `path`, token ids in [0, vocab) separated by spaces; an
// empty result on a problem, which is printed.
std::vector<torch::Tensor> read_prompts(const std::string& path, int64_t vocab) {
  std::ifstream file(path);
  if (!file) {
    std::cerr << "tiny_gpt: --serve: cannot read " << path << "\n";
    return {};
  }
  std::vector<torch::Tensor> prompts;
  std::string line;
  for (int64_t number = 1; std::getline(file, line); ++number) {
    std::istringstream words(line);
    std::vector<int64_t> ids;
    std::string word;
    while (words >> word) {
      size_t used = 0;
      int64_t id = -1;
      try {
        id = std::stoll(word, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != word.size() || id < 0 || id >= vocab) {
        std::cerr << "tiny_gpt: --serve " << path << ":" << number << ": '" << word
                  << "' is not a token id in [0, " << vocab << ")\n";
        return {};
      }
      ids.push_back(id);
    }
    if (!ids.empty())
      prompts.push_back(torch::tensor(ids, torch::kInt64));
  }
  if (prompts.empty())
    std::cerr << "tiny_gpt: --serve " << path << " holds no prompt (one per line, token ids)\n";
  return prompts;
}

double milliseconds(double seconds) {
  return 1e3 * seconds;
}

// The median and the largest of `values`.
std::pair<double, double> median_and_max(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return {values[values.size() / 2], values.back()};
}

}  // namespace

int serve(const std::string& dir, torch::Device device, torch::ScalarType dtype,
          const ServeSettings& settings) {
  torch::NoGradGuard no_grad;
  auto model = load_hf_model(dir, dtype, device);
  const auto prompts = read_prompts(settings.prompts_path, model->config.vocab);
  if (prompts.empty())
    return 1;
  const auto options = attnkit::GenerateOptions(settings.new_tokens);
  std::vector<double> first_token, latency;  // per request, seconds from the start
  int64_t new_tokens = 0, failed = 0;        // failed: requests the Scheduler ended with an error
  std::string how;
  const auto start = Clock::now();
  if (settings.one_at_a_time) {
    how = "one at a time (attnkit::generate, contiguous caches)";
    for (size_t r = 0; r < prompts.size(); ++r) {
      // Its first token comes after everything before it: its start is a lower bound.
      first_token.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      const auto row =
          attnkit::generate(*model, {attnkit::GenerationRequest(prompts[r].to(device))}, options);
      latency.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      new_tokens += row.front().size(0) - prompts[r].size(0);
      std::cout << "request " << r << ": prompt " << prompts[r].size(0) << " tokens, "
                << row.front().size(0) - prompts[r].size(0) << " new, started "
                << milliseconds(first_token.back()) << " ms, done " << milliseconds(latency.back())
                << " ms\n";
    }
  } else {
    // Pages for max_running requests as long as the context: none waits for pages.
    const int64_t pages_per_request =
        (model->context_length() + settings.page_size - 1) / settings.page_size;
    attnkit::Scheduler scheduler(
        *model,
        attnkit::SchedulerOptions(settings.max_running * pages_per_request)
            .page_size(settings.page_size)
            .max_running(settings.max_running)
            .max_tokens_per_step(std::max<int64_t>(settings.max_running, 8 * settings.page_size)));
    how = c10::str("by continuous batching (attnkit::Scheduler, pages of ", settings.page_size,
                   ", up to ", settings.max_running, " running)");
    for (const auto& prompt : prompts)
      scheduler.submit(prompt.to(device), options);
    for (const auto& done : scheduler.run()) {
      if (!done.error.empty()) {
        std::cerr << "tiny_gpt: request " << done.id << " failed: " << done.error << "\n";
        ++failed;
        continue;
      }
      first_token.push_back(done.seconds_to_first_token);
      latency.push_back(done.seconds);
      const int64_t generated = done.tokens.size(0) - done.prompt_length;
      new_tokens += generated;
      std::cout << "request " << done.id << ": prompt " << done.prompt_length << " tokens, "
                << generated << " new, first token " << milliseconds(done.seconds_to_first_token)
                << " ms, done " << milliseconds(done.seconds) << " ms\n";
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto [first_median, first_max] = median_and_max(first_token);
  const auto [latency_median, latency_max] = median_and_max(latency);
  std::cout << "served " << prompts.size() << " requests " << how << " on " << device << " in "
            << c10::toString(dtype) << ": " << new_tokens << " new tokens in " << seconds << " s, "
            << new_tokens / seconds << " tokens/s; "
            << (settings.one_at_a_time ? "start (a bound on the first token)"
                                       : "time to first token")
            << " median " << milliseconds(first_median) << " ms, max " << milliseconds(first_max)
            << " ms; latency median " << milliseconds(latency_median) << " ms, max "
            << milliseconds(latency_max) << " ms\n";
  return failed == 0 ? 0 : 1;
}

}  // namespace tiny_gpt
