#include "trainer.h"

#include <fcntl.h>
#if AT_PARALLEL_OPENMP
#include <omp.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <thread>

#include "attnkit/threads.h"
#include "checkpoint.h"
#include "flat_adamw.h"
#include "gradient_sync.h"
#include "heatmap.h"
#include "line.h"
#include "mixed_precision.h"

namespace attnkit::train {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kMaxContext = 1024;

int64_t default_steps(const std::string& task) {
  // Measured on 2 cores: every generated task is at 100% held-out accuracy well before
  // 600 steps; text starts to overfit its 18 kB of training bytes after about 500.
  return task == "text" ? 500 : 600;
}

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The settings a checkpoint must share with the run that resumes it. Checkpoints written
// before --rope and --qk-norm existed lack them; restore_checkpoint reads a missing yes/no
// setting as false.
CheckpointSettings checkpoint_fields(const TrainConfig& c) {
  const auto yes_no = [](bool b) { return std::string(b ? "true" : "false"); };
  return {{"task", c.task},
          {"seq-len", std::to_string(c.seq_len)},
          {"module", c.module},
          {"d-model", std::to_string(c.d_model)},
          {"heads", std::to_string(c.heads)},
          {"layers", std::to_string(c.layers)},
          {"ffn", yes_no(c.ffn)},
          {"kv-groups", std::to_string(c.kv_groups)},
          {"window", std::to_string(c.window)},
          {"latent-dim", std::to_string(c.latent_dim)},
          {"rope", yes_no(c.rope)},
          {"qk-norm", yes_no(c.qk_norm)}};
}

// Masked next-token cross-entropy and the number of correct predictions.
struct BatchScore {
  torch::Tensor loss;  // scalar, mean over scored positions
  int64_t correct = 0;
  int64_t scored = 0;
};

BatchScore score(AttentionModel& model, const Batch& batch, const torch::Device& device,
                 bool count_correct) {
  // Unscored positions get a target cross_entropy ignores, which is cheaper than gathering
  // the scored rows with a boolean index (a nonzero, a gather and a scatter in backward).
  constexpr int64_t kIgnored = -100;
  const auto document_ids =
      batch.document_ids.defined() ? batch.document_ids.to(device) : torch::Tensor();
  const auto logits = model->forward(batch.inputs.to(device), document_ids);  // (b, n, vocab)
  const auto targets =
      batch.targets.masked_fill(batch.loss_mask.logical_not(), kIgnored).to(device);  // (b, n)
  namespace nnf = torch::nn::functional;
  // The loss in float32 whatever the model's dtype (--dtype): log-softmax over the vocabulary.
  BatchScore result{nnf::cross_entropy(logits.flatten(0, 1).to(torch::kFloat), targets.flatten(),
                                       nnf::CrossEntropyFuncOptions().ignore_index(kIgnored)),
                    0, batch.loss_mask.sum().item<int64_t>()};
  if (count_correct) {
    // An ignored target (-100) never equals an arg max.
    result.correct = logits.argmax(-1).eq(targets).sum().item<int64_t>();
  }
  return result;
}

// Rows [begin, end) of part `part` when `rows` rows are cut into `parts` contiguous parts
// whose sizes differ by at most one.
std::pair<int64_t, int64_t> part_rows(int64_t rows, int64_t part, int64_t parts) {
  return {rows * part / parts, rows * (part + 1) / parts};
}

// Part `part` of `parts` of a batch's rows (part_rows).
Batch part_of(const Batch& batch, int64_t part, int64_t parts) {
  if (parts == 1)
    return batch;
  const auto [begin, end] = part_rows(batch.inputs.size(0), part, parts);
  const auto& ids = batch.document_ids;
  return {batch.inputs.slice(0, begin, end), batch.targets.slice(0, begin, end),
          batch.loss_mask.slice(0, begin, end), ids.defined() ? ids.slice(0, begin, end) : ids};
}

// A training step's loss and its gradients (written to `gradients`, the optimizer's flat
// buffer) with the batch cut into `shares` parts, each run forward and backward on its own
// worker. Why: at toy sizes a batch's ops are too small to spread over cores (each op's
// OpenMP region costs more than it saves, and the idle workers spin on the cores the BLAS
// wants), while whole forward and backward passes keep every core busy. Inside a worker
// LibTorch's ops run serially and the BLAS on one thread (attnkit::run_tasks). The parts'
// gradients are summed in part order, so a run repeats exactly at a given share count.
BatchScore forward_backward_in_shares(AttentionModel& model, const Batch& batch,
                                      const torch::Device& device, bool count_correct,
                                      int64_t shares, torch::Tensor& gradients, double loss_scale) {
  const auto parameters = model->parameters();  // the optimizer's flat layout, in order
  const auto scored = batch.loss_mask.sum().item<int64_t>();
  std::vector<torch::Tensor> losses(shares), flat_gradients(shares);
  std::vector<int64_t> corrects(shares);
  attnkit::run_tasks(shares, device, [&](int64_t part) {
    torch::AutoGradMode grad_mode(true);  // run_tasks turns it off in its workers
    const auto s = score(model, part_of(batch, part, shares), device, count_correct);
    // This part's share of the mean over the whole batch's scored positions.
    losses[part] = s.loss * (static_cast<double>(s.scored) / std::max<int64_t>(scored, 1));
    const auto grads = torch::autograd::grad({losses[part] * loss_scale}, parameters,
                                             /*grad_outputs=*/{},
                                             /*retain_graph=*/false, /*create_graph=*/false,
                                             /*allow_unused=*/true);
    std::vector<torch::Tensor> pieces;  // each (numel) of its parameter
    for (size_t k = 0; k < grads.size(); ++k) {
      pieces.push_back(grads[k].defined()
                           ? grads[k].reshape({-1})
                           : torch::zeros({parameters[k].numel()}, parameters[k].options()));
    }
    flat_gradients[part] = torch::cat(pieces);
    corrects[part] = s.correct;
  });
  torch::NoGradGuard no_grad;
  gradients.copy_(flat_gradients[0]);
  auto loss = losses[0].detach();
  int64_t correct = corrects[0];
  for (int64_t part = 1; part < shares; ++part) {
    gradients.add_(flat_gradients[part]);
    loss = loss + losses[part].detach();
    correct += corrects[part];
  }
  return {loss, correct, scored};
}

Evaluation evaluate(AttentionModel& model, const std::vector<Batch>& batches,
                    const torch::Device& device, int64_t shares) {
  torch::NoGradGuard no_grad;
  model->eval();
  double loss_sum = 0.0;
  int64_t correct = 0, scored = 0;
  for (const auto& batch : batches) {
    // Each part on its own worker, as in training (forward_backward_in_shares).
    const int64_t parts = std::min<int64_t>(shares, batch.inputs.size(0));
    std::vector<BatchScore> part_scores(parts);
    attnkit::run_tasks(parts, device, [&](int64_t part) {
      part_scores[part] = score(model, part_of(batch, part, parts), device, true);
    });
    for (const auto& s : part_scores) {
      loss_sum += s.loss.item<double>() * static_cast<double>(s.scored);
      correct += s.correct;
      scored += s.scored;
    }
  }
  model->train();
  Evaluation e;
  e.loss = loss_sum / static_cast<double>(scored);
  e.accuracy = static_cast<double>(correct) / static_cast<double>(scored);
  e.bits_per_byte = e.loss / std::log(2.0);
  return e;
}

// ---- metrics file -----------------------------------------------------------------------

class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, bool text_task) : text_task_(text_task) {
    if (path.empty())
      return;
    csv_ = ends_with(path, ".csv");
    out_.open(path, std::ios::trunc);
    TORCH_CHECK(out_.good(), "--metrics: cannot write '", path, "'");
    if (csv_) {
      out_ << "step,loss," << (text_task_ ? "bits_per_byte" : "accuracy")
           << ",train_loss,tokens_per_s,elapsed_s,final\n";
    }
  }

  void write(int64_t step, const Evaluation& e, double train_loss, double tokens_per_s,
             double elapsed_s, bool final) {
    if (!out_.is_open())
      return;
    const double metric = text_task_ ? e.bits_per_byte : e.accuracy;
    out_ << std::setprecision(6);
    if (csv_) {
      out_ << step << "," << e.loss << "," << metric << "," << train_loss << "," << tokens_per_s
           << "," << elapsed_s << "," << (final ? "true" : "false") << "\n";
    } else {
      out_ << "{\"step\": " << step << ", \"loss\": " << e.loss << ", \""
           << (text_task_ ? "bits_per_byte" : "accuracy") << "\": " << metric
           << ", \"train_loss\": " << train_loss << ", \"tokens_per_s\": " << tokens_per_s
           << ", \"elapsed_s\": " << elapsed_s << ", \"final\": " << (final ? "true" : "false")
           << "}\n";
    }
    out_.flush();  // a killed run keeps every line written so far
  }

 private:
  bool text_task_;
  bool csv_ = false;
  std::ofstream out_;
};

// ---- progress ---------------------------------------------------------------------------

std::string format_eval(const Evaluation& e, bool text) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(4) << "held-out loss " << e.loss;
  if (text) {
    s << std::setprecision(3) << ", " << e.bits_per_byte << " bits/byte";
  } else {
    s << std::setprecision(2) << ", accuracy " << 100.0 * e.accuracy << "%";
  }
  return s.str();
}

void draw_progress(std::ostream& out, int64_t step, int64_t steps, double loss, double accuracy,
                   bool text, double tokens_per_s, double eta_s) {
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(steps, 1));
  Line line(out);
  line << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] step "
       << step << "/" << steps << std::fixed << std::setprecision(4) << " loss " << loss;
  if (!text)
    line << std::setprecision(1) << " acc " << 100.0 * accuracy << "%";
  line << std::setprecision(0) << " " << tokens_per_s << " tok/s ETA " << eta_s << "s   ";
}

// "sample (N bytes, KV cache, T tokens/s): [prompt]continuation": `length` bytes after the
// first 16 of a held-out sequence, temperature 0.8, seeded by --seed.
std::string sample_text(AttentionModel& model, const Task& task, const torch::Device& device,
                        const TrainConfig& config) {
  model->eval();
  const auto sequence = task.eval_batches(1).front().inputs[0];
  const int64_t prompt_length = std::min<int64_t>(16, sequence.size(0));
  const auto prompt = sequence.slice(0, 0, prompt_length).unsqueeze(0).to(device);  // (1, n)
  const auto start = Clock::now();
  const auto tokens = generate(*model, prompt,
                               GenerateOptions(config.sample)
                                   .temperature(0.8)
                                   .seed(config.seed)
                                   .use_kv_cache(config.kv_cache))
                          .to(torch::kCPU);
  const double seconds = seconds_since(start);
  const auto* ids = tokens.data_ptr<int64_t>();
  const std::string text(ids, ids + tokens.size(1));
  return c10::str("sample (", config.sample, " bytes, ",
                  config.kv_cache ? "KV cache" : "no KV cache", ", ",
                  static_cast<int64_t>(config.sample / std::max(seconds, 1e-9)), " tokens/s): [",
                  text.substr(0, prompt_length), "]", text.substr(prompt_length));
}

// The non-empty lines of --prompts, each a prompt of bytes.
std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "--prompts: cannot read '", path, "'");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(file, line);) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    if (!line.empty())
      prompts.push_back(line);
  }
  TORCH_CHECK(!prompts.empty(), "--prompts: '", path, "' has no non-empty line");
  return prompts;
}

// "samples (K prompts in one batch, N bytes each, T tokens/s):" then "[prompt]continuation"
// per line of --prompts, temperature 0.8, seeded by --seed.
std::string sample_prompts(AttentionModel& model, const torch::Device& device,
                           const TrainConfig& config) {
  model->eval();
  std::vector<GenerationRequest> requests;
  const auto prompts = read_prompts(config.prompts);
  for (const auto& prompt : prompts) {
    const std::vector<int64_t> bytes(prompt.begin(), prompt.end());
    requests.emplace_back(torch::tensor(bytes, torch::kInt64).bitwise_and(255).to(device));
  }
  const auto start = Clock::now();
  const auto rows =
      generate(*model, requests, GenerateOptions(config.sample).temperature(0.8).seed(config.seed));
  const double seconds = seconds_since(start);
  std::ostringstream text;
  text << "samples (" << prompts.size() << " prompts in one batch, " << config.sample
       << " bytes each, KV cache, "
       << static_cast<int64_t>(static_cast<double>(config.sample * prompts.size()) /
                               std::max(seconds, 1e-9))
       << " tokens/s):";
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto row = rows[r].to(torch::kCPU);
    const auto* ids = row.data_ptr<int64_t>();
    const std::string bytes(ids, ids + row.size(0));
    text << "\n[" << prompts[r] << "]" << bytes.substr(prompts[r].size());
  }
  return text.str();
}

void dump_attention(const std::string& path, AttentionModel& model, const Task& task,
                    const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto example_batch = task.eval_batches(1).front();
  const auto& example = example_batch.inputs;  // (1, n)
  std::vector<std::string> labels;
  for (int64_t i = 0; i < example.size(1); ++i) {
    labels.push_back(task.token_label(example[0][i].item<int64_t>()));
  }
  std::vector<torch::Tensor> maps;
  const auto& ids = example_batch.document_ids;  // (1, n) with --pack
  for (const auto& layer :
       model->attention_maps(example.to(device), ids.defined() ? ids.to(device) : ids)) {
    maps.push_back(layer[0].cpu());  // (h, n, n)
  }
  write_attention_heatmap(path, maps, labels, model->config().module + " on " + task.name());
}

// `saved_step`: the step of the last checkpoint this run wrote (0: none).
std::string non_finite_message(const char* what, double value, int64_t step,
                               const TrainConfig& config, int64_t saved_step) {
  std::string checkpoint = " (no --save given)";
  if (!config.save.empty()) {
    checkpoint = saved_step > 0 ? c10::str("; the last good checkpoint is ", config.save, " (step ",
                                           saved_step, ")")
                                : c10::str("; nothing was saved, ", config.save, " is unchanged");
  }
  return c10::str(what, " became ", std::isnan(value) ? "NaN" : "infinite", " at step ", step,
                  "; training stopped", checkpoint, ". Try a smaller --lr (now ", config.lr, ")");
}

}  // namespace

std::string best_checkpoint_path(const std::string& save_path) {
  const auto dot = save_path.rfind('.');
  const auto slash = save_path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return save_path + ".best";
  }
  return save_path.substr(0, dot) + ".best" + save_path.substr(dot);
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
  const std::string probe = path + ".tmp";
  const bool existed = std::ifstream(probe).good();
  const bool writable = std::ofstream(probe, std::ios::app).good();
  if (!existed)
    std::remove(probe.c_str());
  TORCH_CHECK(writable, flag, ": cannot write '", path, "' (does its directory exist?)");
}

}  // namespace

TrainConfig resolve(TrainConfig c) {
  if (c.backend.empty() && has_backends_and_kv_cache(c.module))
    c.backend = "fused";
  if (c.seq_len == 0)
    c.seq_len = default_task_length(c.task);
  if (c.layers == 0)
    c.layers = (c.task == "recall" || c.task == "text") ? 2 : 1;
  if (c.steps == 0)
    c.steps = default_steps(c.task);
  if (c.eval_every == 0)
    c.eval_every = std::max<int64_t>(1, c.steps / 10);
  TORCH_CHECK(c.steps >= 1, "--steps: expected >= 1, got ", c.steps);
  TORCH_CHECK(c.batch_size >= 1, "--batch-size: expected >= 1, got ", c.batch_size);
  TORCH_CHECK(c.lr > 0 && std::isfinite(c.lr), "--lr: expected a positive number, got ", c.lr);
  TORCH_CHECK(c.weight_decay >= 0, "--weight-decay: expected >= 0, got ", c.weight_decay);
  TORCH_CHECK(c.threads >= 0, "--threads: expected >= 0 (0 = the usable cores), got ", c.threads);
  TORCH_CHECK(c.eval_every >= 1, "--eval-every: expected >= 1, got ", c.eval_every);
  TORCH_CHECK(c.bucket_mb >= 0 && std::isfinite(c.bucket_mb),
              "--bucket-mb: expected >= 0 (0 = one allreduce after backward), got ", c.bucket_mb);
  TORCH_CHECK(c.sample >= 0, "--sample: expected >= 0, got ", c.sample);
  TORCH_CHECK(!c.pack || c.task == "text",
              "--pack: only the text task has documents to pack, got --task ", c.task);
  TORCH_CHECK(!c.pack || takes_masks(c.module), "--pack: --module ", c.module,
              " takes no mask, so it cannot keep packed documents apart; use mha, mha-combined, "
              "gqa, mqa or mla");
  TORCH_CHECK(c.sample == 0 || c.task == "text",
              "--sample: only the text task generates, got --task ", c.task);
  TORCH_CHECK(c.sample == 0 || !c.kv_cache || has_backends_and_kv_cache(c.module),
              "--sample with --module ", c.module,
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
  TORCH_CHECK(dtype != torch::kHalf || !device.is_cpu() || attnkit::cpu_multiplies_float16(),
              "--dtype float16: this LibTorch has no float16 matrix products on the CPU (1.13 "
              "has none); use --dtype bfloat16, or a GPU");
  TORCH_CHECK(!c.autocast || dtype != torch::kFloat,
              "--autocast: give the dtype it runs in, --dtype bfloat16 or float16 (got --dtype ",
              c.dtype, ")");
  // One process; a launched rank chooses again knowing its machine's ranks (apps/train.cpp).
  c.dist_backend = choose_dist_backend(c.dist_backend, device, RankEnvironment{});
  check_backend_serves(c.dist_backend, device);
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
      {"module", c.module + (c.backend.empty() ? "" : " (" + c.backend + " backend)") +
                     (c.kv_groups > 0 ? ", kv-groups " + std::to_string(c.kv_groups) : "") +
                     (c.window > 0 ? ", window " + std::to_string(c.window) : "") +
                     (c.latent_dim > 0 ? ", latent-dim " + std::to_string(c.latent_dim) : "")},
      {"d-model / heads / layers", std::to_string(c.d_model) + " / " + std::to_string(c.heads) +
                                       " / " + std::to_string(c.layers)},
      {"ffn / dropout", std::string(c.ffn ? "yes" : "no") + " / " + c10::str(c.dropout)},
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
  auto fields = checkpoint_fields(c);
  const std::vector<std::pair<std::string, std::string>> run{
      {"backend", c.backend},
      {"dropout", c10::str(c.dropout)},
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
      {"dtype", c.dtype},
      {"autocast", c.autocast ? "true" : "false"}};
  fields.insert(fields.end(), run.begin(), run.end());
  std::string text;
  for (const auto& [key, value] : fields)
    text += "--" + key + " " + value + "\n";
  return text;
}

void check_global_batch(int64_t batch_size, int world_size) {
  TORCH_CHECK(batch_size >= world_size, "--batch-size ", batch_size,
              " is the global batch and must give each of the ", world_size,
              " ranks at least one sequence");
}

void check_dtype_ranks(const std::string& dtype, bool autocast, int world_size) {
  TORCH_CHECK(world_size == 1 || dtype == "float32" || autocast, "--dtype ", dtype, " with ",
              world_size,
              " ranks: the 16-bit working copy trains in one process; add --autocast (float32 "
              "weights, forward under LibTorch's autocast), or drop --dtype or --nproc");
}

namespace {

// LibTorch on one thread while it lives (the BLAS is pinned by the caller). With OpenMP it
// sets the calling thread's OpenMP count, which at::get_num_threads() reads: LibTorch 1.13's
// at::set_num_threads also rebuilds a pthread pool each call, which cost 7-10% of a step.
class OneThread {
 public:
  OneThread() : saved_(at::get_num_threads()) { set(1); }
  ~OneThread() { set(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  static void set(int threads) {
#if AT_PARALLEL_OPENMP
    omp_set_num_threads(threads);
#else
    at::set_num_threads(threads);
#endif
  }
  int saved_;
};

// Ranks of this run on this machine: the launcher's count, else (not told) every rank.
int local_ranks(int world_size) {
  const auto environment = read_rank_environment();
  return environment.local_world_size > 0 ? environment.local_world_size : world_size;
}

// The threads a run uses: --threads, or for 0 the cores this process may run on, shared
// among the run's ranks on this machine.
int run_threads(const TrainConfig& c, int ranks_here) {
  if (c.threads > 0)
    return static_cast<int>(c.threads);
  cpu_set_t allowed;
  const int cores = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                        ? CPU_COUNT(&allowed)
                        : static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, ranks_here));
}

// Parts a training step's batch is cut into, each run on its own worker
// (forward_backward_in_shares): one per thread on the CPU; 1 on a GPU, and with dropout (its
// masks come from LibTorch's one CPU generator, which workers would draw from in no fixed
// order, so a seed would no longer repeat a run).
int64_t step_shares(const TrainConfig& c, const torch::Device& device, int threads) {
  if (!device.is_cpu() || c.dropout > 0)
    return 1;
  return std::min<int64_t>(threads, std::max<int64_t>(c.batch_size, 1));
}

ModelConfig model_config_of(const TrainConfig& config, const Task& task) {
  ModelConfig model_config;
  model_config.module = config.module;
  model_config.backend = config.backend;
  model_config.kv_groups = config.kv_groups;
  model_config.window = config.window;
  model_config.latent_dim = config.latent_dim;
  model_config.rope = config.rope;
  model_config.qk_norm = config.qk_norm;
  model_config.vocab_size = task.vocab_size();
  model_config.context_length = task.input_length();
  model_config.d_model = config.d_model;
  model_config.heads = config.heads;
  model_config.layers = config.layers;
  model_config.dropout = config.dropout;
  model_config.ffn = config.ffn;
  model_config.causal = task.causal();
  TORCH_CHECK(task.input_length() <= kMaxContext, "--seq-len ", config.seq_len, ": task ",
              config.task, " would need context_length ", task.input_length(), ", more than the ",
              kMaxContext, " attnkit-train allows");
  return model_config;
}

// One call of train(): setup (the constructor), then steps, evaluations with their
// checkpoints, and the report.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& config, std::ostream& out, const std::atomic<bool>* stop,
              Collectives* ranks);
  TrainResult run();

 private:
  void print_setup();
  // One optimisation step: this rank's share of the batch forward and backward, the ranks'
  // gradients summed, the update, the running figures and the progress bar.
  void step(int64_t step);
  // The held-out evaluation (main rank), its metrics and line, and a checkpoint.
  void evaluate(int64_t step);
  void save(bool improved);
  // The final evaluation, metrics, summary, sample and heatmap (main rank).
  TrainResult report();
  bool stop_requested() const { return stop_ != nullptr && stop_->load(); }
  // The model that runs forward and backward: the 16-bit working copy with --dtype
  // bfloat16 | float16, else the float32 model the optimizer updates.
  AttentionModel& working_model() {
    return mixed_ && mixed_->has_working_copy() ? mixed_->model() : model_;
  }

  const TrainConfig& config_;
  std::ostream& out_;
  const std::atomic<bool>* stop_;
  const Clock::time_point wall_start_ = Clock::now();
  const torch::Device device_;
  const std::unique_ptr<Collectives> one_process_;
  Collectives& group_;
  const int rank_, world_size_;
  int threads_ = 1;
  int64_t shares_ = 1, eval_shares_ = 1;
  std::optional<attnkit::SingleThreadedBlas> blas_on_one_thread_;
  at::Generator data_generator_;
  std::unique_ptr<Task> task_;
  AttentionModel model_{nullptr};
  std::optional<FlatAdamW> optimizer_;
  std::optional<MixedPrecision> mixed_;
  std::vector<Batch> eval_batches_;
  bool text_ = false, main_rank_ = false, verbose_ = false;
  TrainingState state_;
  std::unique_ptr<GradientSync> gradient_sync_;
  std::optional<MetricsWriter> metrics_;
  TrainResult result_;
  double train_seconds_ = 0.0;
  int64_t tokens_ = 0;
  double smoothed_loss_ = 0.0, smoothed_accuracy_ = 0.0;
  int64_t first_step_ = 1;
  int64_t saved_step_ = 0;    // the step of the last checkpoint this run wrote
  bool stop_agreed_ = false;  // some rank was asked to stop during the last step
};

TrainingRun::TrainingRun(const TrainConfig& config, std::ostream& out,
                         const std::atomic<bool>* stop, Collectives* ranks)
    : config_(config),
      out_(out),
      stop_(stop),
      device_(resolve_device(config.device)),
      one_process_(single_process()),
      group_(ranks != nullptr ? *ranks : *one_process_),
      rank_(group_.rank()),
      world_size_(group_.world_size()) {
  group_.check_same_on_every_rank("flags", rank_agreement_text(config));
  check_global_batch(config.batch_size, world_size_);
  threads_ = run_threads(config, local_ranks(world_size_));
  attnkit::set_num_threads(threads_);
  shares_ = step_shares(config, device_, threads_);
  eval_shares_ = device_.is_cpu() ? threads_ : 1;  // no dropout there
  // With shares every BLAS call runs inside a worker, on one thread; pinned for the whole run
  // (evaluation and sampling too), so that no BLAS thread spins on a worker's core.
  if (device_.is_cpu() && threads_ > 1)
    blas_on_one_thread_.emplace();
  torch::manual_seed(config.seed);
  data_generator_ = at::detail::createCPUGenerator(config.seed);

  task_ = make_task(config.task, config.seq_len, config.seed, config.data, config.pack);
  model_ = AttentionModel(model_config_of(config, *task_));
  model_->to(device_);
  optimizer_.emplace(model_->parameters(), config.lr, config.weight_decay);
  // Each rank its own dropout stream; rank 0 keeps the one a single process has.
  if (rank_ > 0)
    torch::manual_seed(config.seed + static_cast<uint64_t>(rank_));
  eval_batches_ = task_->eval_batches(256);
  text_ = config.task == "text";
  main_rank_ = group_.is_main();
  verbose_ = !config.quiet && main_rank_;

  if (!config.resume.empty()) {
    state_ = load_checkpoint(config.resume, checkpoint_fields(config), model_, *optimizer_,
                             data_generator_, rank_);
    optimizer_->set_lr(config.lr);  // this run's --lr and --weight-decay
    optimizer_->set_weight_decay(config.weight_decay);
    if (verbose_) {
      Line line(out);
      line << "resumed from " << config.resume << " at step " << state_.step;
      if (state_.dtype != config.dtype) {
        line << " (its steps ran in " << state_.dtype << "; this run continues in " << config.dtype
             << ")";
      }
      line << "\n";
    }
  }
  state_.dtype = config.dtype;
  group_.broadcast_from_main(optimizer_->flat_values());  // the same start on every rank
  const auto dtype = parse_train_dtype(config.dtype);
  if (dtype != torch::kFloat) {
    check_dtype_ranks(config.dtype, config.autocast, world_size_);
    if (config.autocast) {
      mixed_.emplace(model_, dtype);
    } else {
      // Building the working copy draws initial weights it then overwrites: the dropout
      // stream stays the one the float32 run (and a resumed one) has.
      auto generator = at::detail::getDefaultCPUGenerator();
      const auto dropout_stream = generator.get_state();
      mixed_.emplace(model_config_of(config, *task_), dtype, device_, optimizer_->flat_values());
      generator.set_state(dropout_stream);
    }
  }
  if (world_size_ > 1) {
    gradient_sync_ = std::make_unique<GradientSync>(
        model_->parameters(), optimizer_->flat_gradients(), group_,
        static_cast<int64_t>(std::llround(config.bucket_mb * (1 << 20))));
  }
  if (verbose_)
    print_setup();
  metrics_.emplace(main_rank_ ? config.metrics : std::string(), text_);
  result_.world_size = world_size_;
}

void TrainingRun::print_setup() {
  print_config_table(out_, config_, *task_);
  if (device_.is_cpu()) {
    // What really runs: LibTorch's threads, the BLAS's, and how a step uses them.
    Line line(out_);
    line << "threads: LibTorch " << torch::get_num_threads() << ", " << attnkit::blas_threads();
    if (shares_ > 1)
      line << "; each step's batch in " << shares_ << " shares, one per thread";
    else if (threads_ > 1)
      line << "; a step with dropout on 1 (its masks need one order of draws)";
    line << "\n";
  }
  if (world_size_ > 1) {
    const auto buckets = gradient_sync_->bucket_sizes();
    Line(out_) << "data-parallel: " << world_size_ << " ranks (" << group_.backend() << "), "
               << config_.batch_size << " sequences per step in all, "
               << optimizer_->flat_gradients().numel() << " gradients summed in " << buckets.size()
               << (buckets.size() == 1 ? " allreduce after backward\n"
                                       : " buckets started during backward\n");
  }
}

void TrainingRun::save(bool improved) {
  if (config_.save.empty())
    return;
  // Every rank takes part in gathering the dropout streams; rank 0 writes.
  torch::Tensor cpu_rng_by_rank;
  if (world_size_ > 1) {
    cpu_rng_by_rank =
        torch::stack(group_.gather_all(at::detail::getDefaultCPUGenerator().get_state()));
  }
  if (main_rank_) {
    save_checkpoint(config_.save, checkpoint_fields(config_), model_, *optimizer_, state_,
                    data_generator_, cpu_rng_by_rank);
    if (improved) {
      save_checkpoint(best_checkpoint_path(config_.save), checkpoint_fields(config_), model_,
                      *optimizer_, state_, data_generator_, cpu_rng_by_rank);
    }
  }
  saved_step_ = state_.step;
}

void TrainingRun::step(int64_t step) {
  const auto step_start = Clock::now();
  // Every rank draws the whole global batch from the shared stream and keeps its share.
  const auto batch = task_->train_batch(config_.batch_size, data_generator_);
  const auto share = part_of(batch, rank_, world_size_);
  // A step with dropout runs on one thread: one batch's ops at toy sizes are slower spread
  // over cores (0.6x at 2 threads here), and shares are not an option (step_shares).
  std::optional<OneThread> serial_step;
  if (shares_ == 1 && device_.is_cpu() && threads_ > 1)
    serial_step.emplace();
  auto& model = working_model();
  const double loss_scale = mixed_ ? mixed_->loss_scale() : 1.0;
  // The shares' gradients are summed into the optimizer's float32 buffer whatever --dtype is.
  const auto s = shares_ > 1
                     ? forward_backward_in_shares(model, share, device_, config_.progress_bar,
                                                  shares_, optimizer_->flat_gradients(), loss_scale)
                     : score(model, share, device_, /*count_correct=*/config_.progress_bar);
  // This rank's part of the mean over the whole batch's scored positions: the parts'
  // gradients then sum to the whole batch's.
  const auto scored = world_size_ == 1 ? s.scored : batch.loss_mask.sum().item<int64_t>();
  const auto loss_part =
      world_size_ == 1 ? s.loss
                       : s.loss * (static_cast<double>(s.scored) / std::max<int64_t>(scored, 1));
  double loss = loss_part.item<double>();
  double correct = static_cast<double>(s.correct);
  if (world_size_ > 1) {
    // One small collective: the batch's loss and correct count, and whether to stop.
    auto totals = torch::tensor({loss, correct, stop_requested() ? 1.0 : 0.0}, torch::kDouble);
    group_.sum(totals);
    loss = totals[0].item<double>();
    correct = totals[1].item<double>();
    stop_agreed_ = totals[2].item<double>() > 0;
  }
  if (!std::isfinite(loss)) {
    throw NonFiniteLoss(non_finite_message("loss", loss, step, config_, saved_step_));
  }
  if (shares_ == 1) {  // else forward_backward_in_shares has written the gradients
    if (!mixed_ || !mixed_->has_working_copy())
      optimizer_->zero_grad();  // the working copy's are zeroed as they are taken
    if (gradient_sync_)
      gradient_sync_->before_backward();
    (loss_scale == 1.0 ? loss_part : loss_part * loss_scale).backward();
    if (mixed_)
      mixed_->move_gradients_into(optimizer_->flat_gradients());
  } else if (gradient_sync_) {
    gradient_sync_->before_backward();  // no hook fires now: after_backward sums every bucket
  }
  if (gradient_sync_)
    result_.allreduce_seconds += gradient_sync_->after_backward();  // what backward did not hide
  // A 16-bit step whose gradients overflowed changes nothing (mixed_precision.h).
  if (!mixed_ || mixed_->unscale(optimizer_->flat_gradients())) {
    optimizer_->clip_grad_norm(config_.clip_norm);
    optimizer_->step();
    if (mixed_)
      mixed_->copy_weights_from(optimizer_->flat_values());
  }
  serial_step.reset();
  state_.step = step;
  train_seconds_ += seconds_since(step_start);
  tokens_ += batch.inputs.numel();
  result_.losses.push_back(loss);
  smoothed_loss_ = step == first_step_ ? loss : 0.95 * smoothed_loss_ + 0.05 * loss;
  const double accuracy = scored ? correct / static_cast<double>(scored) : 0.0;
  smoothed_accuracy_ = step == first_step_ ? accuracy : 0.95 * smoothed_accuracy_ + 0.05 * accuracy;
  if (verbose_ && config_.progress_bar) {
    const double eta = train_seconds_ / (step - first_step_ + 1) * (config_.steps - step);
    draw_progress(out_, step, config_.steps, smoothed_loss_, smoothed_accuracy_, text_,
                  tokens_ / std::max(train_seconds_, 1e-9), eta);
  }
}

void TrainingRun::evaluate(int64_t step) {
  bool improved = false;
  if (main_rank_) {
    const auto evaluation =
        ::attnkit::train::evaluate(working_model(), eval_batches_, device_, eval_shares_);
    if (!std::isfinite(evaluation.loss)) {
      // The update broke the weights: stop before they overwrite a good checkpoint.
      throw NonFiniteLoss(
          non_finite_message("held-out loss", evaluation.loss, step, config_, saved_step_));
    }
    improved = evaluation.loss < state_.best_loss;
    if (improved)
      state_.best_loss = evaluation.loss;
    const double tokens_per_s = tokens_ / std::max(train_seconds_, 1e-9);
    metrics_->write(step, evaluation, smoothed_loss_, tokens_per_s, seconds_since(wall_start_),
                    /*final=*/false);
    if (verbose_) {
      Line(out_) << (config_.progress_bar ? "\n" : "") << "step " << step << "/" << config_.steps
                 << " | train loss " << std::fixed << std::setprecision(4) << smoothed_loss_
                 << " | " << format_eval(evaluation, text_) << " | " << std::setprecision(0)
                 << tokens_per_s << " tok/s\n";
    }
  }
  save(improved);
}

TrainResult TrainingRun::run() {
  working_model()->train();
  first_step_ = state_.step + 1;
  for (int64_t step = first_step_; step <= config_.steps; ++step) {
    if (world_size_ == 1 ? stop_requested() : stop_agreed_) {
      result_.interrupted = true;
      break;
    }
    this->step(step);
    if (step % config_.eval_every == 0 || step == config_.steps)
      evaluate(step);
  }
  if (result_.interrupted)
    save(/*improved=*/false);
  return report();
}

TrainResult TrainingRun::report() {
  auto& result = result_;
  result.last_step = state_.step;
  result.train_seconds = train_seconds_;
  result.tokens_per_second = tokens_ / std::max(train_seconds_, 1e-9);
  if (!main_rank_)
    return result;
  result.skipped_steps = mixed_ ? mixed_->skipped_steps() : 0;
  result.final_evaluation =
      ::attnkit::train::evaluate(working_model(), eval_batches_, device_, eval_shares_);
  result.wall_seconds = seconds_since(wall_start_);
  metrics_->write(state_.step, result.final_evaluation, smoothed_loss_, result.tokens_per_second,
                  result.wall_seconds, /*final=*/true);
  {
    Line summary(out_);  // the summary, baselines and sample in one write
    summary << (result.interrupted ? "interrupted" : "done") << " after step " << state_.step
            << ": " << format_eval(result.final_evaluation, text_) << " | " << std::fixed
            << std::setprecision(1) << result.wall_seconds << " s wall, " << std::setprecision(0)
            << result.tokens_per_second << " tokens/s";
    if (world_size_ > 1) {
      summary << " on " << world_size_ << " ranks, gradient allreduce " << std::setprecision(1)
              << 100.0 * result.allreduce_seconds / std::max(train_seconds_, 1e-9)
              << "% of the steps";
    }
    if (result.skipped_steps > 0) {
      summary << ", " << result.skipped_steps << " step(s) skipped for non-finite " << config_.dtype
              << " gradients";
    }
    summary << "\n";
    if (text_) {
      summary << std::setprecision(2) << "corpus baselines: unigram " << task_->unigram_entropy()
              << ", bigram " << task_->bigram_entropy() << " bits/byte; model "
              << result.final_evaluation.bits_per_byte << " ("
              << task_->bigram_entropy() - result.final_evaluation.bits_per_byte
              << " below bigram)\n";
      if (config_.sample > 0 && config_.prompts.empty()) {
        summary << sample_text(working_model(), *task_, device_, config_) << "\n";
      } else if (config_.sample > 0) {
        summary << sample_prompts(working_model(), device_, config_) << "\n";
      }
    }
  }
  if (!config_.dump_attention.empty()) {
    dump_attention(config_.dump_attention, model_, *task_, device_);
    if (verbose_)
      Line(out_) << "attention heatmap written to " << config_.dump_attention << "\n";
  }
  return result;
}

}  // namespace

TrainResult train(const TrainConfig& config, std::ostream& out, const std::atomic<bool>* stop,
                  Collectives* ranks) {
  return TrainingRun(config, out, stop, ranks).run();
}

}  // namespace attnkit::train
