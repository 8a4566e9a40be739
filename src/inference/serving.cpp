#include "attnkit/serving.h"

#include <algorithm>
#include <exception>
#include <map>
#include <string>
#include <utility>

#include "core/base/checks.h"
#include "inference/sampling.h"

namespace attnkit {

namespace {

constexpr const char* kFn = "[Scheduler]";

// An exception's message, without a c10::Error's backtrace.
std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

double seconds_between(std::chrono::steady_clock::time_point from,
                       std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

struct Scheduler::Request {
  Request(int64_t id, const GenerateOptions& options, at::Generator generator)
      : id(id), options(options), generator(std::move(generator)) {}

  int64_t id;
  GenerateOptions options;
  at::Generator generator;      // its own, so its draws do not depend on the others
  std::vector<int64_t> tokens;  // the prompt, then the new tokens
  int64_t prompt_length = 0;
  int64_t prefix = -1;                // the prefix it shares, or -1
  int64_t sequence = -1;              // its id in every pool, once admitted
  int64_t next = 0;                   // tokens[next, end) are still to be fed to the model
  std::vector<torch::Tensor> logits;  // with keep_logits, (vocab) per new token
  Clock::time_point submitted;
  double seconds_to_first_token = 0.0;
  std::string error;  // why its model call failed; it ends then

  int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt_length; }
  int64_t pending() const { return static_cast<int64_t>(tokens.size()) - next; }
  bool finished() const {
    if (!error.empty() || generated() >= options.max_new_tokens())
      return true;
    if (generated() == 0)
      return false;
    const auto& stops = options.stop_tokens();
    return std::find(stops.begin(), stops.end(), tokens.back()) != stops.end();
  }
};

Scheduler::Scheduler(CausalLanguageModel& model, const SchedulerOptions& options)
    : model_(model), options_(options), device_(torch::kCPU), context_(model.context_length()) {
  TORCH_CHECK(options.num_pages() >= 1 && options.page_size() >= 1, kFn,
              " num_pages and page_size must be >= 1, got num_pages = ", options.num_pages(),
              ", page_size = ", options.page_size());
  TORCH_CHECK(options.max_running() >= 1, kFn, " max_running must be >= 1, got ",
              options.max_running());
  TORCH_CHECK(options.max_tokens_per_step() >= options.max_running(), kFn,
              " max_tokens_per_step must be >= max_running (every running request's decode "
              "token fits in one step), got max_tokens_per_step = ",
              options.max_tokens_per_step(), ", max_running = ", options.max_running());
  TORCH_CHECK(context_ >= 1, kFn, " the model's context_length must be >= 1, got ", context_);
  pools_ = model.make_paged_kv_caches(options.num_pages(), options.page_size());
  TORCH_CHECK(!pools_.empty(), kFn, " make_paged_kv_caches returned no pool");
  for (size_t layer = 0; layer < pools_.size(); ++layer) {
    TORCH_CHECK(pools_[layer].num_pages() == options.num_pages() &&
                    pools_[layer].page_size() == options.page_size(),
                kFn, " make_paged_kv_caches(", options.num_pages(), ", ", options.page_size(),
                ") gave pool ", layer, " of ", pools_[layer].num_pages(), " pages of ",
                pools_[layer].page_size(), " positions");
  }
  device_ = pools_.front().key_pages().device();
}

Scheduler::~Scheduler() = default;

int64_t Scheduler::pages_for(const Request& request) const {
  const int64_t total = request.prompt_length + request.options.max_new_tokens();
  const int64_t pages =
      (std::min(total, context_) + options_.page_size() - 1) / options_.page_size();
  // The prefix's full pages are shared for good unless the cache starts over at the context.
  if (request.prefix >= 0 && total <= context_) {
    const auto shared = static_cast<int64_t>(prefixes_[request.prefix].tokens.size());
    return pages - shared / options_.page_size();
  }
  return pages;
}

int64_t Scheduler::new_sequence(int64_t parent) {
  int64_t sequence = -1;
  for (size_t layer = 0; layer < pools_.size(); ++layer) {
    const int64_t id = parent >= 0 ? pools_[layer].fork(parent) : pools_[layer].add_sequence();
    TORCH_CHECK(layer == 0 || id == sequence, kFn, " pool ", layer, " gave sequence id ", id,
                " where pool 0 gave ", sequence,
                ": every layer's pool must see the same add_sequence, fork and release calls");
    sequence = id;
  }
  return sequence;
}

int64_t Scheduler::add_prefix(const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(tokens.defined() && tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 &&
                  tokens.size(0) >= 1 && tokens.size(0) < context_,
              kFn,
              " add_prefix: expected (n) int64 token ids with 1 <= n < context_length = ", context_,
              ", got ",
              tokens.defined() ? c10::str(detail::shape_string(tokens), " ", tokens.scalar_type())
                               : std::string("an undefined tensor"));
  Prefix prefix;
  const auto ids = tokens.to(torch::kCPU).contiguous();
  prefix.tokens.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.size(0));
  const auto n = static_cast<int64_t>(prefix.tokens.size());
  prefix.pages = (n + options_.page_size() - 1) / options_.page_size();
  TORCH_CHECK(reserved_pages_ + prefix.pages <= options_.num_pages(), kFn, " add_prefix: its ", n,
              " tokens take ", prefix.pages, " pages of ", options_.page_size(), ", but ",
              reserved_pages_, " of the pool's ", options_.num_pages(),
              " are reserved by running requests and prefixes; add it when fewer run");
  prefix.sequence = new_sequence(-1);
  reserved_pages_ += prefix.pages;
  try {
    for (int64_t done = 0; done < n;) {  // in chunks, as a request's prefill
      const int64_t chunk = std::min(n - done, options_.max_tokens_per_step());
      const auto input = torch::tensor(std::vector<int64_t>(prefix.tokens.begin() + done,
                                                            prefix.tokens.begin() + done + chunk),
                                       torch::kInt64)
                             .view({1, chunk})
                             .to(device_);
      model_.paged_logits(input, pools_, {prefix.sequence});
      done += chunk;
    }
  } catch (...) {  // no prefix: its pages go back, and the caller hears why
    for (auto& pool : pools_)
      pool.release(prefix.sequence);
    reserved_pages_ -= prefix.pages;
    throw;
  }
  prefixes_.push_back(std::move(prefix));
  return static_cast<int64_t>(prefixes_.size()) - 1;
}

void Scheduler::release_prefix(int64_t prefix) {
  TORCH_CHECK(
      prefix >= 0 && prefix < static_cast<int64_t>(prefixes_.size()) && !prefixes_[prefix].released,
      kFn, " release_prefix: ", prefix, " is not a prefix held (", prefixes_.size(),
      " were added)");
  prefixes_[prefix].released = true;
  drop_prefix_if_unused(prefixes_[prefix]);
}

void Scheduler::drop_prefix_if_unused(Prefix& prefix) {
  if (!prefix.released || prefix.users > 0 || prefix.sequence < 0)
    return;
  for (auto& pool : pools_)
    pool.release(prefix.sequence);
  reserved_pages_ -= prefix.pages;
  prefix.sequence = -1;
}

int64_t Scheduler::submit(const torch::Tensor& prompt, const GenerateOptions& options,
                          c10::optional<int64_t> prefix) {
  TORCH_CHECK(prompt.defined() && prompt.dim() == 1 && prompt.scalar_type() == torch::kInt64 &&
                  prompt.size(0) >= 1,
              kFn, " prompt: expected (n) int64 token ids with n >= 1, got ",
              prompt.defined() ? c10::str(detail::shape_string(prompt), " ", prompt.scalar_type())
                               : std::string("an undefined tensor"));
  detail::check_sampling_options(kFn, options);
  TORCH_CHECK(options.use_kv_cache(), kFn,
              " serves from paged KV caches: use_kv_cache must be true");
  auto request =
      std::make_unique<Request>(next_id_, options, at::detail::createCPUGenerator(options.seed()));
  if (prefix) {
    TORCH_CHECK(*prefix >= 0 && *prefix < static_cast<int64_t>(prefixes_.size()) &&
                    !prefixes_[*prefix].released,
                kFn, " prefix ", *prefix, " is not a prefix held (", prefixes_.size(),
                " were added; a released one takes no new request)");
    const auto& shared = prefixes_[*prefix].tokens;
    TORCH_CHECK(static_cast<int64_t>(shared.size()) + prompt.size(0) <= context_, kFn,
                " a request on a prefix keeps its whole prompt: prefix ", shared.size(),
                " + prompt ", prompt.size(0), " tokens must fit in the context of ", context_);
    request->tokens = shared;
    request->prefix = *prefix;
  }
  const auto ids = prompt.to(torch::kCPU).contiguous();
  request->tokens.insert(request->tokens.end(), ids.data_ptr<int64_t>(),
                         ids.data_ptr<int64_t>() + ids.size(0));
  request->prompt_length = static_cast<int64_t>(request->tokens.size());
  request->submitted = Clock::now();
  const int64_t pages = pages_for(*request);
  TORCH_CHECK(pages <= options_.num_pages(), kFn, " request ", next_id_, " can hold ",
              std::min(request->prompt_length + options.max_new_tokens(), context_),
              " positions (prompt ", request->prompt_length, " + max_new_tokens ",
              options.max_new_tokens(), ", at most the context of ", context_, "): ", pages,
              " pages of ", options_.page_size(), ", but the pool has ", options_.num_pages(),
              "; raise SchedulerOptions::num_pages or lower max_new_tokens");
  ++next_id_;
  if (request->prefix >= 0)
    ++prefixes_[request->prefix].users;
  if (request->finished()) {  // max_new_tokens = 0: the prompt, as generate returns it
    end(*request);
  } else {
    waiting_.push_back(std::move(request));
  }
  return next_id_ - 1;
}

void Scheduler::start_sequence(Request& request, int64_t positions) {
  if (request.sequence < 0 && request.prefix >= 0) {  // admitted on a prefix: shares its pages
    const auto& prefix = prefixes_[request.prefix];
    request.sequence = new_sequence(prefix.sequence);
    request.next = static_cast<int64_t>(prefix.tokens.size());
    return;
  }
  if (request.sequence >= 0) {
    for (auto& pool : pools_)
      pool.release(request.sequence);
  }
  request.sequence = new_sequence(-1);
  request.next = static_cast<int64_t>(request.tokens.size()) - positions;
}

void Scheduler::admit() {
  while (!waiting_.empty() && running() < options_.max_running()) {
    auto& request = *waiting_.front();
    const int64_t pages = pages_for(request);
    if (reserved_pages_ + pages > options_.num_pages())
      break;  // waits, in order, for running requests to end
    reserved_pages_ += pages;
    // As generate does: the prompt's last `context` tokens.
    start_sequence(request, std::min(request.prompt_length, context_));
    running_.push_back(std::move(waiting_.front()));
    waiting_.erase(waiting_.begin());
  }
}

void Scheduler::end(Request& request) {
  if (request.sequence >= 0) {
    for (auto& pool : pools_)
      pool.release(request.sequence);
    reserved_pages_ -= pages_for(request);
  }
  if (request.prefix >= 0) {
    --prefixes_[request.prefix].users;
    drop_prefix_if_unused(prefixes_[request.prefix]);
  }
  ServedRequest served;
  served.id = request.id;
  served.tokens = torch::tensor(request.tokens, torch::kInt64);
  served.prompt_length = request.prompt_length;
  if (!request.logits.empty())
    served.logits = torch::stack(request.logits);
  served.seconds_to_first_token = request.seconds_to_first_token;
  served.seconds = seconds_between(request.submitted, Clock::now());
  served.error = request.error;
  ended_.push_back(std::move(served));
}

std::vector<ServedRequest> Scheduler::step() {
  torch::NoGradGuard no_grad;
  admit();
  // This step's work, decoding requests first: (request, tokens fed), grouped by the count,
  // one model call per group.
  std::map<int64_t, std::vector<Request*>> groups;
  int64_t budget = options_.max_tokens_per_step();
  for (auto& request : running_) {
    if (request->pending() == 1) {
      groups[1].push_back(request.get());
      --budget;
    }
  }
  for (auto& request : running_) {
    if (request->pending() > 1 && budget > 0) {
      const int64_t chunk = std::min(request->pending(), budget);
      groups[chunk].push_back(request.get());
      budget -= chunk;
    }
  }
  // The requests whose input is all fed, with the logits after their last token.
  std::vector<Request*> ready;
  std::vector<torch::Tensor> ready_logits;
  for (const auto& [count, requests] : groups) {
    const auto rows = static_cast<int64_t>(requests.size());
    std::vector<int64_t> ids;  // (rows, count), built on the host and sent as one tensor
    std::vector<int64_t> sequences;
    for (auto* request : requests) {
      ids.insert(ids.end(), request->tokens.begin() + request->next,
                 request->tokens.begin() + request->next + count);
      sequences.push_back(request->sequence);
    }
    const auto tokens = torch::tensor(ids, torch::kInt64).view({rows, count}).to(device_);
    torch::Tensor logits;  // (rows, count, vocab)
    try {
      logits = model_.paged_logits(tokens, pools_, sequences);
      TORCH_CHECK(logits.dim() == 3 && logits.size(0) == rows && logits.size(1) == count, kFn,
                  " paged_logits of tokens ", detail::shape_string(tokens),
                  " returned logits of shape ", detail::shape_string(logits),
                  "; expected (rows, tokens, vocab)");
    } catch (const std::exception& e) {
      // The call's requests end with the error (their pages, whatever it wrote, return to the
      // pool); the others go on.
      for (auto* request : requests) {
        request->error = c10::str("the model's call on ", rows, " rows of ", count,
                                  " tokens failed: ", message_of(e));
      }
      continue;
    }
    for (int64_t row = 0; row < rows; ++row) {
      auto* request = requests[row];
      request->next += count;
      if (request->pending() == 0) {
        ready.push_back(request);
        ready_logits.push_back(logits[row][count - 1]);
      }
    }
  }
  if (!ready.empty()) {
    const auto last = torch::stack(ready_logits);                      // (k, vocab)
    const auto greedy = last.argmax(-1).to(torch::kCPU).contiguous();  // (k)
    const auto now = Clock::now();
    for (size_t i = 0; i < ready.size(); ++i) {
      auto& request = *ready[i];
      const int64_t token =
          request.options.temperature() == 0.0
              ? greedy.data_ptr<int64_t>()[i]
              : detail::next_tokens(last[i].unsqueeze(0), request.options, request.generator)
                    .item<int64_t>();
      if (options_.keep_logits())
        request.logits.push_back(last[i].to(torch::kCPU));
      if (request.generated() == 0)
        request.seconds_to_first_token = seconds_between(request.submitted, now);
      request.tokens.push_back(token);
      if (!request.finished() && pools_.front().length(request.sequence) >= context_) {
        // Full: start over from the last half, as generate does.
        start_sequence(request, std::max<int64_t>(1, context_ / 2));
      }
    }
  }
  // Ended requests leave, their pages returning to the pool.
  for (auto it = running_.begin(); it != running_.end();) {
    if ((*it)->finished()) {
      end(**it);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return std::exchange(ended_, {});
}

std::vector<ServedRequest> Scheduler::run() {
  std::vector<ServedRequest> ended;
  while (!idle()) {
    for (auto& served : step())
      ended.push_back(std::move(served));
  }
  std::sort(ended.begin(), ended.end(),
            [](const ServedRequest& a, const ServedRequest& b) { return a.id < b.id; });
  return ended;
}

}  // namespace attnkit
