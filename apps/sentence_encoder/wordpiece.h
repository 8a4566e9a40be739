#pragma once

// BERT's tokenizer in C++: the text normalised and split as Hugging Face's `tokenizers`
// (BertNormalizer, BertPreTokenizer) does it, then WordPiece over a `vocab.txt`, with
// [CLS] ... [SEP] around and the special tokens' own spellings kept whole. Unicode
// (lowercasing, accents, categories) comes from ICU, so the ids equal the `tokenizers`
// package's for any text, not only ASCII (checked on 240 sentences: scripts/check_minilm.py).

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace sentence_encoder {

class WordPieceTokenizer {
 public:
  /// Reads `vocab.txt`: one token per line, its id its line number from 0. Needs [PAD],
  /// [UNK], [CLS], [SEP] and [MASK]. Throws std::runtime_error naming the file and the token.
  explicit WordPieceTokenizer(const std::string& vocab_path);

  /// The ids of `text` (UTF-8) with [CLS] first and [SEP] last, at most `max_tokens` of them
  /// (the words past the limit are cut, as the `tokenizers` package truncates). Throws
  /// std::invalid_argument when `text` is not UTF-8 or `max_tokens` < 2.
  std::vector<int64_t> encode(const std::string& text, int64_t max_tokens) const;

  int64_t pad_id() const { return pad_id_; }
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }

 private:
  // The pieces of one word (already normalised), or [UNK] alone when it has none.
  void word_pieces(const std::u32string& word, std::vector<int64_t>& ids) const;
  // Normalises `text` (no special tokens inside) and appends its words' pieces.
  void encode_plain(const std::string& text, std::vector<int64_t>& ids) const;
  int64_t id_of(const std::string& token, const std::string& vocab_path) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::pair<std::string, int64_t>> special_;  // "[CLS]" -> 101, ...
  int64_t pad_id_ = 0, unk_id_ = 0, cls_id_ = 0, sep_id_ = 0;
};

}  // namespace sentence_encoder
