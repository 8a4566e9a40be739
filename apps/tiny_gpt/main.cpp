// tiny_gpt: a small byte-level GPT whose decoder blocks use attnkit::MultiHeadAttention,
// trained for a few hundred steps on a text file and then sampled with attnkit::generate
// and the attention layers' KV caches.
//
//   tiny_gpt --data the-verdict.txt [--steps 300] [--sample 200] [--seed 1]
//
// Prints the training loss as it falls, the held-out loss, and a sample. Exits 1 if the
// loss did not fall, so a test can tell that the model learns.

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

namespace {

constexpr int64_t kVocab = 256;   // bytes
constexpr int64_t kContext = 64;  // tokens per training sequence
constexpr int64_t kModelWidth = 64;
constexpr int64_t kHeads = 4;
constexpr int64_t kLayers = 2;
constexpr int64_t kBatch = 32;
constexpr double kLearningRate = 3e-3;

// Pre-LayerNorm decoder block: x + attention(norm(x)), then x + feed_forward(norm(x)).
struct DecoderBlockImpl : torch::nn::Module {
  explicit DecoderBlockImpl(double dropout)
      : attention_norm(register_module(
            "attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModelWidth})))),
        attention(register_module(
            "attention",
            attnkit::MultiHeadAttention(kModelWidth, kModelWidth, kContext, dropout, kHeads))),
        feed_forward_norm(register_module(
            "feed_forward_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModelWidth})))),
        feed_forward(register_module(
            "feed_forward", torch::nn::Sequential(
                                torch::nn::Linear(kModelWidth, 4 * kModelWidth), torch::nn::GELU(),
                                torch::nn::Linear(4 * kModelWidth, kModelWidth)))) {}

  torch::Tensor forward(torch::Tensor x) {  // (b, n, d) -> (b, n, d)
    x = x + attention(attention_norm(x));
    return x + feed_forward->forward(feed_forward_norm(x));
  }

  // The same for the next tokens of a sequence whose earlier keys and values are in `cache`.
  torch::Tensor forward_with_cache(torch::Tensor x, attnkit::KVCache& cache) {
    x = x + attention->forward_with_cache(attention_norm(x), cache);
    return x + feed_forward->forward(feed_forward_norm(x));
  }

  torch::nn::LayerNorm attention_norm;
  attnkit::MultiHeadAttention attention;
  torch::nn::LayerNorm feed_forward_norm;
  torch::nn::Sequential feed_forward;
};
TORCH_MODULE(DecoderBlock);

// A torch::nn::Module and an attnkit::CausalLanguageModel, so attnkit::generate can decode it.
struct TinyGptImpl : torch::nn::Module, attnkit::CausalLanguageModel {
  explicit TinyGptImpl(double dropout)
      : token_embedding(
            register_module("token_embedding", torch::nn::Embedding(kVocab, kModelWidth))),
        position_embedding(
            register_module("position_embedding", torch::nn::Embedding(kContext, kModelWidth))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        final_norm(register_module(
            "final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kModelWidth})))),
        head(register_module("head", torch::nn::Linear(kModelWidth, kVocab))) {
    for (int64_t i = 0; i < kLayers; ++i) {
      blocks->push_back(DecoderBlock(dropout));
    }
  }

  torch::Tensor forward(const torch::Tensor& tokens) {  // (b, n) -> logits (b, n, vocab)
    auto x = embed(tokens, 0);
    for (auto& block : *blocks) {
      x = block->as<DecoderBlockImpl>()->forward(x);
    }
    return head(final_norm(x));
  }

  // attnkit::CausalLanguageModel
  torch::Tensor logits(const torch::Tensor& tokens) override { return forward(tokens); }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<attnkit::KVCache>& caches) override {
    auto x = embed(tokens, caches.front().size());  // positions continue where the cache is
    for (size_t i = 0; i < caches.size(); ++i) {
      x = blocks[i]->as<DecoderBlockImpl>()->forward_with_cache(x, caches[i]);
    }
    return head(final_norm(x));
  }
  std::vector<attnkit::KVCache> make_kv_caches(int64_t batch, int64_t capacity) override {
    std::vector<attnkit::KVCache> caches;
    for (auto& block : *blocks) {
      caches.push_back(block->as<DecoderBlockImpl>()->attention->make_kv_cache(batch, capacity));
    }
    return caches;
  }
  int64_t context_length() const override { return kContext; }

  // Token plus position embeddings of tokens (b, n) at positions [start, start + n).
  torch::Tensor embed(const torch::Tensor& tokens, int64_t start) {
    const auto positions = torch::arange(start, start + tokens.size(1), tokens.options());
    return token_embedding(tokens) + position_embedding(positions);
  }

  torch::nn::Embedding token_embedding, position_embedding;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm final_norm;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyGpt);

// Random (inputs, next-byte targets) windows of `data`, each (kBatch, kContext).
std::pair<torch::Tensor, torch::Tensor> batch_from(const torch::Tensor& data) {
  const auto starts = torch::randint(data.size(0) - kContext - 1, {kBatch});
  const auto offsets = torch::arange(kContext + 1);
  const auto windows = data.index({starts.unsqueeze(1) + offsets});  // (b, n + 1)
  return {windows.slice(1, 0, kContext), windows.slice(1, 1)};
}

torch::Tensor loss_of(TinyGpt& model, const torch::Tensor& inputs, const torch::Tensor& targets) {
  const auto logits = model(inputs);  // (b, n, vocab) -> (b * n, vocab)
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape(-1));
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

constexpr const char* kUsage = "usage: tiny_gpt --data FILE [--steps N] [--sample N] [--seed N]";

int usage(const std::string& message) {
  std::cerr << "tiny_gpt: " << message << "\n" << kUsage << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string data_path;
  int64_t steps = 300;
  int64_t sample_length = 200;
  int64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << "tiny_gpt: a byte-level GPT on attnkit::MultiHeadAttention\n" << kUsage << "\n";
      return 0;
    }
    if (i + 1 >= argc)
      return usage("missing value for " + arg);
    const std::string value = argv[++i];
    if (arg == "--data") {
      data_path = value;
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
  if (data_path.empty())
    return usage("--data is required");
  std::ifstream file(data_path, std::ios::binary);
  if (!file)
    return usage("cannot read " + data_path);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(text.size()) < 10 * (kContext + 1)) {
    return usage("too little text in " + data_path);
  }

  torch::manual_seed(seed);
  const auto bytes = torch::from_blob(const_cast<char*>(text.data()),
                                      {static_cast<int64_t>(text.size())}, torch::kUInt8)
                         .to(torch::kInt64);
  const auto split = bytes.size(0) * 9 / 10;  // train on the first 90%, validate on the rest
  const auto train = bytes.slice(0, 0, split);
  const auto validation = bytes.slice(0, split);

  TinyGpt model(/*dropout=*/0.0);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(kLearningRate));
  std::cout << "tiny_gpt: " << kLayers << " decoder blocks of attnkit::MultiHeadAttention ("
            << kHeads << " heads, d_model " << kModelWidth << "), " << text.size() << " bytes of "
            << data_path << "\n";

  double first_loss = 0.0;
  double recent_loss = 0.0;
  for (int64_t step = 1; step <= steps; ++step) {
    model->train();
    const auto [inputs, targets] = batch_from(train);
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
    const auto [inputs, targets] = batch_from(validation);
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
}
