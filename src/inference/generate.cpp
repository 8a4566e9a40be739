#include "attnkit/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/base/checks.h"
#include "inference/sampling.h"

namespace attnkit {

namespace {

void check_generate_arguments(const CausalLanguageModel& model, const torch::Tensor& prompt,
                              const GenerateOptions& options) {
  const char* fn = "[generate]";
  TORCH_CHECK(prompt.defined() && prompt.dim() == 2 && prompt.scalar_type() == torch::kInt64, fn,
              " prompt: expected (batch, num_tokens) int64 token ids, got ",
              prompt.defined() ? c10::str(detail::shape_string(prompt), " ", prompt.scalar_type())
                               : std::string("an undefined tensor"),
              prompt.defined() && prompt.dim() == 1
                  ? "; one prompt of (n) tokens: prompt.unsqueeze(0), or several of different "
                    "lengths: a std::vector<GenerationRequest>"
                  : "");
  TORCH_CHECK(prompt.size(0) >= 1 && prompt.size(1) >= 1, fn,
              " prompt: expected at least one sequence of at least one token, got shape ",
              detail::shape_string(prompt));
  detail::check_sampling_options(fn, options);
  TORCH_CHECK(model.context_length() >= 1, fn, " the model's context_length must be >= 1, got ",
              model.context_length());
}

// What the batch of prompts adds to those checks: each prompt (n) int64 on one device, and
// its limits.
void check_requests(const std::vector<GenerationRequest>& requests,
                    const GenerateOptions& options) {
  const char* fn = "[generate]";
  TORCH_CHECK(!requests.empty(), fn, " requests: expected at least one prompt, got none");
  TORCH_CHECK(options.use_kv_cache(), fn,
              " a batch of prompts decodes with the KV caches: use_kv_cache must be true");
  for (size_t r = 0; r < requests.size(); ++r) {
    const auto& prompt = requests[r].prompt();
    TORCH_CHECK(prompt.defined() && prompt.dim() == 1 && prompt.scalar_type() == torch::kInt64 &&
                    prompt.size(0) >= 1,
                fn, " requests[", r, "].prompt: expected (n) int64 token ids with n >= 1, got ",
                prompt.defined() ? c10::str(detail::shape_string(prompt), " ", prompt.scalar_type())
                                 : std::string("an undefined tensor"));
    TORCH_CHECK(prompt.device() == requests.front().prompt().device(), fn, " requests[", r,
                "].prompt is on ", prompt.device(), ", requests[0].prompt on ",
                requests.front().prompt().device(), ": put every prompt on one device");
    const int64_t new_tokens = requests[r].max_new_tokens().value_or(options.max_new_tokens());
    TORCH_CHECK(new_tokens >= 0, fn, " requests[", r, "].max_new_tokens must be >= 0, got ",
                new_tokens);
  }
}

}  // namespace

namespace detail {

void check_sampling_options(const char* fn, const GenerateOptions& options) {
  TORCH_CHECK(options.max_new_tokens() >= 0, fn, " max_new_tokens must be >= 0, got ",
              options.max_new_tokens());
  TORCH_CHECK(std::isfinite(options.temperature()) && options.temperature() >= 0.0, fn,
              " temperature must be >= 0 (0: greedy), got ", options.temperature());
  TORCH_CHECK(options.top_k() >= 0, fn, " top_k must be >= 0 (0: all tokens), got ",
              options.top_k());
}

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

}  // namespace detail

torch::Tensor CausalLanguageModel::ragged_logits_with_cache(const torch::Tensor&,
                                                            const torch::Tensor&,
                                                            std::vector<KVCache>&) {
  TORCH_CHECK(false,
              "[generate] prompts of different lengths need the model's "
              "ragged_logits_with_cache(tokens, lengths, caches); this model does not implement "
              "it (give prompts of one length, or implement it: see attnkit/generate.h)");
}

std::vector<PagedKVCache> CausalLanguageModel::make_paged_kv_caches(int64_t, int64_t) {
  TORCH_CHECK(false,
              "[Scheduler] serving needs the model's make_paged_kv_caches(num_pages, page_size) "
              "and paged_logits(tokens, pools, sequences); this model does not implement them "
              "(see attnkit/generate.h)");
}

torch::Tensor CausalLanguageModel::paged_logits(const torch::Tensor&, std::vector<PagedKVCache>&,
                                                const std::vector<int64_t>&) {
  TORCH_CHECK(false,
              "[Scheduler] serving needs the model's paged_logits(tokens, pools, sequences); "
              "this model does not implement it (see attnkit/generate.h)");
}

torch::Tensor generate(CausalLanguageModel& model, const torch::Tensor& prompt,
                       const GenerateOptions& options) {
  check_generate_arguments(model, prompt, options);
  TORCH_CHECK(options.stop_tokens().empty(),
              "[generate] stop_tokens: rows that stop early do not fit one (b, n) tensor; give "
              "the prompts as a std::vector<GenerationRequest> to stop at them");
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
      tokens.narrow(1, t, 1).copy_(detail::next_tokens(logits, options, generator));
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
    tokens.narrow(1, t, 1).copy_(detail::next_tokens(logits, options, generator));
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

namespace {

// The rows of a batch of prompts still generating, each with its whole sequence so far and
// the positions its caches hold, in the caches' row order.
struct ActiveRow {
  int64_t request;              // index into the requests
  std::vector<int64_t> tokens;  // prompt, then what was generated
  int64_t cached = 0;           // positions in the caches
};

// Feeds each row its `inputs` (token ids, at least one per row) at its next positions and
// returns the logits after each row's last input, (k, vocab). Rows of one length in a uniform
// cache take logits_with_cache (every cache kind); otherwise a right-padded
// ragged_logits_with_cache.
torch::Tensor feed(CausalLanguageModel& model, std::vector<KVCache>& caches,
                   std::vector<ActiveRow>& rows, const std::vector<std::vector<int64_t>>& inputs,
                   const torch::Device& device) {
  const auto k = static_cast<int64_t>(rows.size());
  std::vector<int64_t> lengths;
  int64_t longest = 0;
  for (const auto& input : inputs) {
    lengths.push_back(static_cast<int64_t>(input.size()));
    longest = std::max(longest, lengths.back());
  }
  // Built on the host and sent as one tensor: per-row tensor ops would cost each decode step
  // more than a small model's arithmetic.
  std::vector<int64_t> padded(k * longest, 0);  // (k, n), right-padded
  for (int64_t i = 0; i < k; ++i) {
    std::copy(inputs[i].begin(), inputs[i].end(), padded.begin() + i * longest);
    rows[i].cached += lengths[i];
  }
  const auto tokens = torch::tensor(padded, torch::kInt64).view({k, longest}).to(device);
  const bool uniform =
      !caches.front().is_ragged() &&
      std::all_of(lengths.begin(), lengths.end(), [&](int64_t n) { return n == longest; });
  if (uniform)
    return model.logits_with_cache(tokens, caches).select(1, -1);
  const auto length_tensor = torch::tensor(lengths, torch::kInt64);
  const auto all = model.ragged_logits_with_cache(tokens, length_tensor, caches);  // (k, n, V)
  const auto last = (length_tensor - 1).to(device).view({-1, 1, 1}).expand({-1, 1, all.size(2)});
  return all.gather(1, last).squeeze(1);
}

}  // namespace

std::vector<torch::Tensor> generate(CausalLanguageModel& model,
                                    const std::vector<GenerationRequest>& requests,
                                    const GenerateOptions& options) {
  check_requests(requests, options);
  check_generate_arguments(model, requests.front().prompt().view({1, -1}), options);
  torch::NoGradGuard no_grad;
  const auto device = requests.front().prompt().device();
  const auto batch = static_cast<int64_t>(requests.size());
  std::vector<std::vector<int64_t>> generated(batch);
  std::vector<int64_t> limit(batch);
  for (int64_t r = 0; r < batch; ++r)
    limit[r] = requests[r].max_new_tokens().value_or(options.max_new_tokens());
  const auto finished = [&](int64_t r) {
    if (static_cast<int64_t>(generated[r].size()) >= limit[r])
      return true;
    if (generated[r].empty())
      return false;
    const int64_t last = generated[r].back();
    const auto stops = [last](const std::vector<int64_t>& tokens) {
      return std::find(tokens.begin(), tokens.end(), last) != tokens.end();
    };
    return stops(options.stop_tokens()) || stops(requests[r].stop_tokens());
  };
  const int64_t context = model.context_length();
  std::vector<ActiveRow> active;
  int64_t capacity = 0;
  for (int64_t r = 0; r < batch; ++r) {
    if (finished(r))
      continue;
    const auto prompt = requests[r].prompt().to(torch::kCPU).contiguous();
    const auto* ids = prompt.data_ptr<int64_t>();
    active.push_back({r, std::vector<int64_t>(ids, ids + prompt.size(0))});
    capacity = std::max(capacity, std::min(prompt.size(0) + limit[r], context));
  }
  if (!active.empty()) {
    auto generator = at::detail::createCPUGenerator(options.seed());
    auto caches = model.make_kv_caches(static_cast<int64_t>(active.size()), capacity);
    TORCH_CHECK(!caches.empty(), "[generate] make_kv_caches returned no cache");
    // Each row's last `count` tokens.
    const auto last_tokens = [](const ActiveRow& row, int64_t count) {
      count = std::min<int64_t>(count, static_cast<int64_t>(row.tokens.size()));
      return std::vector<int64_t>(row.tokens.end() - count, row.tokens.end());
    };
    // As generating a prompt alone does: the prompt's last `context` tokens; a row whose
    // caches reach the context starts them over from its last context / 2 tokens.
    std::vector<std::vector<int64_t>> inputs;
    for (const auto& row : active)
      inputs.push_back(last_tokens(row, context));
    auto logits = feed(model, caches, active, inputs, device);
    const int64_t keep = std::max<int64_t>(1, context / 2);
    while (true) {
      const auto next =
          detail::next_tokens(logits, options, generator).to(torch::kCPU).contiguous();  // (k, 1)
      const auto* next_ids = next.data_ptr<int64_t>();
      std::vector<int64_t> still;  // indices into active of the rows that go on
      for (size_t i = 0; i < active.size(); ++i) {
        const int64_t token = next_ids[i];
        generated[active[i].request].push_back(token);
        active[i].tokens.push_back(token);
        if (!finished(active[i].request))
          still.push_back(static_cast<int64_t>(i));
      }
      if (still.empty())
        break;
      if (still.size() < active.size()) {
        // Finished rows leave the batch and their caches, so they cost no more work.
        for (auto& cache : caches)
          cache.keep_rows(still);
        std::vector<ActiveRow> remaining;
        for (const int64_t i : still)
          remaining.push_back(std::move(active[i]));
        active = std::move(remaining);
      }
      inputs.clear();
      std::vector<int64_t> refill;
      for (size_t i = 0; i < active.size(); ++i) {
        const bool full = active[i].cached >= capacity;
        if (full) {
          refill.push_back(static_cast<int64_t>(i));
          active[i].cached = 0;
        }
        inputs.push_back(last_tokens(active[i], full ? keep : 1));
      }
      for (auto& cache : caches)
        cache.reset_rows(refill);
      logits = feed(model, caches, active, inputs, device);
    }
  }
  std::vector<torch::Tensor> rows;
  for (int64_t r = 0; r < batch; ++r) {
    rows.push_back(
        torch::cat({requests[r].prompt(), torch::tensor(generated[r], torch::kInt64).to(device)}));
  }
  return rows;
}

}  // namespace attnkit
