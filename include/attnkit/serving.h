#pragma once

/// Continuous batching on paged KV caches, as serving engines do it: requests join a running
/// batch between steps and leave it when they end, each with its own max_new_tokens, stop
/// tokens and sampling settings; prompts are prefilled in chunks that share a step with the
/// other requests' decode tokens, under a cap on the tokens of one step.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/torch.h>

#include "attnkit/generate.h"
#include "attnkit/paged_kv_cache.h"

namespace attnkit {

/// Options for `Scheduler`.
/// Example: `SchedulerOptions(/*num_pages=*/512).page_size(16).max_running(32)`.
struct SchedulerOptions {
  explicit SchedulerOptions(int64_t num_pages) : num_pages_(num_pages) {}

  /// Pages of each attention layer's pool, allocated once (PagedKVCache::pages_within gives
  /// the pages a memory budget holds).
  TORCH_ARG(int64_t, num_pages);
  /// Positions of one page.
  TORCH_ARG(int64_t, page_size) = 16;
  /// Most requests admitted at once (prefilling or decoding); the rest wait in order.
  TORCH_ARG(int64_t, max_running) = 32;
  /// Most tokens one step feeds the model: every decoding request's token first, then prompt
  /// chunks in order of arrival up to the cap (chunked prefill), so a long prompt does not
  /// stall the others' decoding. At least max_running.
  TORCH_ARG(int64_t, max_tokens_per_step) = 256;
  /// Keep the logits each new token was chosen from (ServedRequest::logits).
  TORCH_ARG(bool, keep_logits) = false;
};

/// A request that has ended.
struct ServedRequest {
  /// What Scheduler::submit returned.
  int64_t id = -1;
  /// The prompt, then the new tokens: (prompt_length + new) int64, on the CPU.
  torch::Tensor tokens;
  int64_t prompt_length = 0;
  /// With keep_logits: (new, vocab), row i the logits new token i was chosen from, on the
  /// CPU; otherwise undefined.
  torch::Tensor logits;
  /// Seconds from submit to the first new token (the time to first token), and to the end.
  double seconds_to_first_token = 0.0;
  double seconds = 0.0;
  /// Empty when served; else why it ended early: the model's call that fed it threw (the
  /// message names the call), and `tokens` holds what it had by then.
  std::string error;
};

/// Serves requests over `model`'s paged caches (one PagedKVCache per attention layer).
///
/// Each request gets the tokens that `attnkit::generate` gives its prompt alone with the same
/// GenerateOptions: greedy tokens equal, logits equal to rounding, sampled ones drawn from a
/// generator of its own seeded by options.seed(). As generate does, a prompt longer than the
/// model's context is cut to its last context_length tokens, and a request whose cache
/// reaches the context starts its pages over from its last context_length / 2 tokens.
///
/// A request is admitted when the pages it can come to hold, min(prompt + max_new_tokens,
/// context_length) positions, fit beside those the running requests may come to hold, so a
/// running request never meets a full pool: a request that does not fit waits, and one that
/// could never fit is refused by submit. A request's pages return to the pool when it ends.
///
/// A model call that throws (paged_logits: a bad token id, an allocation that fails) ends the
/// requests it fed, with the message in ServedRequest::error, and their pages return to the
/// pool; the step goes on with the others, so no request is left half-fed. Nothing is
/// durable: the pools and the queue live in memory, and a process that ends loses them.
///
/// Example:
/// ```
/// attnkit::Scheduler scheduler(model, attnkit::SchedulerOptions(/*num_pages=*/256));
/// scheduler.submit(prompt_a, attnkit::GenerateOptions(50).stop_tokens({eos}));
/// scheduler.submit(prompt_b, attnkit::GenerateOptions(20).temperature(0.8).seed(7));
/// while (!scheduler.idle()) {
///   for (const auto& done : scheduler.step())  // requests may be submitted between steps
///     use(done.id, done.tokens);
/// }
/// ```
class Scheduler {
 public:
  /// Makes the pools (model.make_paged_kv_caches), refused past attnkit::memory_budget().
  /// `model` must outlive the scheduler and stay in eval mode.
  Scheduler(CausalLanguageModel& model, const SchedulerOptions& options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Queues `prompt`, (n) int64 token ids with n >= 1, with its own max_new_tokens,
  /// stop_tokens, temperature, top_k and seed (use_kv_cache must be true); returns its id
  /// (0, 1, ... in order of submission). With `prefix` (add_prefix's id) the request's prompt
  /// is the prefix's tokens followed by `prompt`: it shares the prefix's pages and prefills
  /// only its own tokens, and the whole prompt must fit in the context. Refused, queueing
  /// nothing: bad arguments, an unknown or released prefix, and a request whose pages could
  /// never fit in the pool.
  int64_t submit(const torch::Tensor& prompt, const GenerateOptions& options,
                 c10::optional<int64_t> prefix = c10::nullopt);
  /// Prefills `tokens` ((n) int64 token ids, 1 <= n < context_length) now, in chunks of
  /// max_tokens_per_step, and keeps its pages in every pool for requests submitted with it
  /// (a system prompt, a few-shot preamble): they hold its full pages once, by reference,
  /// and copy only a partly filled last page. Returns the prefix's id (0, 1, ...). Its pages
  /// count against the pool until release_prefix and the end of the last request on it;
  /// refused when they do not fit beside the running requests' now. A model call that
  /// throws leaves no prefix: its pages return, and the exception propagates.
  int64_t add_prefix(const torch::Tensor& tokens);
  /// No new request may name `prefix`; its pages return to the pool once no request on it
  /// runs or waits.
  void release_prefix(int64_t prefix);
  /// One step: admits waiting requests in order while they fit, feeds the model one batch
  /// of the decoding requests' tokens and the prefill chunks, and samples. Returns the
  /// requests that ended since the last step.
  std::vector<ServedRequest> step();
  /// Steps until nothing waits or runs; returns the requests that ended meanwhile, by id.
  std::vector<ServedRequest> run();

  int64_t waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t running() const { return static_cast<int64_t>(running_.size()); }
  bool idle() const { return waiting_.empty() && running_.empty() && ended_.empty(); }
  /// The pools, one per attention layer.
  const std::vector<PagedKVCache>& pools() const { return pools_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Request;
  using Clock = std::chrono::steady_clock;
  // A prefilled prefix: its sequence in every pool (-1 once its pages are given back).
  struct Prefix {
    std::vector<int64_t> tokens;
    int64_t sequence = -1;
    int64_t pages = 0;  // reserved for it
    int64_t users = 0;  // requests on it, waiting or running
    bool released = false;
  };

  // Pages a request can come to hold in each pool.
  int64_t pages_for(const Request& request) const;
  void admit();
  // A sequence in every pool, new or (parent >= 0) a fork of parent; its id, the same in each.
  int64_t new_sequence(int64_t parent);
  // Starts (or, at the context, starts over) request's sequence in every pool from its last
  // `positions` tokens, which become its pending input; a request on a prefix starts as a
  // fork of it, its own tokens pending.
  void start_sequence(Request& request, int64_t positions);
  void end(Request& request);
  // Gives a released prefix's pages back once no request uses it.
  void drop_prefix_if_unused(Prefix& prefix);

  CausalLanguageModel& model_;
  SchedulerOptions options_;
  std::vector<PagedKVCache> pools_;
  torch::Device device_;
  int64_t context_ = 0;
  int64_t reserved_pages_ = 0;  // pages_for of the running requests, and the prefixes' pages
  int64_t next_id_ = 0;
  std::vector<Prefix> prefixes_;                   // by id
  std::vector<std::unique_ptr<Request>> waiting_;  // in order of submission
  std::vector<std::unique_ptr<Request>> running_;  // in order of admission
  std::vector<ServedRequest> ended_;               // since the last step
};

}  // namespace attnkit
