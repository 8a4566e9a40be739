// encoder_decoder: a small transformer in the shape of seed 001's (an encoder over the
// source, a decoder with causal self-attention and cross-attention to the encoder's output,
// post-LayerNorm residual blocks, sinusoidal positions), built from attnkit::MultiHeadAttention
// and trained to reverse digit strings of different lengths.
//
//   encoder_decoder [--steps 1000] [--seed 1]
//
// The source batch is right-padded, and the encoder and the cross-attention see it through
// attnkit::Mask::key_padding(lengths); the decoder's self-attention is the module's own
// causal mask. Prints the loss as it falls, then the exact-match accuracy of greedy decoding
// on new strings; exits 1 below 90%, so a test can tell that the model learns.

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

// Tokens: 0 padding, 1 begin, 2 end, 3..12 the digits 0..9.
constexpr int64_t kPad = 0, kBegin = 1, kEnd = 2, kFirstDigit = 3, kVocab = 13;
constexpr int64_t kMinLength = 3, kMaxLength = 10;  // digits per string
constexpr int64_t kContext = kMaxLength + 2;        // with begin and end
constexpr int64_t kWidth = 64, kHeads = 4, kLayers = 2, kBatch = 64;
constexpr double kLearningRate = 3e-3;  // the peak

attnkit::MultiHeadAttention attention(bool causal) {
  return attnkit::MultiHeadAttention(
      attnkit::MultiHeadAttentionOptions(kWidth, kWidth, kContext, 0.0, kHeads).causal(causal));
}

torch::nn::Sequential feed_forward() {
  return torch::nn::Sequential(torch::nn::Linear(kWidth, 4 * kWidth), torch::nn::ReLU(),
                               torch::nn::Linear(4 * kWidth, kWidth));
}

torch::nn::LayerNorm norm() {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth}));
}

// Seed 001's encoder layer: x = norm(x + self_attention(x)); x = norm(x + ffn(x)).
struct EncoderLayerImpl : torch::nn::Module {
  EncoderLayerImpl()
      : self_attention(register_module("self_attention", attention(/*causal=*/false))),
        norm1(register_module("norm1", norm())),
        ffn(register_module("ffn", feed_forward())),
        norm2(register_module("norm2", norm())) {}

  // x (b, n, d); source_padding: which source keys are padding.
  torch::Tensor forward(torch::Tensor x, const attnkit::Mask& source_padding) {
    x = norm1(x + self_attention->forward(x, {}, {}, source_padding));
    return norm2(x + ffn->forward(x));
  }

  attnkit::MultiHeadAttention self_attention;
  torch::nn::LayerNorm norm1;
  torch::nn::Sequential ffn;
  torch::nn::LayerNorm norm2;
};
TORCH_MODULE(EncoderLayer);

// Seed 001's decoder layer: causal self-attention, then cross-attention whose keys and values
// come from the encoder's output (memory), then the feed-forward block, each post-norm.
struct DecoderLayerImpl : torch::nn::Module {
  DecoderLayerImpl()
      : self_attention(register_module("self_attention", attention(/*causal=*/true))),
        norm1(register_module("norm1", norm())),
        cross_attention(register_module("cross_attention", attention(/*causal=*/false))),
        norm2(register_module("norm2", norm())),
        ffn(register_module("ffn", feed_forward())),
        norm3(register_module("norm3", norm())) {}

  // y (b, m, d) target so far; memory (b, n, d).
  torch::Tensor forward(torch::Tensor y, const torch::Tensor& memory,
                        const attnkit::Mask& source_padding) {
    y = norm1(y + self_attention(y));
    y = norm2(y + cross_attention->forward(y, memory, memory, source_padding));
    return norm3(y + ffn->forward(y));
  }

  attnkit::MultiHeadAttention self_attention;
  torch::nn::LayerNorm norm1;
  attnkit::MultiHeadAttention cross_attention;
  torch::nn::LayerNorm norm2;
  torch::nn::Sequential ffn;
  torch::nn::LayerNorm norm3;
};
TORCH_MODULE(DecoderLayer);

// Sinusoidal position encoding (Vaswani et al., as in seed 001): (kContext, kWidth).
torch::Tensor position_encoding() {
  const auto position = torch::arange(kContext, torch::kFloat).unsqueeze(1);   // (n, 1)
  const auto even = torch::arange(0, kWidth, 2, torch::kFloat);                // (d / 2)
  const auto angle = position / torch::pow(10000.0, even / double(kWidth));    // (n, d / 2)
  return torch::stack({torch::sin(angle), torch::cos(angle)}, -1).flatten(1);  // (n, d)
}

struct TransformerImpl : torch::nn::Module {
  TransformerImpl()
      : source_embedding(register_module("source_embedding", torch::nn::Embedding(kVocab, kWidth))),
        target_embedding(register_module("target_embedding", torch::nn::Embedding(kVocab, kWidth))),
        encoder(register_module("encoder", torch::nn::ModuleList())),
        decoder(register_module("decoder", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(kWidth, kVocab))),
        positions(register_buffer("positions", position_encoding())) {
    for (int64_t i = 0; i < kLayers; ++i) {
      encoder->push_back(EncoderLayer());
      decoder->push_back(DecoderLayer());
    }
  }

  torch::Tensor embed(torch::nn::Embedding& embedding, const torch::Tensor& tokens) {
    return embedding(tokens) * std::sqrt(double(kWidth)) + positions.slice(0, 0, tokens.size(1));
  }

  // source (b, n) right-padded with lengths (b) -> memory (b, n, d)
  torch::Tensor encode(const torch::Tensor& source, const attnkit::Mask& source_padding) {
    auto x = embed(source_embedding, source);
    for (auto& layer : *encoder)
      x = layer->as<EncoderLayerImpl>()->forward(x, source_padding);
    return x;
  }

  // target (b, m) -> logits (b, m, vocab)
  torch::Tensor decode(const torch::Tensor& target, const torch::Tensor& memory,
                       const attnkit::Mask& source_padding) {
    auto y = embed(target_embedding, target);
    for (auto& layer : *decoder)
      y = layer->as<DecoderLayerImpl>()->forward(y, memory, source_padding);
    return head(y);
  }

  torch::nn::Embedding source_embedding, target_embedding;
  torch::nn::ModuleList encoder, decoder;
  torch::nn::Linear head;
  torch::Tensor positions;
};
TORCH_MODULE(Transformer);

struct Batch {
  torch::Tensor source;   // (b, kMaxLength) digits, right-padded
  torch::Tensor lengths;  // (b) digits per row
  torch::Tensor target;   // (b, kContext): begin, the digits reversed, end, padding
};

Batch random_batch(int64_t batch) {
  const auto lengths = torch::randint(kMinLength, kMaxLength + 1, {batch}, torch::kInt64);
  const auto digits = torch::randint(kFirstDigit, kFirstDigit + 10, {batch, kMaxLength});
  const auto index = torch::arange(kMaxLength).unsqueeze(0);  // (1, kMaxLength)
  const auto valid = index < lengths.unsqueeze(1);
  const auto source = torch::where(valid, digits, torch::full_like(digits, kPad));
  // Reversed: target digit i is source digit length - 1 - i.
  const auto from = (lengths.unsqueeze(1) - 1 - index).clamp_min(0);
  const auto reversed = torch::where(valid, digits.gather(1, from), torch::full_like(digits, kPad));
  auto target = torch::full({batch, kContext}, kPad, torch::kInt64);
  target.select(1, 0).fill_(kBegin);
  target.slice(1, 1, 1 + kMaxLength).copy_(reversed);
  target.scatter_(1, (lengths + 1).unsqueeze(1), kEnd);
  return {source, lengths, target};
}

// Greedy decoding from begin, kMaxLength + 1 steps, recomputing the decoder each step.
torch::Tensor greedy(Transformer& model, const Batch& batch) {
  const auto padding = attnkit::Mask::key_padding(batch.lengths);
  const auto memory = model->encode(batch.source, padding);
  auto output = torch::full({batch.source.size(0), 1}, kBegin, torch::kInt64);
  for (int64_t step = 0; step < kMaxLength + 1; ++step) {
    const auto logits = model->decode(output, memory, padding);  // (b, steps, vocab)
    output = torch::cat({output, logits.select(1, -1).argmax(-1, true)}, 1);
  }
  return output;
}

int usage(const std::string& message) {
  std::cerr << "encoder_decoder: " << message
            << "\nusage: encoder_decoder [--steps N] [--seed N]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps = 1000;
  int64_t seed = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << "encoder_decoder: seed 001's transformer on attnkit, learning to reverse "
                   "digit strings\nusage: encoder_decoder [--steps N] [--seed N]\n";
      return 0;
    }
    if (arg != "--steps" && arg != "--seed")
      return usage("unknown argument " + arg);
    if (i + 1 >= argc)
      return usage("missing value for " + arg);
    char* end = nullptr;
    const long long number = std::strtoll(argv[++i], &end, 10);
    if (*end != '\0' || number < 0)
      return usage(arg + " needs a number >= 0");
    (arg == "--steps" ? steps : seed) = number;
  }
  torch::manual_seed(seed);
  Transformer model;
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(kLearningRate));
  std::cout << "encoder_decoder: " << kLayers << " encoder and " << kLayers
            << " decoder layers of attnkit::MultiHeadAttention (" << kHeads << " heads, d "
            << kWidth << "), reversing " << kMinLength << ".." << kMaxLength << " digits\n";
  double first_loss = 0.0;
  for (int64_t step = 1; step <= steps; ++step) {
    model->train();
    const auto batch = random_batch(kBatch);
    const auto padding = attnkit::Mask::key_padding(batch.lengths);
    // Teacher forcing: the decoder reads target[:, :-1] and predicts target[:, 1:].
    const auto logits =
        model->decode(batch.target.slice(1, 0, -1), model->encode(batch.source, padding), padding);
    const auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, kVocab}), batch.target.slice(1, 1).reshape(-1),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kPad));
    optimizer.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    // Linear warm-up over 50 steps, then linear decay to 0: post-norm layers train unsteadily
    // at a constant rate, and the decay lets the last steps settle.
    const double rate = kLearningRate * std::min(double(step) / 50.0,
                                                 double(steps - step + 1) / double(steps - 49));
    for (auto& group : optimizer.param_groups())
      static_cast<torch::optim::AdamOptions&>(group.options()).lr(rate);
    optimizer.step();
    if (step == 1)
      first_loss = loss.item<double>();
    if (step == 1 || step % 100 == 0 || step == steps)
      std::cout << "step " << step << " | loss " << loss.item<double>() << "\n";
  }
  torch::NoGradGuard no_grad;
  model->eval();
  const auto test = random_batch(500);
  const auto decoded = greedy(model, test);  // (b, 1 + kMaxLength + 1)
  // A row is right when every position up to and including its end token matches.
  const auto positions = torch::arange(kContext).unsqueeze(0);
  const auto compared = positions <= (test.lengths + 1).unsqueeze(1);
  const auto right = ((decoded == test.target) | ~compared).all(1);
  const double accuracy = right.to(torch::kDouble).mean().item<double>();
  std::cout << "exact-match accuracy on 500 new strings: " << 100.0 * accuracy << "%\n";
  const auto* source = test.source[0].data_ptr<int64_t>();
  const auto* output = decoded[0].data_ptr<int64_t>();
  std::string shown_source, shown_output;
  for (int64_t i = 0; i < test.lengths[0].item<int64_t>(); ++i) {
    shown_source += char('0' + source[i] - kFirstDigit);
    shown_output += char('0' + output[i + 1] - kFirstDigit);
  }
  std::cout << "example: " << shown_source << " -> " << shown_output << std::endl;
  if (steps > 0 && accuracy < 0.9) {
    std::cerr << "encoder_decoder: accuracy " << 100.0 * accuracy << "% is below 90% (first loss "
              << first_loss << ")\n";
    return 1;
  }
  return 0;
}
