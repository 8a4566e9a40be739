#include "gradient_sync.h"

#include <chrono>
#include <utility>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace attnkit::train {

namespace {
// How LibTorch hands out a gradient accumulator: std::shared_ptr<Node> up to 2.11,
// c10::intrusive_ptr<Node> in 2.15.
using AccumulatorHandle =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
}  // namespace

struct GradientSync::State {
  Collectives* group = nullptr;
  bool active = true;  // false once the GradientSync is gone (its hooks outlive it)
  struct Bucket {
    torch::Tensor gradients;  // a view of the flat buffer
    int parameters = 0;
    int pending = 0;
  };
  std::vector<Bucket> buckets;                  // in the order they start
  std::vector<int> bucket_of;                   // parameter index -> bucket
  std::vector<std::function<void()>> waiting;   // one per started bucket, in order
  std::vector<AccumulatorHandle> accumulators;  // keeps the hooks' nodes

  // Starts every bucket from the next one on that is ready: the same order on every rank.
  void start_ready() {
    while (waiting.size() < buckets.size() && buckets[waiting.size()].pending == 0)
      waiting.push_back(group->start_sum(buckets[waiting.size()].gradients));
  }
};

namespace {

// Runs after a parameter's AccumulateGrad node: its gradient is in the flat buffer.
class GradientReady : public torch::autograd::FunctionPostHook {
 public:
  GradientReady(std::shared_ptr<GradientSync::State> state, int bucket)
      : state_(std::move(state)), bucket_(bucket) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (state_->active && state_->buckets[bucket_].pending > 0) {
      --state_->buckets[bucket_].pending;
      state_->start_ready();
    }
    return outputs;
  }

 private:
  std::shared_ptr<GradientSync::State> state_;
  int bucket_;
};

}  // namespace

GradientSync::GradientSync(const std::vector<torch::Tensor>& parameters,
                           torch::Tensor flat_gradients, Collectives& group, int64_t bucket_bytes)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(bucket_bytes >= 0, "[GradientSync] bucket_bytes: expected >= 0, got ", bucket_bytes);
  state_->group = &group;
  const int count = static_cast<int>(parameters.size());
  state_->bucket_of.assign(count, 0);
  if (bucket_bytes == 0) {
    state_->buckets.push_back({flat_gradients, count, 0});
    return;
  }
  // From the last parameter backwards (backward's order, about), buckets of >= bucket_bytes.
  const int64_t element_bytes = static_cast<int64_t>(flat_gradients.element_size());
  int64_t end = flat_gradients.numel(), begin = end, bytes = 0;
  int members = 0;
  for (int i = count - 1; i >= 0; --i) {
    begin -= parameters[i].numel();
    bytes += parameters[i].numel() * element_bytes;
    state_->bucket_of[i] = static_cast<int>(state_->buckets.size());
    ++members;
    if (bytes >= bucket_bytes || i == 0) {
      state_->buckets.push_back({flat_gradients.narrow(0, begin, end - begin), members, 0});
      end = begin;
      bytes = 0;
      members = 0;
    }
  }
  for (int i = 0; i < count; ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(parameters[i]);
    TORCH_CHECK(accumulator != nullptr, "[GradientSync] parameter ", i, " needs no gradient");
    accumulator->add_post_hook(std::make_unique<GradientReady>(state_, state_->bucket_of[i]));
    state_->accumulators.push_back(std::move(accumulator));
  }
}

GradientSync::~GradientSync() {
  state_->active = false;
  // The nodes own the hooks, which own the state: let go of the nodes to break the cycle.
  state_->accumulators.clear();
}

void GradientSync::before_backward() {
  state_->waiting.clear();
  for (auto& bucket : state_->buckets)
    bucket.pending = state_->accumulators.empty() ? 0 : bucket.parameters;
}

double GradientSync::after_backward() {
  const auto start = std::chrono::steady_clock::now();
  for (auto& bucket : state_->buckets)
    bucket.pending = 0;  // parameters that got no gradient this step: their zeros count
  state_->start_ready();
  for (auto& wait : state_->waiting)
    wait();
  state_->waiting.clear();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::vector<int64_t> GradientSync::bucket_sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& bucket : state_->buckets)
    sizes.push_back(bucket.gradients.numel());
  return sizes;
}

}  // namespace attnkit::train
