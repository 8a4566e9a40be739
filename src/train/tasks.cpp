#include "tasks.h"
#include "core/base/checks.h"

#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

namespace attnkit::train {

namespace {

constexpr int64_t kEvalExamples = 1024;
// The held-out set is drawn from its own stream so training draws never touch it.
constexpr uint64_t kEvalSeedOffset = 0x5eed5eedULL;
constexpr int64_t kMaxLength = 512;

// Symbols 1..kSymbols are data; 0 is the separator of the copy task.
constexpr int64_t kSymbols = 10;

at::Generator make_generator(uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

torch::Tensor random_symbols(int64_t batch, int64_t length, at::Generator& generator) {
  return torch::randint(1, kSymbols + 1, {batch, length}, generator, torch::kInt64);
}

// Draws kEvalExamples with the task's own sampler from a separate seeded stream.
std::vector<Batch> fixed_eval_set(const Task& task, uint64_t seed, int64_t batch_size) {
  auto generator = make_generator(seed + kEvalSeedOffset);
  std::vector<Batch> batches;
  for (int64_t done = 0; done < kEvalExamples; done += batch_size) {
    batches.push_back(task.train_batch(std::min(batch_size, kEvalExamples - done), generator));
  }
  return batches;
}

// Tasks drawn from a seed: `length` symbols (or pairs), held-out set from `seed`.
class GeneratedTask : public Task {
 public:
  GeneratedTask(int64_t length, uint64_t seed) : length_(length), seed_(seed) {}
  std::vector<Batch> eval_batches(int64_t batch_size) const override {
    return fixed_eval_set(*this, seed_, batch_size);
  }

 protected:
  int64_t length_;
  uint64_t seed_;
};

class CopyTask : public GeneratedTask {
 public:
  using GeneratedTask::GeneratedTask;
  std::string name() const override { return "copy"; }
  bool causal() const override { return true; }
  int64_t vocab_size() const override { return kSymbols + 1; }
  int64_t input_length() const override { return 2 * length_; }

  Batch train_batch(int64_t batch_size, at::Generator& generator) const override {
    const auto symbols = random_symbols(batch_size, length_, generator);
    const auto separator = torch::zeros({batch_size, 1}, torch::kInt64);
    // (b, 2n + 1): symbols, separator, symbols again; predict each next token.
    const auto sequence = torch::cat({symbols, separator, symbols}, 1);
    auto loss_mask = torch::zeros({batch_size, 2 * length_}, torch::kBool);
    loss_mask.slice(1, length_).fill_(true);  // only the copied half is scored
    return {sequence.slice(1, 0, -1), sequence.slice(1, 1), loss_mask, {}};
  }
  std::string token_label(int64_t token) const override {
    return token == 0 ? "|" : std::to_string(token - 1);
  }
};

class ReverseTask : public GeneratedTask {
 public:
  using GeneratedTask::GeneratedTask;
  std::string name() const override { return "reverse"; }
  bool causal() const override { return false; }
  int64_t vocab_size() const override { return kSymbols + 1; }
  int64_t input_length() const override { return length_; }

  Batch train_batch(int64_t batch_size, at::Generator& generator) const override {
    const auto symbols = random_symbols(batch_size, length_, generator);
    // Output position i is input position n - 1 - i.
    return {symbols, symbols.flip({1}), torch::ones({batch_size, length_}, torch::kBool), {}};
  }
  std::string token_label(int64_t token) const override { return std::to_string(token - 1); }
};

class RecallTask : public GeneratedTask {
 public:
  // Keys are tokens 0..kKeys-1, values kKeys..kKeys+kValues-1.
  static constexpr int64_t kKeys = 16;
  static constexpr int64_t kValues = 16;

  using GeneratedTask::GeneratedTask;
  std::string name() const override { return "recall"; }
  bool causal() const override { return true; }
  int64_t vocab_size() const override { return kKeys + kValues; }
  int64_t input_length() const override { return 2 * length_ + 1; }

  Batch train_batch(int64_t batch_size, at::Generator& generator) const override {
    // Distinct keys per sequence: the first `pairs` of a random permutation of the keys.
    const auto keys = torch::rand({batch_size, kKeys}, generator, torch::kFloat32)
                          .argsort(/*dim=*/1, /*descending=*/false)
                          .slice(1, 0, length_);
    const auto values =
        torch::randint(kKeys, kKeys + kValues, {batch_size, length_}, generator, torch::kInt64);
    const auto asked = torch::randint(0, length_, {batch_size, 1}, generator, torch::kInt64);
    // (b, pairs, 2) -> (b, 2 * pairs): k1 v1 k2 v2 ..., then the asked key.
    const auto pairs = torch::stack({keys, values}, 2).reshape({batch_size, 2 * length_});
    const auto inputs = torch::cat({pairs, keys.gather(1, asked)}, 1);
    auto targets = torch::zeros_like(inputs);
    targets.select(1, 2 * length_).copy_(values.gather(1, asked).squeeze(1));
    auto loss_mask = torch::zeros_like(inputs, torch::kBool);
    loss_mask.select(1, 2 * length_).fill_(true);  // only the answer is scored
    return {inputs, targets, loss_mask, {}};
  }
  std::string token_label(int64_t token) const override {
    return token < kKeys ? std::string(1, static_cast<char>('a' + token))
                         : std::to_string(token - kKeys);
  }
};

class TextTask : public Task {
 public:
  TextTask(int64_t context, const std::string& path, bool pack) : context_(context) {
    attnkit::detail::check_not_directory("--data", path);
    std::ifstream file(path, std::ios::binary);
    TORCH_CHECK(file.good(), "--data: cannot read '", path, "'");
    const std::string text((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
    const auto size = static_cast<int64_t>(text.size());
    TORCH_CHECK(size > 0, "--data: '", path, "' is empty");
    const int64_t split = size * 9 / 10;  // train on the first 90%, evaluate on the rest
    TORCH_CHECK(split > context_ + 1 && size - split > context_ + 1, "--data: '", path, "' has ",
                size, " bytes; the text task needs more than ", 10 * (context_ + 2),
                " for --seq-len ", context_, " (or a smaller --seq-len)");
    const auto bytes =
        torch::from_blob(const_cast<char*>(text.data()), {size}, torch::kUInt8).to(torch::kInt64);
    train_ = bytes.slice(0, 0, split);
    validation_ = bytes.slice(0, split);
    if (pack) {
      // Document k starts after the k-th blank line: a byte's id counts the "\n\n" before it.
      const auto blank_line_ends =
          bytes.slice(0, 1).eq('\n').logical_and(bytes.slice(0, 0, -1).eq('\n'));
      const auto ids = torch::cat({torch::zeros({2}, torch::kInt64),
                                   blank_line_ends.to(torch::kInt64).cumsum(0).slice(0, 0, -1)});
      train_ids_ = ids.slice(0, 0, split);
      validation_ids_ = ids.slice(0, split);
    }
    compute_entropies(text, split);
  }
  std::string name() const override { return "text"; }
  bool causal() const override { return true; }
  int64_t vocab_size() const override { return 256; }
  int64_t input_length() const override { return context_; }

  Batch train_batch(int64_t batch_size, at::Generator& generator) const override {
    const auto starts =
        torch::randint(0, train_.size(0) - context_ - 1, {batch_size, 1}, generator, torch::kInt64);
    return window(train_, train_ids_, starts + torch::arange(context_ + 1));
  }
  std::vector<Batch> eval_batches(int64_t batch_size) const override {
    // Every full window of the held-out part, back to back.
    const auto windows = (validation_.size(0) - 1) / context_;
    std::vector<Batch> batches;
    for (int64_t first = 0; first < windows; first += batch_size) {
      const auto count = std::min(batch_size, windows - first);
      const auto starts = (torch::arange(first, first + count) * context_).unsqueeze(1);
      batches.push_back(window(validation_, validation_ids_, starts + torch::arange(context_ + 1)));
    }
    return batches;
  }
  double unigram_entropy() const override { return unigram_; }
  double bigram_entropy() const override { return bigram_; }
  std::string token_label(int64_t token) const override {
    if (token == ' ')
      return "_";
    if (token == '\n')
      return "\\n";
    return token >= 33 && token < 127 ? std::string(1, static_cast<char>(token)) : "?";
  }

 private:
  // Windows of `source` at `index` (b, n + 1); with document ids, packed rows.
  Batch window(const torch::Tensor& source, const torch::Tensor& ids,
               const torch::Tensor& index) const {
    const auto tokens = source.index({index});  // (b, n + 1)
    Batch batch{tokens.slice(1, 0, -1),
                tokens.slice(1, 1),
                torch::ones({tokens.size(0), context_}, torch::kBool),
                {}};
    if (ids.defined()) {
      const auto token_ids = ids.index({index});  // (b, n + 1)
      batch.document_ids = token_ids.slice(1, 0, -1);
      // A document's first byte has no context in its own document: not scored.
      batch.loss_mask = token_ids.slice(1, 1).eq(batch.document_ids);
    }
    return batch;
  }

  // Add-one estimates over the corpus alphabet, fit on the training part and measured on
  // the held-out part: the baselines a model that learns should beat.
  void compute_entropies(const std::string& text, int64_t split) {
    const std::set<unsigned char> alphabet(text.begin(), text.end());
    const double v = static_cast<double>(alphabet.size());
    std::map<unsigned char, double> unigram;
    std::map<std::pair<unsigned char, unsigned char>, double> bigram;
    for (int64_t i = 0; i < split; ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      unigram[c] += 1;
      if (i + 1 < split)
        bigram[{c, static_cast<unsigned char>(text[i + 1])}] += 1;
    }
    double unigram_bits = 0, bigram_bits = 0;
    const auto size = static_cast<int64_t>(text.size());
    for (int64_t i = split; i < size; ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      unigram_bits -= std::log2((unigram[c] + 1) / (split + v));
      if (i + 1 < size) {
        const auto next = static_cast<unsigned char>(text[i + 1]);
        bigram_bits -= std::log2((bigram[{c, next}] + 1) / (unigram[c] + v));
      }
    }
    unigram_ = unigram_bits / static_cast<double>(size - split);
    bigram_ = bigram_bits / static_cast<double>(size - split - 1);
  }

  int64_t context_;
  torch::Tensor train_;
  torch::Tensor validation_;
  torch::Tensor train_ids_, validation_ids_;  // each byte's document (--pack), else undefined
  double unigram_ = 0, bigram_ = 0;
};

}  // namespace

std::string Task::token_label(int64_t token) const {
  return std::to_string(token);
}

int64_t default_task_length(const std::string& task) {
  if (task == "recall")
    return 4;
  if (task == "text")
    return 64;
  return 8;
}

std::unique_ptr<Task> make_task(const std::string& name, int64_t length, uint64_t seed,
                                const std::string& data_path, bool pack) {
  TORCH_CHECK(name == "copy" || name == "reverse" || name == "recall" || name == "text",
              "--task: unknown task '", name, "'; expected copy, reverse, recall or text");
  const int64_t max_length = name == "recall" ? RecallTask::kKeys : kMaxLength;
  TORCH_CHECK(length >= 1 && length <= max_length, "--seq-len: expected 1..", max_length,
              " for task ", name, ", got ", length);
  TORCH_CHECK(!pack || name == "text",
              "--pack: only the text task has documents to pack, got --task ", name);
  if (name == "copy")
    return std::make_unique<CopyTask>(length, seed);
  if (name == "reverse")
    return std::make_unique<ReverseTask>(length, seed);
  if (name == "recall")
    return std::make_unique<RecallTask>(length, seed);
  return std::make_unique<TextTask>(length, data_path, pack);
}

}  // namespace attnkit::train
