// attnkit-bench's mask and score function (bench_problem.h).

#include "bench_problem.h"

#include <algorithm>
#include <cstdlib>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>

namespace attnkit::bench {

MaskKind parse_mask(const BenchConfig& c) {
  MaskKind parsed{c.mask};
  const std::string suffix = "-dense";
  if (parsed.kind.size() > suffix.size() &&
      parsed.kind.compare(parsed.kind.size() - suffix.size(), suffix.size(), suffix) == 0) {
    parsed.dense = true;
    parsed.kind.resize(parsed.kind.size() - suffix.size());
  }
  const std::string documents = "documents:";
  if (parsed.kind.rfind(documents, 0) == 0) {
    const auto count = parsed.kind.substr(documents.size());
    char* end = nullptr;
    parsed.documents = std::strtoll(count.c_str(), &end, 10);
    TORCH_CHECK(
        !count.empty() && *end == '\0' && parsed.documents >= 1 && c.tokens % parsed.documents == 0,
        "--mask ", c.mask, ": K must be a number of documents that divides --tokens ", c.tokens,
        ", got '", count, "'");
    parsed.kind = "documents";
    return parsed;
  }
  TORCH_CHECK(parsed.kind == "module" || parsed.kind == "padded" || parsed.kind == "causal-mod",
              "--mask: expected module, documents:K, padded or causal-mod, optionally with "
              "-dense, got '",
              c.mask, "'");
  return parsed;
}

attnkit::Mask make_mask(const BenchConfig& c, const torch::Device& device) {
  using attnkit::Mask;
  const auto [kind, dense, documents] = parse_mask(c);
  Mask mask;
  if (kind == "documents") {
    // (n): token j belongs to document j / (n / K)
    const auto ids = torch::arange(c.tokens, torch::kInt64).div(c.tokens / documents, "floor");
    mask = Mask::documents(ids.to(device), c.causal);
  } else if (kind == "padded") {
    const int64_t low = std::min<int64_t>(128, c.tokens);
    const auto generator = at::detail::createCPUGenerator(0);
    const auto lengths = torch::randint(low, c.tokens + 1, {c.batch}, generator, torch::kInt64);
    mask = Mask::key_padding(lengths.to(device));
    if (c.causal)
      mask = Mask::causal() & mask;
  } else if (kind == "causal-mod") {
    mask =
        Mask::from_function([](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
                               const torch::Tensor& kv) { return kv <= q; });
  } else if (c.causal) {  // module
    mask = c.window > 0 ? Mask::causal().sliding_window(c.window) : Mask::causal();
  }
  return dense ? Mask::from_tensor(mask.dense(c.batch, 1, c.tokens, c.tokens, device)) : mask;
}

attnkit::ScoreMod make_score(const BenchConfig& c) {
  if (c.score == "alibi")
    return attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(c.heads));
  if (c.score == "softcap")
    return attnkit::score_mods::softcap(30.0);
  TORCH_CHECK(c.score == "none", "--score: expected none, alibi or softcap, got '", c.score, "'");
  return nullptr;
}

bool is_core_only(const std::string& name) {
  return name == "math-core" || name == "chunked-core" || name == "fused-core";
}

namespace {

// Whether `name` runs one of attnkit's CPU kernels, which skip the keys above the causal
// diagonal: fused-core on the CPU, the fused backend on LibTorch 1.x on CPU (its loop-nest kernel
// or, past that kernel's tile, the chunked one).
bool runs_attnkit_fused_kernel(const std::string& name, const torch::TensorOptions& options) {
  if (name == "fused-core")
    return options.device().is_cpu();
  return name == "fused" && TORCH_VERSION_MAJOR < 2 && options.device().is_cpu();
}

// Keys each query sees on average: n (none masked), about n / 2 (causal), or, with a sliding
// window W, (W (W + 1) / 2 + (n - W) W) / n.
double keys_per_query(const BenchConfig& c) {
  if (c.masked_keys_per_query >= 0)
    return c.masked_keys_per_query;
  const double n = c.tokens;
  if (!c.causal)
    return n;
  if (c.window == 0 || c.window >= c.tokens)
    return 0.5 * n;
  const double w = c.window;
  return (w * (w + 1) / 2 + (n - w) * w) / n;
}

}  // namespace

Flops model_flops(const BenchConfig& c, const std::string& name) {
  const double b = c.batch, n = c.tokens, d = c.d_model;
  // QKV + out projection
  const double gemms = is_core_only(name) ? 0.0 : 6 * b * n * d * d + 2 * b * n * d * d;
  const double core = 4 * b * n * keys_per_query(c) * d * c.layers;
  return {gemms + core, 3 * gemms + 3.5 * core};  // backward: 2x GEMMs, 2.5x the core
}

Flops executed_flops(const BenchConfig& c, const std::string& name,
                     const torch::TensorOptions& options) {
  const double b = c.batch, n = c.tokens, d = c.d_model;
  const double gemms = is_core_only(name) ? 0.0 : 8 * b * n * d * d;
  const bool skips_masked_keys =
      name == "chunked" || name == "chunked-core" || runs_attnkit_fused_kernel(name, options);
  // Those skip the masked keys (to block granularity: counted as exact), the others do not.
  const double core = 4 * b * n * d * (skips_masked_keys ? keys_per_query(c) : n) * c.layers;
  return {gemms + core, 3 * gemms + 3.5 * core};
}

}  // namespace attnkit::bench
