#include "attnkit/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/checks.h"

namespace attnkit {

namespace {

void check_generate_arguments(const CausalLanguageModel& model, const torch::Tensor& prompt,
                              const GenerateOptions& options) {
  const char* fn = "[generate]";
  TORCH_CHECK(prompt.defined() && prompt.dim() == 2 && prompt.scalar_type() == torch::kInt64, fn,
              " prompt: expected (batch, num_tokens) int64 token ids, got ",
              prompt.defined() ? c10::str(detail::shape_string(prompt), " ", prompt.scalar_type())
                               : std::string("an undefined tensor"));
  TORCH_CHECK(prompt.size(0) >= 1 && prompt.size(1) >= 1, fn,
              " prompt: expected at least one sequence of at least one token, got shape ",
              detail::shape_string(prompt));
  TORCH_CHECK(options.max_new_tokens() >= 0, fn, " max_new_tokens must be >= 0, got ",
              options.max_new_tokens());
  TORCH_CHECK(std::isfinite(options.temperature()) && options.temperature() >= 0.0, fn,
              " temperature must be >= 0 (0: greedy), got ", options.temperature());
  TORCH_CHECK(options.top_k() >= 0, fn, " top_k must be >= 0 (0: all tokens), got ",
              options.top_k());
  TORCH_CHECK(model.context_length() >= 1, fn, " the model's context_length must be >= 1, got ",
              model.context_length());
}

// The next token of each row from the last position's logits (b, vocab) -> (b, 1): the
// argmax, or a draw from softmax(logits / temperature) over the top_k most likely tokens.
torch::Tensor next_tokens(const torch::Tensor& logits, const GenerateOptions& options,
                          at::Generator& generator) {
  if (options.temperature() == 0.0) {
    return logits.argmax(-1, /*keepdim=*/true);
  }
  // The generator is a CPU one, so the (small) logits are sampled on the CPU.
  auto scaled = logits.to(torch::kCPU, torch::kFloat) / options.temperature();
  const int64_t vocab = scaled.size(-1);
  if (options.top_k() > 0 && options.top_k() < vocab) {
    const auto kth =
        std::get<0>(scaled.topk(options.top_k(), -1)).narrow(-1, options.top_k() - 1, 1);
    scaled.masked_fill_(scaled < kth, -std::numeric_limits<double>::infinity());
  }
  return torch::multinomial(torch::softmax(scaled, -1), 1, /*replacement=*/false, generator)
      .to(logits.device());
}

}  // namespace

torch::Tensor generate(CausalLanguageModel& model, const torch::Tensor& prompt,
                       const GenerateOptions& options) {
  check_generate_arguments(model, prompt, options);
  torch::NoGradGuard no_grad;
  const int64_t batch = prompt.size(0);
  const int64_t prompt_length = prompt.size(1);
  const int64_t total = prompt_length + options.max_new_tokens();
  const int64_t context = model.context_length();
  auto tokens = torch::empty({batch, total}, prompt.options());
  tokens.narrow(1, 0, prompt_length).copy_(prompt);
  auto generator = at::detail::createCPUGenerator(options.seed());
  // Tokens [end - length, end) of every row: (b, length).
  const auto window = [&](int64_t end, int64_t length) {
    return tokens.narrow(1, end - length, length);
  };

  if (!options.use_kv_cache()) {
    for (int64_t t = prompt_length; t < total; ++t) {
      const auto logits = model.logits(window(t, std::min(t, context))).select(1, -1);
      tokens.narrow(1, t, 1).copy_(next_tokens(logits, options, generator));
    }
    return tokens;
  }
  if (total == prompt_length) {
    return tokens;
  }
  // Just the positions this call can use; one prefill of the prompt's last `context` tokens.
  auto caches = model.make_kv_caches(batch, std::min(total, context));
  TORCH_CHECK(!caches.empty(), "[generate] make_kv_caches returned no cache");
  // Positions the caches take before a refill: their capacity, or for rolling caches
  // (sliding-window attention) the model's context.
  const int64_t capacity = std::min(caches.front().max_positions(), context);
  auto logits =
      model.logits_with_cache(window(prompt_length, std::min(prompt_length, capacity)), caches)
          .select(1, -1);
  for (int64_t t = prompt_length; t < total; ++t) {
    tokens.narrow(1, t, 1).copy_(next_tokens(logits, options, generator));
    if (t + 1 == total) {
      break;
    }
    if (caches.front().size() < capacity) {
      logits = model.logits_with_cache(window(t + 1, 1), caches).select(1, -1);
    } else {
      // Full: start over from the last half, so refills cost O(1) per token on average.
      for (auto& cache : caches) {
        cache.reset();
      }
      const int64_t keep = std::max<int64_t>(1, capacity / 2);
      logits = model.logits_with_cache(window(t + 1, keep), caches).select(1, -1);
    }
  }
  return tokens;
}

}  // namespace attnkit
