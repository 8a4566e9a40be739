// tiny_gpt: a small byte-level language model of your own whose decoder blocks use attnkit's
// attention layers, trained for a few hundred steps on a text file and then sampled with
// attnkit::generate and the attention layers' KV caches. Two designs:
//   GPT-2 style (default): learned positions, LayerNorm, attnkit::MultiHeadAttention, GELU MLP;
//   Llama style (--llama): no position table, RMSNorm, attnkit::GroupedQueryAttention with
//   rotary positions (RoPE), SwiGLU feed-forward, a bias-free head.
//
//   tiny_gpt --data the-verdict.txt [--llama] [--steps 300] [--sample 200] [--seed 1]
//   tiny_gpt --golden data/golden/llama/reference.pt
//
// Prints the training loss as it falls, the held-out loss, and a sample. Exits 1 if the
// loss did not fall, so a test can tell that the model learns. --golden instead checks the
// Llama-style model against scripts/llama_reference.py's outputs (prefill, then the three
// prompts decoded together as one ragged batch) and exits 1 on a mismatch.

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

namespace {

constexpr int64_t kBatch = 32;
constexpr double kLearningRate = 3e-3;

struct ModelConfig {
  int64_t vocab = 256;  // bytes
  int64_t context_length = 64;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  bool llama = false;
  // Llama style only.
  int64_t kv_groups = 2;
  int64_t hidden = 192;  // SwiGLU width, about 8/3 d_model
  bool qk_norm = false;  // Qwen3's RMSNorm of queries and keys
  double norm_eps = 1e-5;
  attnkit::RopeOptions rope = attnkit::RopeOptions(64);
};

// One pre-norm decoder block: x + attention(norm(x)), then x + feed_forward(norm(x)). Any
// attnkit attention layer with a KV cache attends; each design supplies its norms and
// feed-forward.
struct DecoderBlock : torch::nn::Module {
  explicit DecoderBlock(std::shared_ptr<attnkit::CachedAttentionLayer> layer)
      : attention(std::move(layer)) {
    register_module("attention", attention->as_module());
  }

  torch::Tensor forward(torch::Tensor x) {  // (b, n, d) -> (b, n, d)
    x = x + attention->forward(attention_norm(x));
    return x + feed_forward(feed_forward_norm(x));
  }
  // The same for the next tokens of sequences whose earlier keys and values are in `cache`;
  // with `lengths` (b), row r brings its first lengths[r] tokens, the rest is padding.
  torch::Tensor forward_with_cache(torch::Tensor x, attnkit::KVCache& cache,
                                   const torch::Tensor& lengths) {
    x = x + attention->forward_with_cache(attention_norm(x), cache, lengths);
    return x + feed_forward(feed_forward_norm(x));
  }
  attnkit::KVCache make_kv_cache(int64_t batch, int64_t capacity) {
    return attention->make_kv_cache(batch, capacity);
  }

  virtual torch::Tensor attention_norm(const torch::Tensor& x) = 0;
  virtual torch::Tensor feed_forward_norm(const torch::Tensor& x) = 0;
  virtual torch::Tensor feed_forward(const torch::Tensor& x) = 0;

  std::shared_ptr<attnkit::CachedAttentionLayer> attention;
};

// GPT-2 style: LayerNorms, multi-head attention and a GELU MLP.
struct GptBlock : DecoderBlock {
  GptBlock(const ModelConfig& c, double dropout)
      : DecoderBlock(
            attnkit::MultiHeadAttention(c.d_model, c.d_model, c.context_length, dropout, c.heads)
                .ptr()),
        attention_norm_(register_module(
            "attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        feed_forward_norm_(register_module(
            "feed_forward_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})))),
        feed_forward_(register_module(
            "feed_forward",
            torch::nn::Sequential(torch::nn::Linear(c.d_model, 4 * c.d_model), torch::nn::GELU(),
                                  torch::nn::Linear(4 * c.d_model, c.d_model)))) {}

  torch::Tensor attention_norm(const torch::Tensor& x) override { return attention_norm_(x); }
  torch::Tensor feed_forward_norm(const torch::Tensor& x) override { return feed_forward_norm_(x); }
  torch::Tensor feed_forward(const torch::Tensor& x) override { return feed_forward_->forward(x); }

  torch::nn::LayerNorm attention_norm_;
  torch::nn::LayerNorm feed_forward_norm_;
  torch::nn::Sequential feed_forward_;
};

// Llama's feed-forward: fc3(silu(fc1(x)) * fc2(x)), no biases.
struct SwiGLUImpl : torch::nn::Module {
  SwiGLUImpl(int64_t d_model, int64_t hidden)
      : fc1(register_module("fc1", linear(d_model, hidden))),
        fc2(register_module("fc2", linear(d_model, hidden))),
        fc3(register_module("fc3", linear(hidden, d_model))) {}
  static torch::nn::Linear linear(int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::silu(fc1(x)) * fc2(x)); }

  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(SwiGLU);

// Llama style: RMSNorm, grouped-query attention with RoPE (and QK-norm for Qwen3), SwiGLU.
struct LlamaBlock : DecoderBlock {
  LlamaBlock(const ModelConfig& c, double dropout)
      : DecoderBlock(
            attnkit::GroupedQueryAttention(attnkit::GroupedQueryAttentionOptions(
                                               c.d_model, c.d_model, dropout, c.heads, c.kv_groups)
                                               .rope(c.rope)
                                               .qk_norm(c.qk_norm))
                .ptr()),
        attention_norm_(register_module("attention_norm", norm(c))),
        feed_forward_norm_(register_module("feed_forward_norm", norm(c))),
        feed_forward_(register_module("feed_forward", SwiGLU(c.d_model, c.hidden))) {}
  static attnkit::RMSNorm norm(const ModelConfig& c) {
    return attnkit::RMSNorm(attnkit::RMSNormOptions(c.d_model).eps(c.norm_eps));
  }

  torch::Tensor attention_norm(const torch::Tensor& x) override { return attention_norm_(x); }
  torch::Tensor feed_forward_norm(const torch::Tensor& x) override { return feed_forward_norm_(x); }
  torch::Tensor feed_forward(const torch::Tensor& x) override { return feed_forward_(x); }

  attnkit::RMSNorm attention_norm_;
  attnkit::RMSNorm feed_forward_norm_;
  SwiGLU feed_forward_;
};

// A torch::nn::Module and an attnkit::CausalLanguageModel, so attnkit::generate can decode it,
// one prompt or a batch of prompts of different lengths.
struct TinyGptImpl : torch::nn::Module, attnkit::CausalLanguageModel {
  TinyGptImpl(const ModelConfig& config, double dropout)
      : config(config),
        token_embedding(
            register_module("token_embedding", torch::nn::Embedding(config.vocab, config.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())) {
    if (!config.llama) {
      position_embedding = register_module(
          "position_embedding", torch::nn::Embedding(config.context_length, config.d_model));
      final_norm =
          torch::nn::AnyModule(torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
    } else {
      final_norm = torch::nn::AnyModule(LlamaBlock::norm(config));
    }
    register_module("final_norm", final_norm.ptr());
    head = register_module(
        "head", torch::nn::Linear(
                    torch::nn::LinearOptions(config.d_model, config.vocab).bias(!config.llama)));
    for (int64_t i = 0; i < config.layers; ++i) {
      if (config.llama)
        blocks->push_back(std::make_shared<LlamaBlock>(config, dropout));
      else
        blocks->push_back(std::make_shared<GptBlock>(config, dropout));
    }
  }

  torch::Tensor forward(const torch::Tensor& tokens) {  // (b, n) -> logits (b, n, vocab)
    auto x = embed(tokens, torch::arange(tokens.size(1), tokens.options()));
    for (auto& block : *blocks) {
      x = block->as<DecoderBlock>()->forward(x);
    }
    return head(final_norm.forward(x));
  }

  // attnkit::CausalLanguageModel
  torch::Tensor logits(const torch::Tensor& tokens) override { return forward(tokens); }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<attnkit::KVCache>& caches) override {
    return with_cache(tokens, {}, caches);
  }
  torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                         std::vector<attnkit::KVCache>& caches) override {
    return with_cache(tokens, lengths, caches);
  }
  std::vector<attnkit::KVCache> make_kv_caches(int64_t batch, int64_t capacity) override {
    std::vector<attnkit::KVCache> caches;
    for (auto& block : *blocks) {
      caches.push_back(block->as<DecoderBlock>()->make_kv_cache(batch, capacity));
    }
    return caches;
  }
  int64_t context_length() const override { return config.context_length; }

  // Tokens (b, n) continuing the sequences in `caches`: row r's token i at position
  // caches' length of row r + i. The padding of a ragged call may pass the position table; its
  // positions are clamped (its outputs are not used).
  torch::Tensor with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                           std::vector<attnkit::KVCache>& caches) {
    const auto starts = caches.front().lengths().to(tokens.device()).unsqueeze(1);  // (b, 1)
    const auto positions = (starts + torch::arange(tokens.size(1), tokens.options()))
                               .clamp_max(config.context_length - 1);  // (b, n)
    auto x = embed(tokens, positions);
    for (size_t i = 0; i < caches.size(); ++i) {
      x = blocks[i]->as<DecoderBlock>()->forward_with_cache(x, caches[i], lengths);
    }
    return head(final_norm.forward(x));
  }

  // Token embeddings of tokens (b, n), plus those of `positions` ((n) or (b, n)) in the GPT
  // design; the Llama design rotates positions into queries and keys instead.
  torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& positions) {
    auto x = token_embedding(tokens);
    return config.llama ? x : x + position_embedding(positions);
  }

  ModelConfig config;
  torch::nn::Embedding token_embedding;
  torch::nn::Embedding position_embedding{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::AnyModule final_norm;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TinyGpt);

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

// ---- --golden: the Llama-style model against scripts/llama_reference.py ----------------

// The reference's model `name` (its config/ and state/ entries) in `dtype`.
TinyGpt golden_model(const attnkit::StateDict& golden, const std::string& name,
                     torch::ScalarType dtype) {
  const auto entry = [&](const std::string& key) {
    const auto full = name + "/config/" + key;
    TORCH_CHECK(golden.contains(full), "--golden: the file has no '", full,
                "'; expected one written by scripts/llama_reference.py --write");
    return golden[full];
  };
  const auto number = [&](const std::string& key) { return entry(key).item<double>(); };
  const auto integer = [&](const std::string& key) { return entry(key).item<int64_t>(); };
  ModelConfig c;
  c.llama = true;
  c.vocab = integer("vocab");
  c.context_length = integer("context_length");
  c.d_model = integer("d_model");
  c.heads = integer("heads");
  c.kv_groups = integer("kv_groups");
  c.layers = integer("layers");
  c.hidden = integer("hidden");
  c.qk_norm = integer("qk_norm") != 0;
  c.norm_eps = number("norm_eps");
  c.rope = attnkit::RopeOptions(c.context_length).theta_base(number("rope_theta"));
  if (integer("rope_original_context_length") > 0) {
    c.rope.freq_config(attnkit::RopeFrequencyConfig()
                           .factor(number("rope_factor"))
                           .low_freq_factor(number("rope_low_freq_factor"))
                           .high_freq_factor(number("rope_high_freq_factor"))
                           .original_context_length(integer("rope_original_context_length")));
  }
  TinyGpt model(c, /*dropout=*/0.0);
  model->to(dtype);
  attnkit::StateDict state;
  const std::string prefix = name + "/state/";
  for (const auto& item : golden) {
    if (item.key().rfind(prefix, 0) == 0)
      state.insert(item.key().substr(prefix.size()), item.value().to(dtype));
  }
  attnkit::load_state_dict(*model, state);  // strict: every key and shape must match
  model->eval();
  return model;
}

// Largest |actual - expected| over what is compared; a shape mismatch is infinite.
struct Difference {
  double worst = 0.0;
  int64_t logits = 0;
  void add(const torch::Tensor& actual, const torch::Tensor& expected) {
    if (actual.sizes() != expected.sizes()) {
      worst = INFINITY;
      return;
    }
    worst = std::max(worst, (actual.to(torch::kFloat64) - expected).abs().max().item<double>());
    logits += expected.numel();
  }
};

// Model `name` of the golden file in `dtype`: each prompt's logits without a cache; then the
// prompts together as one right-padded ragged batch, prefilled and fed the reference's tokens
// one step at a time with the caches; and (float64) attnkit::generate's greedy tokens.
bool check_golden_model(const attnkit::StateDict& golden, const std::string& name,
                        torch::ScalarType dtype, double tolerance) {
  torch::NoGradGuard no_grad;
  auto model = golden_model(golden, name, dtype);
  std::vector<torch::Tensor> prompts, generated, steps;
  for (int64_t r = 0; golden.contains(name + "/prompt/" + std::to_string(r)); ++r) {
    const auto row = "/" + std::to_string(r);
    prompts.push_back(golden[name + "/prompt" + row]);
    generated.push_back(golden[name + "/generated" + row]);
    steps.push_back(golden[name + "/steps" + row]);
  }
  const auto batch = static_cast<int64_t>(prompts.size());
  Difference uncached, ragged;
  int64_t longest = 0;
  for (int64_t r = 0; r < batch; ++r) {
    const auto sequence = torch::cat({prompts[r], generated[r]}).unsqueeze(0);  // (1, n + steps)
    uncached.add(model->forward(sequence)[0], golden[name + "/full/" + std::to_string(r)]);
    longest = std::max(longest, prompts[r].size(0));
  }
  // Right-padded prompts (b, longest) with their lengths, then one token per row per step.
  auto tokens = torch::zeros({batch, longest}, torch::kInt64);
  std::vector<int64_t> lengths;
  for (int64_t r = 0; r < batch; ++r) {
    tokens[r].narrow(0, 0, prompts[r].size(0)).copy_(prompts[r]);
    lengths.push_back(prompts[r].size(0));
  }
  auto caches = model->make_kv_caches(batch, model->context_length());
  const auto prefill = model->ragged_logits_with_cache(tokens, torch::tensor(lengths), caches);
  for (int64_t r = 0; r < batch; ++r) {
    ragged.add(prefill[r].narrow(0, 0, lengths[r]), golden[name + "/prefill/" + std::to_string(r)]);
  }
  const int64_t step_count = generated.front().size(0);
  for (int64_t step = 0; step < step_count; ++step) {
    auto next = torch::stack(generated).select(1, step).unsqueeze(1);  // (b, 1)
    const auto logits = model->ragged_logits_with_cache(next, torch::ones({batch}, torch::kInt64),
                                                        caches);  // (b, 1, vocab)
    for (int64_t r = 0; r < batch; ++r)
      ragged.add(logits[r][0], steps[r][step]);
  }
  bool tokens_match = true;
  if (dtype == torch::kFloat64) {
    std::vector<attnkit::GenerationRequest> requests(prompts.begin(), prompts.end());
    const auto rows = attnkit::generate(*model, requests, attnkit::GenerateOptions(step_count));
    for (int64_t r = 0; r < batch; ++r)
      tokens_match = tokens_match && torch::equal(rows[r], torch::cat({prompts[r], generated[r]}));
  }
  const bool ok = uncached.worst <= tolerance && ragged.worst <= tolerance && tokens_match;
  std::cout << "golden " << name << " " << c10::toString(dtype) << ": uncached max diff "
            << uncached.worst << " (" << uncached.logits << " logits), ragged batch of " << batch
            << " prefill + " << step_count << " decode steps max diff " << ragged.worst << " ("
            << ragged.logits << " logits), tolerance " << tolerance;
  if (dtype == torch::kFloat64)
    std::cout << ", generate's tokens " << (tokens_match ? "equal" : "DIFFER");
  std::cout << (ok ? " -> OK" : " -> MISMATCH") << "\n";
  return ok;
}

int check_golden(const std::string& path) {
  const auto golden = attnkit::read_state_dict(path);
  bool ok = true;
  for (const std::string name : {"llama", "qwen3"}) {
    ok = check_golden_model(golden, name, torch::kFloat64, 1e-10) && ok;
    ok = check_golden_model(golden, name, torch::kFloat32, 1e-4) && ok;
  }
  return ok ? 0 : 1;
}

constexpr const char* kUsage =
    "usage: tiny_gpt --data FILE [--llama] [--steps N] [--sample N] [--seed N]\n"
    "       tiny_gpt --golden data/golden/llama/reference.pt";

int usage(const std::string& message) {
  std::cerr << "tiny_gpt: " << message << "\n" << kUsage << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string data_path, golden_path;
  ModelConfig config;
  int64_t steps = 300;
  int64_t sample_length = 200;
  int64_t seed = 1;
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
    if (i + 1 >= argc)
      return usage("missing value for " + arg);
    const std::string value = argv[++i];
    if (arg == "--data") {
      data_path = value;
    } else if (arg == "--golden") {
      golden_path = value;
    } else if (arg == "--steps" || arg == "--sample" || arg == "--seed") {
      char* end = nullptr;
      const long long number = std::strtoll(value.c_str(), &end, 10);
      if (*end != '\0' || number < 0)
        return usage(arg + " needs a number >= 0");
      (arg == "--steps" ? steps : arg == "--sample" ? sample_length : seed) = number;
    } else {
      return usage("unknown argument " + arg);
    }
  }
  if (!golden_path.empty())
    return check_golden(golden_path);
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
}
