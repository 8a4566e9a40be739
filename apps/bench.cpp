// attnkit-bench: how fast each multi-head attention implementation is, forward and
// forward+backward, against the machine's own sgemm. The C++ counterpart of the
// efficient-MHA comparison of the LLMs-from-scratch material.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "attnkit/attnkit.h"
#include "bench_problem.h"
#include "command_line.h"
#include "train/line.h"
#include "train/mixed_precision.h"

using attnkit::bench::BenchConfig;
using attnkit::bench::executed_flops;
using attnkit::bench::Flops;
using attnkit::bench::is_core_only;
using attnkit::bench::make_mask;
using attnkit::bench::make_score;
using attnkit::bench::model_flops;
using attnkit::bench::parse_mask;
using attnkit::bench::report_precision;
using attnkit::train::Line;

namespace {

using Clock = std::chrono::steady_clock;

const std::vector<std::string> kImplementations{
    "wrapper",   "mha",          "combined",  "einsum",
    "fused",     "chunked",      "torch-mha", "torch-mha-noweights",
    "math-core", "chunked-core", "fused-core"};

// The implementations that take a sliding window (--window).
const std::vector<std::string> kWindowed{"mha",       "combined",     "fused",     "chunked",
                                         "math-core", "chunked-core", "fused-core"};

c10::optional<int64_t> window_of(const BenchConfig& c) {
  return c.window > 0 ? c10::optional<int64_t>(c.window) : c10::nullopt;
}

// ---- memory: the process's peak RSS, reset before each measurement (Linux) ---------------

void reset_peak_rss() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) {
      return std::stod(line.substr(6)) / 1024.0;  // kB -> MB
    }
  }
  return -1.0;
}

double sgemm_gflops(const torch::TensorOptions& options) {
  const int64_t size = 1024;
  const auto a = torch::randn({size, size}, options);
  const auto b = torch::randn({size, size}, options);
  std::vector<double> seconds;
  for (int i = 0; i < 7; ++i) {
    const auto start = Clock::now();
    auto c = torch::mm(a, b);
    if (c.is_cuda())
      torch::cuda::synchronize();
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return 2.0 * size * size * size / seconds[seconds.size() / 2] / 1e9;
}

// ---- implementations ------------------------------------------------------------------

struct Implementation {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

Implementation make_implementation(const std::string& name, const BenchConfig& c,
                                   const torch::TensorOptions& options) {
  const auto d = c.d_model, h = c.heads, n = c.tokens;
  auto mha_options = attnkit::MultiHeadAttentionOptions(d, d, n, 0.0, h)
                         .causal(c.causal)
                         .sliding_window_size(window_of(c))
                         .query_block_size(c.chunk_size)
                         .key_block_size(c.key_chunk_size);
  Implementation impl;
  if (name == "wrapper") {
    TORCH_CHECK(c.causal, "--only wrapper: the CausalAttention wrapper is always causal");
    attnkit::MultiHeadAttentionWrapper m(d, d / h, n, 0.0, h);
    impl = {m.ptr(), [m](const torch::Tensor& x) mutable { return m(x); }};
  } else if (name == "mha" || name == "fused" || name == "chunked" || name == "einsum") {
    mha_options.backend(name == "fused"     ? attnkit::AttentionBackend::kFused
                        : name == "chunked" ? attnkit::AttentionBackend::kChunked
                                            : attnkit::AttentionBackend::kMath);
    attnkit::MultiHeadAttention m(mha_options);
    if (name == "einsum") {
      // The same parameters in einsum notation, as in the efficient-MHA comparison.
      const bool causal = c.causal;
      impl = {
          m.ptr(), [m, h, causal](const torch::Tensor& x) mutable {
            const auto project = [&](const torch::nn::Linear& linear) {
              const auto y = torch::einsum("bnd,od->bno", {x, linear->weight});  // (b, n, d)
              // (b, n, d) -> (b, n, h, hd) -> (b, h, n, hd)
              return y.view({y.size(0), y.size(1), h, -1}).transpose(1, 2);
            };
            const auto q = project(m->W_query);
            const auto k = project(m->W_key);
            const auto v = project(m->W_value);
            auto scores = torch::einsum("bhnd,bhmd->bhnm", {q, k}) / std::sqrt(double(q.size(-1)));
            if (causal) {
              scores = scores.masked_fill(
                  attnkit::functional::causal_mask(q.size(2), k.size(2), x.device()),
                  -std::numeric_limits<double>::infinity());
            }
            const auto context = torch::einsum("bhnm,bhmd->bhnd", {torch::softmax(scores, -1), v});
            // (b, h, n, hd) -> (b, n, h * hd)
            const auto merged = context.transpose(1, 2).reshape({x.size(0), x.size(1), -1});
            return m->out_proj(merged);
          }};
    } else {
      impl = {m.ptr(), [m](const torch::Tensor& x) mutable { return m(x); }};
    }
  } else if (is_core_only(name) && (c.mask != "module" || c.score != "none" || c.layers > 1 ||
                                    !options.device().is_cpu())) {
    // x (b, n, d) viewed as (b, h, n, hd) serves as query, key and value; with --layers L,
    // L calls in a row, each on the last one's output. Off the CPU, fused-core is the fused
    // backend demanded (the loop-nest kernel is the CPU's).
    namespace F = attnkit::functional;
    const auto mask = make_mask(c, options.device());
    const bool per_step = c.block_mask == "per-step" && !mask.is_none();
    const int64_t layers = c.layers, chunk_size = c.chunk_size;
    const auto attention_options =
        F::AttentionOptions()
            .score_mod(make_score(c))
            .backend(name == "math-core"    ? attnkit::AttentionBackend::kMath
                     : name == "fused-core" ? attnkit::AttentionBackend::kFused
                                            : attnkit::AttentionBackend::kChunked)
            .query_block_size(c.chunk_size)
            .key_block_size(c.key_chunk_size);
    impl = {std::make_shared<torch::nn::Module>(), [=](const torch::Tensor& x) {
              auto step = attention_options;
              if (per_step) {  // judged once, read by every layer
                step.block_mask(attnkit::create_block_mask(
                    mask, x.size(0), 1, x.size(1), x.size(1),
                    attnkit::BlockMaskOptions().block_size(chunk_size).device(x.device())));
              } else {
                step.mask(mask);
              }
              // (b, n, d) -> (b, n, h, hd) -> (b, h, n, hd)
              auto heads = x.view({x.size(0), x.size(1), h, -1}).transpose(1, 2);
              for (int64_t layer = 1; layer < layers; ++layer) {
                // (b, h, n, hd) -> (b, n, h, hd) -> (b, h, n, hd): the next layer's input
                heads = F::attention(heads, heads, heads, step)
                            .transpose(1, 2)
                            .contiguous()
                            .transpose(1, 2);
              }
              return F::attention(heads, heads, heads, step);
            }};
  } else if (is_core_only(name)) {
    // x (b, n, d) viewed as (b, h, n, hd) serves as query, key and value.
    namespace F = attnkit::functional;
    const bool causal = c.causal;
    const auto window = window_of(c);
    attnkit::Mask mask;
    if (causal)
      mask = window ? attnkit::Mask::causal().sliding_window(*window) : attnkit::Mask::causal();
    const auto core = F::AttentionOptions()
                          .mask(mask)
                          .query_block_size(c.chunk_size)
                          .key_block_size(c.key_chunk_size)
                          .backend(name == "chunked-core" ? attnkit::AttentionBackend::kChunked
                                                          : attnkit::AttentionBackend::kMath);
    impl = {std::make_shared<torch::nn::Module>(), [=](const torch::Tensor& x) {
              // (b, n, d) -> (b, n, h, hd) -> (b, h, n, hd)
              const auto heads = x.view({x.size(0), x.size(1), h, -1}).transpose(1, 2);
              if (name == "fused-core") {
                // The loop-nest kernel itself, on any LibTorch and at any size, by its name.
                return F::attention(heads, heads, heads,
                                    F::AttentionOptions(core).kernel("loop_nest"));
              }
              return F::attention(heads, heads, heads, core);
            }};
  } else if (name == "combined") {
    attnkit::MultiHeadAttentionCombinedQKV m(mha_options);
    impl = {m.ptr(), [m](const torch::Tensor& x) mutable { return m(x); }};
  } else {
    const bool need_weights = name == "torch-mha";
    torch::nn::MultiheadAttention m(torch::nn::MultiheadAttentionOptions(d, h).bias(false));
    const bool causal = c.causal;
    impl = {m.ptr(), [m, need_weights, causal](const torch::Tensor& x) mutable {
              const auto seq_first = x.transpose(0, 1);  // (b, n, d) -> (n, b, d)
              torch::Tensor mask;
              if (causal) {
                mask = attnkit::functional::causal_mask(x.size(1), x.size(1), x.device());
              }
              const auto out = std::get<0>(m->forward(seq_first, seq_first, seq_first,
                                                      /*key_padding_mask=*/{}, need_weights, mask));
              return out.transpose(0, 1);  // (n, b, d) -> (b, n, d)
            }};
  }
  impl.module->to(options.device(), options.dtype().toScalarType());
  return impl;
}

struct Result {
  std::string name;
  std::string pass;
  double median_ms, min_ms, max_ms;
  double model_gflops, executed_gflops, sgemm_fraction, peak_memory_mb;
  std::string kernels;  // the attention kernels that the planner ran in one pass, in order
};

Result measure(const std::string& name, bool backward, const BenchConfig& c,
               const torch::TensorOptions& options, double sgemm) {
  auto impl = make_implementation(name, c, options);
  impl.module->train(backward);  // dropout is 0 anyway; eval for the forward pass
  const auto x = torch::randn({c.batch, c.tokens, c.d_model}, options).requires_grad_(backward);
  const auto run_once = [&] {
    if (backward) {
      impl.module->zero_grad();
      impl.forward(x).sum().backward();
    } else {
      torch::NoGradGuard no_grad;
      impl.forward(x);
    }
    if (x.is_cuda())
      torch::cuda::synchronize();
  };
  if (x.is_cuda())
    torch::cuda::synchronize();
  reset_peak_rss();
  // The first run, warm-up or timed, records which kernels ran (a few pushes to a vector).
  std::string kernels;
  const auto run_recorded = [&](bool first) {
    if (!first)
      return run_once();
    attnkit::functional::KernelRecord record;
    run_once();
    for (const auto& run : record.runs())
      kernels += (kernels.empty() ? "" : ",") + run.kernel;
  };
  for (int64_t i = 0; i < c.warmup; ++i)
    run_recorded(i == 0);
  std::vector<double> ms;
  for (int64_t i = 0; i < c.repeats; ++i) {
    const auto start = Clock::now();
    run_recorded(c.warmup == 0 && i == 0);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median =
      ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  const auto model = model_flops(c, name);
  const auto executed = executed_flops(c, name, options);
  const double model_gflops = (backward ? model.forward_backward : model.forward) / median / 1e6;
  const double executed_gflops =
      (backward ? executed.forward_backward : executed.forward) / median / 1e6;
  return {name,
          backward ? "forward+backward" : "forward",
          median,
          ms.front(),
          ms.back(),
          model_gflops,
          executed_gflops,
          model_gflops / sgemm,
          x.is_cuda() ? -1.0 : peak_rss_mb(),
          kernels};
}

void print_table(const std::vector<Result>& results) {
  Line(std::cout) << std::left << std::setw(21) << "implementation" << std::setw(18) << "pass"
                  << std::right << std::setw(11) << "median ms" << std::setw(10) << "min ms"
                  << std::setw(10) << "max ms" << std::setw(12) << "model GF/s" << std::setw(11)
                  << "exec GF/s" << std::setw(9) << "% sgemm" << std::setw(11) << "peak MB"
                  << "\n";
  for (const auto& r : results) {
    Line(std::cout) << std::left << std::setw(21) << r.name << std::setw(18) << r.pass << std::right
                    << std::fixed << std::setprecision(1) << std::setw(11) << r.median_ms
                    << std::setw(10) << r.min_ms << std::setw(10) << r.max_ms << std::setw(12)
                    << r.model_gflops << std::setw(11) << r.executed_gflops << std::setw(9)
                    << 100 * r.sgemm_fraction << std::setw(11) << std::setprecision(0)
                    << r.peak_memory_mb << "\n";
  }
  // Which of the planner's kernels each implementation ran (functional::KernelRecord).
  Line line(std::cout);
  line << "kernels:";
  for (size_t i = 0; i < results.size(); i += 2)
    line << " " << results[i].name << "="
         << (results[i].kernels.empty() ? "-" : results[i].kernels);
  line << "\n";
}

// The median time of one create_block_mask of --mask for (b, 1, n, n) (the mask itself is
// made outside the timed region).
double block_mask_build_ms(const BenchConfig& c, const torch::Device& device) {
  const auto mask = make_mask(c, device);
  std::vector<double> ms;
  for (int64_t i = 0; i < c.repeats; ++i) {
    const auto start = Clock::now();
    attnkit::create_block_mask(mask, c.batch, 1, c.tokens, c.tokens,
                               attnkit::BlockMaskOptions().block_size(c.chunk_size).device(device));
    if (device.is_cuda())
      torch::cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void write_json(const std::string& path, const BenchConfig& c, double sgemm,
                const std::vector<Result>& results, double block_mask_ms) {
  // Flushed, checked and renamed: a full disk is an error, not a cut file.
  attnkit::write_atomically(path, "--json:", [&](std::ostream& out) {
    out << std::setprecision(6) << "{\"config\": {\"batch\": " << c.batch
        << ", \"tokens\": " << c.tokens << ", \"d_model\": " << c.d_model
        << ", \"heads\": " << c.heads << ", \"causal\": " << (c.causal ? "true" : "false")
        << ", \"window\": " << c.window << ", \"mask\": \"" << c.mask << "\", \"score\": \""
        << c.score << "\", \"device\": \"" << c.device << "\", \"dtype\": \"" << c.dtype
        << "\", \"threads\": " << torch::get_num_threads() << ", \"blas\": \""
        << attnkit::blas_threads().name
        << "\", \"blas_threads\": " << attnkit::blas_threads().num_threads
        << ", \"repeats\": " << c.repeats << ", \"chunk_size\": " << c.chunk_size
        << ", \"key_chunk_size\": " << c.key_chunk_size << ", \"layers\": " << c.layers
        << ", \"block_mask\": \"" << c.block_mask << "\", \"language\": \"C++\", \"torch\": \""
        << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "." << TORCH_VERSION_PATCH
        << "\"}, \"sgemm_gflops\": " << sgemm << ", \"block_mask_build_ms\": " << block_mask_ms
        << ", \"results\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      out << (i ? ", " : "") << "{\"name\": \"" << r.name << "\", \"pass\": \"" << r.pass
          << "\", \"median_ms\": " << r.median_ms << ", \"min_ms\": " << r.min_ms
          << ", \"max_ms\": " << r.max_ms << ", \"model_gflops\": " << r.model_gflops
          << ", \"executed_gflops\": " << r.executed_gflops
          << ", \"sgemm_fraction\": " << r.sgemm_fraction
          << ", \"peak_memory_mb\": " << r.peak_memory_mb << ", \"kernels\": \"" << r.kernels
          << "\"}";
    }
    out << "]}\n";
  });
}

int fail(const std::string& message) {
  Line(std::cerr) << "attnkit-bench: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  BenchConfig c;
  attnkit::cli::CommandLine cli(
      "attnkit-bench",
      "Time each multi-head attention implementation, forward and forward+backward.\n"
      "FLOPs: QKV 6*b*n*d^2, out 2*b*n*d^2, core 4*b*n^2*d (halved when causal: model FLOPs; "
      "not halved for paths that compute the masked half: executed FLOPs); backward 2x "
      "forward for the GEMMs, 2.5x for the core. math-core, chunked-core and fused-core time the "
      "attention core alone (functional::attention with the math and chunked backends, and "
      "attnkit's loop-nest kernel; on CUDA fused-core is functional::attention with the fused "
      "backend demanded) on x viewed as (b, h, n, hd): no projections, core FLOPs only. "
      "With "
      "--window W the core counts the keys each query sees (about W each; executed FLOPs "
      "only for chunked and the fused kernel, which skip the keys outside the window).");
  std::string names;
  for (const auto& n : kImplementations)
    names += (names.empty() ? "" : ", ") + n;
  cli.value("Shape", "batch", "b", "8")
      .value("Shape", "tokens", "n", "1024")
      .value("Shape", "d-model", "d", "768")
      .value("Shape", "heads", "h", "12")
      .value("Shape", "causal", "causal mask (--causal=false for none)", "true", "true")
      .value("Shape", "window",
             "sliding window W: each query sees itself and the W - 1 keys before it (causal; "
             "mha, combined, fused, chunked and the cores); 0 = none",
             "0");
  cli.value("Shape", "mask",
            "the core implementations' attnkit::Mask: module (--causal, --window), "
            "documents:K (K documents per row; causal with --causal), padded (key padding, "
            "lengths uniform in 128..n; causal with --causal), causal-mod (a mask_mod); "
            "KIND-dense: the same as a bool tensor",
            "module")
      .value("Shape", "score", "the core implementations' score function: none, alibi, softcap",
             "none")
      .value("Shape", "layers",
             "the core implementations run L attention calls per step, each on the last one's "
             "output (a model's stack of layers)",
             "1")
      .value("Shape", "block-mask",
             "who judges --mask: per-call (each call, from the mask) or per-step (one "
             "create_block_mask per step, read by every layer); the median time of one "
             "create_block_mask is printed too",
             "per-call");
  cli.value("Implementations", "only", "comma-separated subset of: " + names)
      .value("Implementations", "chunk-size", "query tokens per block of chunked",
             std::to_string(c.chunk_size))
      .value("Implementations", "key-chunk-size", "key tokens per block of chunked",
             std::to_string(c.key_chunk_size));
  cli.value("Run", "device", "cpu | cuda | cuda:N", "cpu")
      .value("Run", "dtype", "float32 | float64 | bfloat16 | float16", "float32")
      .value("Run", "threads", "CPU threads, for LibTorch and its BLAS; 0 = their defaults", "0")
      .value("Run", "repeats", "timed runs per measurement (the median is reported)", "5")
      .value("Run", "warmup", "untimed runs first", "1");
  cli.flag("Run", "precision",
           "instead of timing: each backend's largest error against float64 (output and the "
           "q, k, v gradients) for --mask and --score at --dtype, and as a multiple of the "
           "float32 floor (float32 arithmetic rounded once to --dtype); --d-model / --heads "
           "is the head width");
  cli.value("Output", "json", "also write the results as JSON to FILE")
      .flag("Output", "h,help", "show this help");
  cli.example("attnkit-bench --tokens 1024 --only mha,chunked --json bench.json",
              "the book's MHA against the chunked backend at n = 1024, results also as JSON")
      .example(
          "attnkit-bench --batch 64 --tokens 16 --d-model 64 --heads 4 --only math-core,fused-core",
          "the attention core alone at attnkit-train's toy size")
      .example(
          "attnkit-bench --precision --dtype bfloat16 --batch 1 --heads 2 --d-model 128 "
          "--tokens 4096 --mask padded",
          "bfloat16 errors of every backend against float64, and over the float32 floor");
  try {
    cli.parse(argc, argv);
    if (cli.given("help")) {
      Line(std::cout) << cli.help() << "\n";
      return 0;
    }
    c.batch = cli.integer("batch");
    c.tokens = cli.integer("tokens");
    c.d_model = cli.integer("d-model");
    c.heads = cli.integer("heads");
    c.causal = cli.boolean("causal");
    c.window = cli.integer("window");
    c.device = cli.text("device");
    c.dtype = cli.text("dtype");
    c.threads = cli.integer("threads");
    c.repeats = cli.integer("repeats");
    c.warmup = cli.integer("warmup");
    c.chunk_size = cli.integer("chunk-size");
    c.key_chunk_size = cli.integer("key-chunk-size");
    c.json = cli.text("json");
    c.mask = cli.text("mask");
    c.score = cli.text("score");
    c.layers = cli.integer("layers");
    c.block_mask = cli.text("block-mask");
    c.precision = cli.given("precision");
    std::stringstream only(cli.text("only"));
    for (std::string item; std::getline(only, item, ',');) {
      if (std::find(kImplementations.begin(), kImplementations.end(), item) ==
          kImplementations.end()) {
        return fail("--only: unknown implementation '" + item + "'; expected " + names);
      }
      c.only.push_back(item);
    }
  } catch (const attnkit::cli::UsageError& e) {
    return fail(e.what());
  }
  if (c.batch < 1 || c.tokens < 1 || c.d_model < 1 || c.heads < 1 || c.repeats < 1 ||
      c.chunk_size < 1 || c.key_chunk_size < 1 || c.warmup < 0 || c.threads < 0) {
    return fail(
        "--batch, --tokens, --d-model, --heads, --repeats, --chunk-size and --key-chunk-size "
        "must be >= 1, --warmup and --threads >= 0");
  }
  if (c.layers < 1)
    return fail("--layers: expected >= 1, got " + std::to_string(c.layers));
  if (c.block_mask != "per-call" && c.block_mask != "per-step")
    return fail("--block-mask: expected per-call or per-step, got '" + c.block_mask + "'");
  if (c.window < 0 || (c.window > 0 && !c.causal)) {
    return fail("--window: expected >= 1 with --causal=true (0 = no window), got " +
                std::to_string(c.window) + (c.causal ? "" : " with --causal=false"));
  }
  if (c.window > 0) {
    if (c.only.empty())
      c.only = kWindowed;
    for (const auto& name : c.only) {
      if (std::find(kWindowed.begin(), kWindowed.end(), name) == kWindowed.end()) {
        return fail("--window: implementation '" + name +
                    "' has no sliding window; expected mha, combined, fused, chunked, math-core, "
                    "chunked-core or fused-core");
      }
    }
  }
  try {
    parse_mask(c);
    make_score(c);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  }
  if (c.mask != "module" || c.score != "none" || c.layers > 1) {
    if (c.only.empty())
      c.only = {"math-core", "chunked-core"};
    for (const auto& name : c.only) {
      if (!is_core_only(name))
        return fail("--mask/--score/--layers: implementation '" + name +
                    "' takes no mask, score function or stack of layers; expected math-core, "
                    "chunked-core or fused-core");
    }
  }
  if (c.d_model % c.heads != 0) {
    return fail("--d-model " + std::to_string(c.d_model) + " must be divisible by --heads " +
                std::to_string(c.heads));
  }
  const std::map<std::string, torch::ScalarType> dtypes{{"float32", torch::kFloat32},
                                                        {"float64", torch::kFloat64},
                                                        {"bfloat16", torch::kBFloat16},
                                                        {"float16", torch::kFloat16}};
  if (!dtypes.count(c.dtype)) {
    return fail("--dtype: expected float32, float64, bfloat16 or float16, got '" + c.dtype + "'");
  }
  try {
    const torch::Device device(c.device);
    if (device.is_cuda() && !torch::cuda::is_available()) {
      return fail("--device " + c.device + ": CUDA is not available; use --device cpu");
    }
    attnkit::train::check_dtype_runs_on(dtypes.at(c.dtype), device);
    if (c.threads > 0)
      attnkit::set_num_threads(static_cast<int>(c.threads));
    const auto tensor_options = torch::dtype(dtypes.at(c.dtype)).device(device);
    torch::manual_seed(0);
    if (c.precision) {
      Line(std::cout) << "attnkit-bench --precision: b=" << c.batch << " h=" << c.heads
                      << " n=" << c.tokens << " hd=" << c.d_model / c.heads << " mask=" << c.mask
                      << (c.causal ? " (causal)" : "") << " score=" << c.score << ", " << c.dtype
                      << " on " << c.device << ", LibTorch " << TORCH_VERSION_MAJOR << "."
                      << TORCH_VERSION_MINOR << "\n";
      report_precision(c, tensor_options);
      return 0;
    }
    const double sgemm = sgemm_gflops(tensor_options);
    if (c.mask != "module") {
      // Keys each query sees, for the FLOP counts: the mask's dense form, counted once.
      // dense() keeps a batch dimension of 1 when the mask is the same for every row.
      c.masked_keys_per_query = make_mask(c, device)
                                    .dense(c.batch, 1, c.tokens, c.tokens, device)
                                    .expand({c.batch, 1, c.tokens, c.tokens})
                                    .sum()
                                    .item<double>() /
                                double(c.batch * c.tokens);
    }
    Line(std::cout) << "attnkit-bench: b=" << c.batch << " n=" << c.tokens << " d=" << c.d_model
                    << " h=" << c.heads << (c.causal ? " causal" : " not causal")
                    << (c.window > 0 ? " window=" + std::to_string(c.window) : "")
                    << (c.mask != "module" ? " mask=" + c.mask : "")
                    << (c.score != "none" ? " score=" + c.score : "") << ", " << c.dtype << " on "
                    << c.device << ", " << torch::get_num_threads() << " threads ("
                    << attnkit::blas_threads() << "); " << c.repeats << " timed runs after "
                    << c.warmup << " warm-up\n"
                    << std::fixed << std::setprecision(1)
                    << "matmul 1024x1024 on this machine: " << sgemm << " GFLOP/s\n";
    std::vector<Result> results;
    for (const auto& name : c.only.empty() ? kImplementations : c.only) {
      if (name == "wrapper" && !c.causal)
        continue;  // the wrapper's heads are always causal
      for (const bool backward : {false, true}) {
        results.push_back(measure(name, backward, c, tensor_options, sgemm));
      }
    }
    print_table(results);
    const double block_mask_ms = c.mask != "module" ? block_mask_build_ms(c, device) : -1.0;
    if (block_mask_ms >= 0) {
      Line(std::cout) << std::fixed << std::setprecision(2)
                      << "create_block_mask of --mask for (b, 1, n, n), blocks of --chunk-size: "
                      << block_mask_ms << " ms (median of " << c.repeats << ")\n";
    }
    if (!c.json.empty())
      write_json(c.json, c, sgemm, results, block_mask_ms);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  }
  return 0;
}
