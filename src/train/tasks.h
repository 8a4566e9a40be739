#pragma once

/// Toy sequence tasks for attnkit-train: generated from a seed (copy, reverse, recall) or
/// read from a text file (text), each with a held-out evaluation set.

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace attnkit::train {

/// A batch of token sequences: predict `targets` from `inputs`, scored where `loss_mask`.
struct Batch {
  /// (b, n) int64 token ids.
  torch::Tensor inputs;
  /// (b, n) int64 token ids.
  torch::Tensor targets;
  /// (b, n) bool: the positions that count in loss and accuracy.
  torch::Tensor loss_mask;
  /// (b, n) int64: each input token's document, for packed rows (text --pack); undefined
  /// otherwise. A token attends only within its document (Mask::documents).
  torch::Tensor document_ids;
};

/// One task. `length` is its size parameter: tokens to copy or reverse, key-value pairs to
/// recall, bytes of context for text.
class Task {
 public:
  virtual ~Task() = default;
  /// "copy", "reverse", "recall" or "text".
  virtual std::string name() const = 0;
  /// Whether a token may only look at earlier tokens (decoder) or at all (encoder).
  virtual bool causal() const = 0;
  /// Number of distinct token ids.
  virtual int64_t vocab_size() const = 0;
  /// Tokens per input sequence (the attention's context_length).
  virtual int64_t input_length() const = 0;
  /// A fresh training batch drawn with `generator`.
  virtual Batch train_batch(int64_t batch_size, at::Generator& generator) const = 0;
  /// The fixed held-out set, in batches of at most `batch_size`.
  virtual std::vector<Batch> eval_batches(int64_t batch_size) const = 0;
  /// Text only: entropies of the corpus for comparison (bits per byte); 0 otherwise.
  virtual double unigram_entropy() const { return 0.0; }
  virtual double bigram_entropy() const { return 0.0; }
  /// How a token prints on an attention heatmap axis.
  virtual std::string token_label(int64_t token) const;
};

/// Default `length` of each task (copy 8, reverse 8, recall 4, text 64).
int64_t default_task_length(const std::string& task);

/// Builds a task; `seed` fixes the held-out set; `data_path` is read for "text". With `pack`
/// (text only), the corpus is a series of documents, its paragraphs (a blank line ends one),
/// and each row packs the documents its window covers: batches carry document_ids, each
/// document's first byte is not predicted from the one before it.
/// Fails with a one-line c10::Error on an unknown task, a bad length or an unusable file.
std::unique_ptr<Task> make_task(const std::string& name, int64_t length, uint64_t seed,
                                const std::string& data_path, bool pack = false);

}  // namespace attnkit::train
