// A run's configuration: defaults resolved and every flag checked before training starts,
// the startup table, what the ranks of a run must agree on, the device, and the model's
// config with the run's memory check (trainer.h).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>

#include "attnkit/memory_budget.h"
#include "attnkit/threads.h"
#include "checkpoint.h"
#include "core/base/checks.h"
#include "io/file_io.h"
#include "line.h"
#include "mixed_precision.h"
#include "run_output.h"
#include "trainer.h"

namespace attnkit::train {

namespace {

// The longest context attnkit-train builds a model for.
constexpr int64_t kMaxContext = 1024;

int64_t default_steps(const std::string& task) {
  // Measured on 2 cores: every generated task is at 100% held-out accuracy well before
  // 600 steps; text starts to overfit its 18 kB of training bytes after about 500.
  return task == "text" ? 500 : 600;
}

}  // namespace

// Checkpoints written before --rope and --qk-norm existed lack them; restore_checkpoint reads
// a missing yes/no setting as false.
CheckpointSettings checkpoint_settings(const TrainConfig& c) {
  const auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
  return {{"task", c.task},
          {"seq-len", std::to_string(c.seq_len)},
          {"module", c.model.module},
          {"d-model", std::to_string(c.model.d_model)},
          {"heads", std::to_string(c.model.heads)},
          {"layers", std::to_string(c.model.layers)},
          {"ffn", yes_no(c.model.ffn)},
          {"kv-groups", std::to_string(c.model.kv_groups)},
          {"window", std::to_string(c.model.window)},
          {"latent-dim", std::to_string(c.model.latent_dim)},
          {"rope", yes_no(c.model.rope)},
          {"qk-norm", yes_no(c.model.qk_norm)}};
}

CheckpointSettings data_settings(const TrainConfig& c) {
  return {{"data", c.data}, {"pack", c.pack ? "true" : "false"}, {"seed", std::to_string(c.seed)}};
}

torch::Device resolve_device(const std::string& device) {
  if (device == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  }
  if (device == "cpu")
    return torch::kCPU;
  const bool cuda = device == "cuda" || device.rfind("cuda:", 0) == 0;
  TORCH_CHECK(cuda, "--device: expected auto, cpu, cuda or cuda:N, got '", device, "'");
  TORCH_CHECK(torch::cuda::is_available(), "--device ", device,
              ": CUDA is not available (no GPU visible, or LibTorch built without CUDA); use "
              "--device cpu");
  if (device == "cuda")
    return torch::Device(torch::kCUDA);
  const auto index_text = device.substr(5);
  char* end = nullptr;
  const long index = std::strtol(index_text.c_str(), &end, 10);
  TORCH_CHECK(!index_text.empty() && *end == '\0' && index >= 0 &&
                  index < static_cast<long>(torch::cuda::device_count()),
              "--device ", device, ": expected cuda:0..cuda:", torch::cuda::device_count() - 1);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

namespace {

// Fails now, not after minutes of training, when an output file cannot be created.
void check_writable(const char* flag, const std::string& path) {
  if (path.empty())
    return;
  attnkit::detail::check_not_directory(flag, path);
  const std::string probe = attnkit::detail::temporary_path(path);
  const bool existed = std::ifstream(probe).good();
  const bool writable = std::ofstream(probe, std::ios::app).good();
  if (!existed)
    std::remove(probe.c_str());
  TORCH_CHECK(writable, flag, ": cannot write '", path, "' (does its directory exist?)");
}

// A checkpoint is a file to resume from, in PyTorch's zip format: a FIFO or a device (which a
// write would fill directly) cannot be one, and a .safetensors name would promise another format.
void check_checkpoint_path(const std::string& path) {
  if (path.empty())
    return;
  std::error_code error;
  const auto status = std::filesystem::status(attnkit::detail::write_destination(path), error);
  TORCH_CHECK(!std::filesystem::exists(status) || std::filesystem::is_regular_file(status) ||
                  std::filesystem::is_directory(status),
              "--save: '", path,
              "' is not a regular file (a device, a FIFO or a socket); a "
              "checkpoint is a file to resume from");
  const std::string extension = ".safetensors";
  TORCH_CHECK(path.size() < extension.size() ||
                  path.compare(path.size() - extension.size(), extension.size(), extension) != 0,
              "--save: '", path,
              "' names a safetensors file, but a checkpoint is PyTorch's zip "
              "format (the optimizer and the run's state besides the weights); name it e.g. "
              "run.pt");
}

}  // namespace

TrainConfig resolve(TrainConfig c) {
  if (c.model.backend.empty() && has_backends_and_kv_cache(c.model.module))
    c.model.backend = "fused";
  if (c.seq_len == 0)
    c.seq_len = default_task_length(c.task);
  if (c.model.layers == 0)
    c.model.layers = (c.task == "recall" || c.task == "text") ? 2 : 1;
  if (c.steps == 0)
    c.steps = default_steps(c.task);
  if (c.eval_every == 0)
    c.eval_every = std::max<int64_t>(1, c.steps / 10);
  TORCH_CHECK(c.steps >= 1, "--steps: expected >= 1, got ", c.steps);
  TORCH_CHECK(c.batch_size >= 1, "--batch-size: expected >= 1, got ", c.batch_size);
  TORCH_CHECK(c.lr > 0 && std::isfinite(c.lr), "--lr: expected a positive number, got ", c.lr);
  // The optimizer computes in float32: a larger rate would overflow there.
  TORCH_CHECK(c.lr <= std::numeric_limits<float>::max(), "--lr: expected at most ",
              std::numeric_limits<float>::max(), " (float32's largest value), got ", c.lr);
  TORCH_CHECK(c.weight_decay >= 0, "--weight-decay: expected >= 0, got ", c.weight_decay);
  TORCH_CHECK(c.threads >= 0, "--threads: expected >= 0 (0 = the usable cores), got ", c.threads);
  // More threads than cores only slow a step down (they spin in OpenMP), by 100x at 64 on 2.
  TORCH_CHECK(c.threads <= usable_cores(), "--threads ", c.threads, ": this process may use ",
              usable_cores(), " cores; expected 0..", usable_cores(), " (0 = all of them)");
  TORCH_CHECK(c.eval_every >= 1, "--eval-every: expected >= 1, got ", c.eval_every);
  TORCH_CHECK(c.memory_budget_gb >= 0 && c.memory_budget_gb <= 1e9,
              "--memory-budget: expected GB in 0..1e9 (0 = half of physical memory), got ",
              c.memory_budget_gb);
  TORCH_CHECK(c.bucket_mb >= 0 && std::isfinite(c.bucket_mb),
              "--bucket-mb: expected >= 0 (0 = one allreduce after backward), got ", c.bucket_mb);
  TORCH_CHECK(c.context_parallel >= 1, "--context-parallel: expected >= 1 (1 = none), got ",
              c.context_parallel);
  if (c.context_parallel > 1) {
    TORCH_CHECK(takes_masks(c.model.module), "--context-parallel: --module ", c.model.module,
                " does not run context-parallel; use mha, mha-combined, gqa, mqa or mla");
    TORCH_CHECK(c.model.dropout == 0.0,
                "--context-parallel: attention dropout is not offered "
                "(the split calls' backward cannot redraw it); expected --dropout 0, got ",
                c.model.dropout);
  }
  TORCH_CHECK(c.sample >= 0, "--sample: expected >= 0, got ", c.sample);
  TORCH_CHECK(!c.pack || c.task == "text",
              "--pack: only the text task has documents to pack, got --task ", c.task);
  TORCH_CHECK(!c.pack || takes_masks(c.model.module), "--pack: --module ", c.model.module,
              " takes no mask, so it cannot keep packed documents apart; use mha, mha-combined, "
              "gqa, mqa or mla");
  TORCH_CHECK(c.sample == 0 || c.task == "text",
              "--sample: only the text task generates, got --task ", c.task);
  TORCH_CHECK(c.sample == 0 || !c.kv_cache || has_backends_and_kv_cache(c.model.module),
              "--sample with --module ", c.model.module,
              ": only mha, mha-combined, gqa, mqa and mla have a KV cache; add --no-kv-cache");
  if (!c.prompts.empty()) {
    TORCH_CHECK(c.sample > 0, "--prompts: give --sample N, the bytes to generate for each line");
    TORCH_CHECK(c.kv_cache,
                "--prompts: the lines are decoded together with KV caches; drop "
                "--no-kv-cache");
    read_prompts(c.prompts);  // fails now, not after training, on a file it cannot use
  }
  TORCH_CHECK(c.dump_attention.empty() || ends_with(c.dump_attention, ".png"),
              "--dump-attention: expected a file name ending in .png, got '", c.dump_attention,
              "'");
  const auto device = resolve_device(c.device);  // fails early for cuda without CUDA
  const auto dtype = parse_train_dtype(c.dtype);
  check_dtype_runs_on(dtype, device);
  TORCH_CHECK(!c.autocast || dtype != torch::kFloat,
              "--autocast: give the dtype it runs in, --dtype bfloat16 or float16 (got --dtype ",
              c.dtype, ")");
  // One process; a launched rank chooses again knowing its machine's ranks (apps/train.cpp).
  c.dist_backend = choose_dist_backend(c.dist_backend, device, RankEnvironment{});
  check_backend_serves(c.dist_backend, device);
  TORCH_CHECK(c.context_parallel == 1 || device.is_cpu(), "--context-parallel: the split kernels ",
              "that compute each pair of shards run on the CPU; expected --device cpu, got ",
              device);
  check_checkpoint_path(c.save);
  check_writable("--save", c.save);
  check_writable("--metrics", c.metrics);
  check_writable("--dump-attention", c.dump_attention);
  return c;
}

void print_config_table(std::ostream& out, const TrainConfig& c, const Task& task) {
  const std::vector<std::pair<std::string, std::string>> rows{
      {"task", c.task + (task.causal() ? " (causal)" : " (bidirectional)") +
                   (c.pack ? ", packed documents" : "")},
      {"seq-len", std::to_string(c.seq_len) + " (" + std::to_string(task.input_length()) +
                      " tokens per sequence, vocab " + std::to_string(task.vocab_size()) + ")"},
      {"module",
       c.model.module + (c.model.backend.empty() ? "" : " (" + c.model.backend + " backend)") +
           (c.model.kv_groups > 0 ? ", kv-groups " + std::to_string(c.model.kv_groups) : "") +
           (c.model.window > 0 ? ", window " + std::to_string(c.model.window) : "") +
           (c.model.latent_dim > 0 ? ", latent-dim " + std::to_string(c.model.latent_dim) : "")},
      {"d-model / heads / layers", std::to_string(c.model.d_model) + " / " +
                                       std::to_string(c.model.heads) + " / " +
                                       std::to_string(c.model.layers)},
      {"ffn / dropout",
       std::string(c.model.ffn ? "yes" : "no") + " / " + c10::str(c.model.dropout)},
      {"steps / batch-size", std::to_string(c.steps) + " / " + std::to_string(c.batch_size)},
      {"lr / weight-decay", c10::str(c.lr) + " / " + c10::str(c.weight_decay)},
      {"dtype",
       c.dtype == "float32"
           ? std::string("float32")
           : (c.autocast ? c.dtype + " autocast (linear layers; attention computed in float32 "
                                     "inside); float32 weights, gradients and AdamW state"
                         : c.dtype + " forward and backward; float32 weights and AdamW state") +
                 (c.dtype == "float16" ? ", dynamic loss scaling" : "")},
      {"seed / device / threads",
       std::to_string(c.seed) + " / " + resolve_device(c.device).str() + " / " +
           std::to_string(c.threads > 0 ? c.threads : torch::get_num_threads()) +
           (c.threads > 0 ? "" : " (default)")},
      {"eval-every", std::to_string(c.eval_every)},
  };
  size_t width = 9;
  for (const auto& row : rows)
    width = std::max(width, row.first.size());
  Line table(out);  // the whole table in one write
  table << "| " << std::left << std::setw(static_cast<int>(width)) << "Parameter"
        << " | Value\n"
        << "|" << std::string(width + 2, '-') << "|" << std::string(40, '-') << "\n";
  for (const auto& [name, value] : rows) {
    table << "| " << std::setw(static_cast<int>(width)) << name << " | " << value << "\n";
  }
  table << std::right;
  if (c.task == "text") {
    table << std::fixed << std::setprecision(2) << "corpus " << c.data << ": unigram entropy "
          << task.unigram_entropy() << ", bigram entropy " << task.bigram_entropy()
          << " bits/byte on the held-out 10%\n";
  }
}

std::string rank_agreement_text(const TrainConfig& c) {
  // Everything that changes what a rank computes or writes; not --device (a rank's own GPU),
  // --threads (its machine's cores), nor how it prints.
  auto fields = checkpoint_settings(c);
  const std::vector<std::pair<std::string, std::string>> run{
      {"backend", c.model.backend},
      {"dropout", c10::str(c.model.dropout)},
      {"data", c.data},
      {"pack", c.pack ? "true" : "false"},
      {"sample", std::to_string(c.sample)},
      {"kv-cache", c.kv_cache ? "true" : "false"},
      {"prompts", c.prompts},
      {"steps", std::to_string(c.steps)},
      {"batch-size", std::to_string(c.batch_size)},
      {"lr", c10::str(c.lr)},
      {"weight-decay", c10::str(c.weight_decay)},
      {"seed", std::to_string(c.seed)},
      {"eval-every", std::to_string(c.eval_every)},
      {"save", c.save},
      {"resume", c.resume},
      {"metrics", c.metrics},
      {"dump-attention", c.dump_attention},
      {"dist-backend", c.dist_backend},
      {"bucket-mb", c10::str(c.bucket_mb)},
      {"context-parallel", std::to_string(c.context_parallel)},
      {"dtype", c.dtype},
      {"autocast", c.autocast ? "true" : "false"}};
  fields.insert(fields.end(), run.begin(), run.end());
  std::string text;
  for (const auto& [key, value] : fields)
    text += "--" + key + " " + value + "\n";
  return text;
}

void check_global_batch(int64_t batch_size, int data_ranks, int64_t context_parallel) {
  TORCH_CHECK(batch_size >= data_ranks, "--batch-size ", batch_size,
              " is the global batch and must give each of the ", data_ranks,
              context_parallel > 1 ? c10::str(" groups of ", context_parallel,
                                              " ranks (--context-parallel) that share a sequence")
                                   : std::string(" ranks"),
              " at least one sequence");
}

void check_context_parallel_ranks(int64_t context_parallel, int world_size) {
  TORCH_CHECK(world_size % context_parallel == 0, "--context-parallel ", context_parallel,
              ": the ranks form groups of ", context_parallel,
              " that share a sequence, so "
              "the number of ranks must be a multiple of it; got ",
              world_size, world_size == 1 ? " (start them with --nproc)" : "");
}

void check_context_parallel_length(const TrainConfig& config, int64_t input_length) {
  const auto chunks = 2 * config.context_parallel;
  TORCH_CHECK(input_length % chunks == 0, "--context-parallel ", config.context_parallel, ": task ",
              config.task, " with --seq-len ", config.seq_len, " has sequences of ", input_length,
              " tokens, which must divide into ", chunks,
              " equal chunks (zigzag shards); choose another --seq-len");
}

void check_dtype_ranks(const std::string& dtype, bool autocast, int world_size) {
  TORCH_CHECK(world_size == 1 || dtype == "float32" || autocast, "--dtype ", dtype, " with ",
              world_size,
              " ranks: the 16-bit working copy trains in one process; add --autocast (float32 "
              "weights, forward under LibTorch's autocast), or drop --dtype or --nproc");
}

ModelConfig model_config_of(const TrainConfig& config, const Task& task) {
  ModelConfig model_config = config.model;
  model_config.vocab_size = task.vocab_size();
  model_config.context_length = task.input_length();
  model_config.causal = task.causal();
  TORCH_CHECK(task.input_length() <= kMaxContext, "--seq-len ", config.seq_len, ": task ",
              config.task, " would need context_length ", task.input_length(), ", more than the ",
              kMaxContext, " attnkit-train allows");
  return model_config;
}

// Refuses, before the model is built, a run that could not fit attnkit's memory budget: a
// lower bound on what its first step holds at once, on this process. Every term undercounts
// (only the layers' query and output projections, four activations of (batch, n, d_model) a
// layer), so a run that fits is never refused; a run of 2,000,000 sequences or 100,000
// layers is, at once, where it used to grow for a minute and fail with LibTorch's message.
void check_run_memory(const TrainConfig& config, const ModelConfig& model, int world_size) {
  const double d = static_cast<double>(model.d_model);
  const double n = static_cast<double>(model.context_length);
  const double layers = static_cast<double>(model.layers);
  const double vocab = static_cast<double>(model.vocab_size);
  const double rows = std::ceil(static_cast<double>(config.batch_size) / world_size);
  const double parameters = layers * d * d * (2.0 + (model.ffn ? 8.0 : 0.0)) + 2.0 * vocab * d +
                            (model.rope ? 0.0 : n * d);
  // float32 weights, gradients and AdamW's two moments.
  const double weights = 16.0 * parameters;
  const double activations = 4.0 * rows * n * (4.0 * d * layers + 2.0 * vocab);
  // The book's modules and --backend math: (n, n) weights saved per layer and head, and
  // CausalAttention's (context, context) mask buffer per layer and head.
  double quadratic = 0.0;
  if (model.backend.empty() || model.backend == "math") {
    const double heads = model.module == "mha-wrapper" || model.backend == "math"
                             ? static_cast<double>(model.heads)
                             : 1.0;
    quadratic = 4.0 * rows * heads * n * n * layers;
    if (model.module == "causal" || model.module == "mha-wrapper")
      quadratic += 4.0 * n * n * layers * heads;
  }
  const bool weights_dominate = weights >= activations + quadratic;
  const std::string flags =
      weights_dominate ? c10::str("--layers ", model.layers, " --d-model ", model.d_model)
                       : c10::str("--batch-size ", config.batch_size, " --seq-len ", config.seq_len,
                                  " (context ", model.context_length, ") --layers ", model.layers,
                                  " --d-model ", model.d_model);
  detail::check_memory_budget(
      flags,
      c10::str("this run (weights, gradients and AdamW state ", detail::format_bytes(weights),
               "; a step's activations ", detail::format_bytes(activations + quadratic),
               "; both lower bounds)"),
      weights + activations + quadratic,
      c10::str(weights_dominate ? "use fewer --layers or a smaller --d-model"
                                : "use a smaller --batch-size, --seq-len, --layers or --d-model",
               quadratic > activations ? " (or a module with backends, which tile the scores)" : "",
               ", or raise the budget with --memory-budget GB"),
      "--memory-budget");
}

}  // namespace attnkit::train
