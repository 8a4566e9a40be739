// tiny_gpt: a small byte-level language model of your own whose decoder blocks use attnkit's
// attention layers, trained for a few hundred steps on a text file and then sampled with
// attnkit::generate and the attention layers' KV caches. Two designs:
//   GPT-2 style (default): learned positions, LayerNorm, attnkit::MultiHeadAttention, GELU MLP;
//   Llama style (--llama): no position table, RMSNorm, attnkit::GroupedQueryAttention with
//   rotary positions (RoPE), SwiGLU feed-forward, a bias-free head.
//
//   tiny_gpt --data the-verdict.txt [--llama] [--steps 300] [--sample 200] [--seed 1]
//   tiny_gpt --golden data/golden/llama/reference.pt
//   tiny_gpt --hf data/golden/hf/llama3 [--device cuda] [--dtype bfloat16]
//   tiny_gpt --hf data/golden/hf/llama3 --serve data/serve_prompts.txt [--one-at-a-time]
//
// Prints the training loss as it falls, the held-out loss, and a sample. Exits 1 if the
// loss did not fall, so a test can tell that the model learns. --golden instead checks the
// Llama-style model against scripts/llama_reference.py's outputs (prefill, then the three
// prompts decoded together as one ragged batch) and exits 1 on a mismatch. --hf loads a
// Hugging Face checkpoint (GPT-2, Llama 3, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3) into
// the same model through a name map and
// checks it against transformers' logits and greedy tokens (reference_checks.h); with --serve
// it serves a file of prompts by continuous batching and reports latency and throughput
// (serve.h).

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "model.h"
#include "reference_checks.h"
#include "serve.h"

namespace {

using tiny_gpt::ModelConfig;
using tiny_gpt::TinyGpt;

constexpr int64_t kBatch = 32;
constexpr double kLearningRate = 3e-3;

// Random (inputs, next-byte targets) windows of `data`, each (kBatch, context_length).
std::pair<torch::Tensor, torch::Tensor> batch_from(const torch::Tensor& data, int64_t context) {
  const auto starts = torch::randint(data.size(0) - context - 1, {kBatch});
  const auto offsets = torch::arange(context + 1);
  const auto windows = data.index({starts.unsqueeze(1) + offsets});  // (b, n + 1)
  return {windows.slice(1, 0, context), windows.slice(1, 1)};
}

torch::Tensor loss_of(TinyGpt& model, const torch::Tensor& inputs, const torch::Tensor& targets) {
  const auto logits = model(inputs);  // (b, n, vocab) -> (b * n, vocab)
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              targets.reshape(-1));
}

// `length` bytes after `prompt`, temperature 0.8, decoded with the KV caches; prints the
// speed to stderr.
std::string sample(TinyGpt& model, const std::string& prompt, int64_t length, uint64_t seed) {
  model->eval();
  const auto prompt_ids =
      torch::tensor(std::vector<int64_t>(prompt.begin(), prompt.end())).unsqueeze(0);  // (1, n)
  const auto start = std::chrono::steady_clock::now();
  const auto ids = attnkit::generate(*model, prompt_ids,
                                     attnkit::GenerateOptions(length).temperature(0.8).seed(seed));
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  std::cerr << "tiny_gpt: sampled " << length << " bytes with the KV cache, "
            << static_cast<int64_t>(length / std::max(seconds.count(), 1e-9)) << " tokens/s\n";
  const auto* data = ids.data_ptr<int64_t>();
  return std::string(data, data + ids.size(1));
}

constexpr const char* kUsage =
    "usage: tiny_gpt --data FILE [--llama] [--steps N] [--sample N] [--seed N]\n"
    "       tiny_gpt --golden data/golden/llama/reference.pt\n"
    "       tiny_gpt --hf DIR [--device cpu|cuda] [--dtype float64|float32|bfloat16]\n"
    "                [--decode-speed N]\n"
    "  --hf DIR: DIR holds a Hugging Face GPT-2, Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2\n"
    "  or Gemma 3 checkpoint (config.json, model.safetensors) and reference.safetensors\n"
    "  (scripts/hf_decoder_reference.py); checks float64 and float32 unless --dtype names one\n"
    "  --decode-speed N (with --hf): instead of the checks, tokens/s of greedy decoding of N\n"
    "  tokens after the reference's longest prompt, with and without the KV caches, in\n"
    "  alternation, medians of 5 rounds (--dtype: float32 unless named)\n"
    "       tiny_gpt --hf DIR --serve PROMPTS [--max-new-tokens N] [--one-at-a-time]\n"
    "                [--page-size N] [--max-running N] [--device D] [--dtype T]\n"
    "  --serve PROMPTS (with --hf): serves the prompts of the file (one per line, token ids\n"
    "  separated by spaces), all submitted at once, N greedy tokens each (default 32), by\n"
    "  continuous batching on paged caches (attnkit::Scheduler: pages of --page-size\n"
    "  positions, default 16, up to --max-running requests at once, default 32), or with\n"
    "  --one-at-a-time by attnkit::generate one prompt after another; prints each request's\n"
    "  time to first token and latency, and the tokens/s (--dtype: float32 unless named)";

int usage(const std::string& message) {
  std::cerr << "tiny_gpt: " << message << "\n" << kUsage << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string data_path, golden_path, hf_dir;
  torch::Device device(torch::kCPU);
  c10::optional<torch::ScalarType> dtype;
  ModelConfig config;
  int64_t steps = 300;
  int64_t sample_length = 200;
  int64_t seed = 1;
  int64_t decode_speed_tokens = 0;
  tiny_gpt::ServeSettings serve;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << "tiny_gpt: a byte-level language model on attnkit's attention (GPT-2 style, "
                   "or Llama style with --llama)\n"
                << kUsage << "\n";
      return 0;
    }
    if (arg == "--llama") {
      config.llama = true;
      continue;
    }
    if (arg == "--one-at-a-time") {
      serve.one_at_a_time = true;
      continue;
    }
    if (i + 1 >= argc)
      return usage("missing value for " + arg);
    const std::string value = argv[++i];
    if (arg == "--data") {
      data_path = value;
    } else if (arg == "--golden") {
      golden_path = value;
    } else if (arg == "--hf") {
      hf_dir = value;
    } else if (arg == "--serve") {
      serve.prompts_path = value;
    } else if (arg == "--device") {
      if (value != "cpu" && value != "cuda" && value.rfind("cuda:", 0) != 0)
        return usage("--device must be cpu, cuda or cuda:N, got '" + value + "'");
      device = torch::Device(value);
      if (device.is_cuda() && !torch::cuda::is_available())
        return usage("--device " + value + ": no CUDA device is available");
    } else if (arg == "--dtype") {
      if (value == "float64")
        dtype = torch::kFloat64;
      else if (value == "float32")
        dtype = torch::kFloat32;
      else if (value == "bfloat16")
        dtype = torch::kBFloat16;
      else
        return usage("--dtype must be float64, float32 or bfloat16, got '" + value + "'");
    } else if (arg == "--steps" || arg == "--sample" || arg == "--seed" ||
               arg == "--decode-speed" || arg == "--max-new-tokens") {
      char* end = nullptr;
      const long long number = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || number < 0)
        return usage(arg + " needs a number >= 0, got '" + value + "'");
      (arg == "--steps"            ? steps
       : arg == "--sample"         ? sample_length
       : arg == "--seed"           ? seed
       : arg == "--max-new-tokens" ? serve.new_tokens
                                   : decode_speed_tokens) = number;
    } else if (arg == "--page-size" || arg == "--max-running") {
      char* end = nullptr;
      const long long number = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || number < 1)
        return usage(arg + " needs a number >= 1, got '" + value + "'");
      (arg == "--page-size" ? serve.page_size : serve.max_running) = number;
    } else {
      return usage("unknown argument " + arg);
    }
  }
  const bool serving = !serve.prompts_path.empty();
  if (!serving && serve.one_at_a_time)
    return usage("--one-at-a-time goes with --serve");
  if (serving && (hf_dir.empty() || decode_speed_tokens > 0))
    return usage("--serve goes with --hf, and not with --decode-speed");
  if (serving)
    return tiny_gpt::serve(hf_dir, device, dtype.value_or(torch::kFloat32), serve);
  if (!hf_dir.empty() && decode_speed_tokens > 0) {
    return tiny_gpt::decode_speed(hf_dir, device, dtype.value_or(torch::kFloat32),
                                  decode_speed_tokens);
  }
  if (!hf_dir.empty())
    return tiny_gpt::check_hf(hf_dir, device, dtype);
  if (device.is_cuda() || dtype || decode_speed_tokens > 0)
    return usage("--device, --dtype and --decode-speed go with --hf");
  if (!golden_path.empty())
    return tiny_gpt::check_golden(golden_path);
  if (data_path.empty())
    return usage("--data is required");
  std::ifstream file(data_path, std::ios::binary);
  if (!file)
    return usage("cannot read " + data_path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(text.size()) < 10 * (config.context_length + 1)) {
    return usage("too little text in " + data_path);
  }

  torch::manual_seed(seed);
  const auto bytes = torch::from_blob(const_cast<char*>(text.data()),
                                      {static_cast<int64_t>(text.size())}, torch::kUInt8)
                         .to(torch::kInt64);
  const auto split = bytes.size(0) * 9 / 10;  // train on the first 90%, validate on the rest
  const auto train = bytes.slice(0, 0, split);
  const auto validation = bytes.slice(0, split);

  TinyGpt model(config, /*dropout=*/0.0);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(kLearningRate));
  if (config.llama) {
    std::cout << "tiny_gpt: " << config.layers
              << " Llama-style decoder blocks: attnkit::GroupedQueryAttention (" << config.heads
              << " heads, " << config.kv_groups
              << " key/value groups, RoPE), RMSNorm, SwiGLU, d_model " << config.d_model;
  } else {
    std::cout << "tiny_gpt: " << config.layers << " decoder blocks of attnkit::MultiHeadAttention ("
              << config.heads << " heads, d_model " << config.d_model << ")";
  }
  std::cout << ", " << text.size() << " bytes of " << data_path << "\n";

  double first_loss = 0.0;
  double recent_loss = 0.0;
  for (int64_t step = 1; step <= steps; ++step) {
    model->train();
    const auto [inputs, targets] = batch_from(train, config.context_length);
    const auto loss = loss_of(model, inputs, targets);
    optimizer.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    const double value = loss.item<double>();
    if (step == 1)
      first_loss = recent_loss = value;
    recent_loss = 0.9 * recent_loss + 0.1 * value;  // smoothed
    if (step == 1 || step % 50 == 0 || step == steps) {
      std::cout << "step " << step << " | loss " << value << " (smoothed " << recent_loss << ")\n";
    }
  }

  torch::NoGradGuard no_grad;
  model->eval();
  double validation_loss = 0.0;
  constexpr int kValidationBatches = 10;
  for (int i = 0; i < kValidationBatches; ++i) {
    const auto [inputs, targets] = batch_from(validation, config.context_length);
    validation_loss += loss_of(model, inputs, targets).item<double>() / kValidationBatches;
  }
  std::cout << "validation loss " << validation_loss << " nats/byte ("
            << validation_loss / std::log(2.0) << " bits/byte); first training loss " << first_loss
            << "\n";
  if (sample_length > 0) {
    std::cout << "sample: " << sample(model, "The ", sample_length, seed) << "\n";
  }
  // A model that learns drops well below the uniform loss ln(256) = 5.55 it starts near.
  if (steps > 0 && !(validation_loss < first_loss - 1.0)) {
    std::cerr << "tiny_gpt: the loss did not fall (first " << first_loss << ", validation "
              << validation_loss << ")\n";
    return 1;
  }
  return 0;
} catch (const c10::Error& e) {
  std::cerr << "tiny_gpt: " << e.what_without_backtrace() << "\n";
  return 1;
} catch (const std::exception& e) {  // a config.json that --hf cannot use
  std::cerr << "tiny_gpt: " << e.what() << "\n";
  return 1;
}
