// attnkit::flex_attention called from C++, for scripts/bench_flex_python.py --overhead: the
// same operator call a C++ program makes (through the dispatcher, its arguments made once),
// timed in C++, so that the Python package's cost over it can be measured. Built on demand
// with torch.utils.cpp_extension against the PyTorch that runs the script.

#include <chrono>
#include <vector>

#include <torch/extension.h>

namespace {

using torch::Tensor;
using OptionalTensor = c10::optional<Tensor>;
// The operator's C++ signature, as src/ops/flex_operators.cpp registers it.
using FlexAttention = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&, const OptionalTensor&,
    const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, c10::string_view,
    c10::optional<at::TensorList>, int64_t, int64_t, c10::string_view, at::TensorList, double,
    double, int64_t, bool);

// Seconds per call of `calls` back-to-back calls, under no_grad as the Python side's.
double seconds_per_call(const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<OptionalTensor>& lists, int64_t q_block, int64_t kv_block,
                        double scale, int64_t calls) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnkit::flex_attention", "")
                       .typed<FlexAttention>();
  TORCH_CHECK(lists.size() == 5, "lists: the five block tensors, got ", lists.size());
  const torch::NoGradGuard no_grad;
  const std::vector<Tensor> no_tensors;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < calls; ++i) {
    op.call(q, k, v, lists[0], lists[1], lists[2], lists[3], lists[4], "", c10::nullopt, q_block,
            kv_block, "", no_tensors, scale, 0.0, -1, /*max_scores=*/false);
  }
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  return elapsed.count() / static_cast<double>(calls);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("seconds_per_call", &seconds_per_call);
}
