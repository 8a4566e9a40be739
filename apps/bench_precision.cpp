// attnkit-bench --precision: each backend's error against float64, over the float32 floor
// (bench_problem.h).

#include <algorithm>
#include <iomanip>
#include <iostream>

#include "bench_problem.h"
#include "train/line.h"

namespace attnkit::bench {

using attnkit::train::Line;

namespace {

// The largest error of `got` against `exact`, relative to exact's largest value.
double relative_error(const torch::Tensor& got, const torch::Tensor& exact) {
  const auto wide = exact.to(torch::kDouble);
  return ((got.to(torch::kDouble) - wide).abs().max() / wide.abs().max()).item<double>();
}

// Output and the gradients of q, k and v of sum(attention(q, k, v) * probe).
std::vector<torch::Tensor> output_and_gradients(
    const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
    const torch::Tensor& probe, const attnkit::functional::AttentionOptions& options) {
  auto q = q_in.detach().requires_grad_(true);
  auto k = k_in.detach().requires_grad_(true);
  auto v = v_in.detach().requires_grad_(true);
  const auto out = attnkit::functional::attention(q, k, v, options);
  (out * probe.to(out.scalar_type())).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

}  // namespace

void report_precision(const BenchConfig& c, const torch::TensorOptions& options) {
  namespace F = attnkit::functional;
  const int64_t hd = c.d_model / c.heads;
  const auto device = options.device();
  const auto dtype = options.dtype().toScalarType();
  const auto q = torch::randn({c.batch, c.heads, c.tokens, hd}, options);
  const auto k = torch::randn({c.batch, c.heads, c.tokens, hd}, options);
  const auto v = torch::randn({c.batch, c.heads, c.tokens, hd}, options);
  const auto probe = torch::randn({c.batch, c.heads, c.tokens, hd}, options);
  const auto base = F::AttentionOptions()
                        .mask(make_mask(c, device))
                        .score_mod(make_score(c))
                        .query_block_size(c.chunk_size)
                        .key_block_size(c.key_chunk_size);
  const auto with_backend = [&](attnkit::AttentionBackend backend) {
    auto o = base;
    return o.backend(backend);
  };
  const auto exact =
      output_and_gradients(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble), probe,
                           with_backend(attnkit::AttentionBackend::kMath));
  const auto floor_run =
      output_and_gradients(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), probe,
                           with_backend(attnkit::AttentionBackend::kMath));
  std::vector<double> floor(4);
  for (size_t i = 0; i < 4; ++i)
    floor[i] = relative_error(floor_run[i].to(dtype), exact[i]);
  Line table(std::cout);
  table << std::fixed << std::setprecision(4) << "float32 floor: output " << floor[0]
        << ", gradients " << *std::min_element(floor.begin() + 1, floor.end()) << "-"
        << *std::max_element(floor.begin() + 1, floor.end()) << "\n"
        << "| backend | output | gradients (dq, dk, dv) | output / floor | gradients / floor |\n"
        << "|---|---|---|---|---|\n";
  for (const auto backend : {attnkit::AttentionBackend::kMath, attnkit::AttentionBackend::kChunked,
                             attnkit::AttentionBackend::kFused}) {
    const auto why_not = F::unsupported_reason(backend, q, k, v, with_backend(backend));
    if (!why_not.empty()) {
      table << "| " << attnkit::backend_name(backend) << " | not run: " << why_not << " | | | |\n";
      continue;
    }
    const auto got = output_and_gradients(q, k, v, probe, with_backend(backend));
    double grad_error = 0.0, grad_ratio = 0.0;
    for (size_t i = 1; i < 4; ++i) {
      const double error = relative_error(got[i], exact[i]);
      grad_error = std::max(grad_error, error);
      grad_ratio = std::max(grad_ratio, error / floor[i]);
    }
    const double out_error = relative_error(got[0], exact[0]);
    table << "| " << attnkit::backend_name(backend) << " | " << out_error << " | " << grad_error
          << " | " << std::setprecision(2) << out_error / floor[0] << "x | " << grad_ratio
          << "x |\n"
          << std::setprecision(4);
  }
}

}  // namespace attnkit::bench
