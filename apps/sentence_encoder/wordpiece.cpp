#include "wordpiece.h"

#include <fstream>
#include <stdexcept>

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>
#include <unicode/utf8.h>

namespace sentence_encoder {

namespace {

// WordPiece's limit: a longer word is [UNK] (max_input_chars_per_word in tokenizer.json).
constexpr size_t kMaxWordChars = 100;
const std::string kSubwordPrefix = "##";

std::u32string decode_utf8(const std::string& text) {
  std::u32string out;
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const auto length = static_cast<int32_t>(text.size());
  for (int32_t i = 0; i < length;) {
    const int32_t at = i;
    UChar32 c;
    U8_NEXT(bytes, i, length, c);
    if (c < 0)
      throw std::invalid_argument("text is not UTF-8 (byte " + std::to_string(at) + ")");
    out.push_back(static_cast<char32_t>(c));
  }
  return out;
}

std::string encode_utf8(const std::u32string& text, size_t begin = 0) {
  std::string out;
  for (size_t i = begin; i < text.size(); ++i) {
    uint8_t buffer[U8_MAX_LENGTH];
    int32_t length = 0;
    U8_APPEND_UNSAFE(buffer, length, static_cast<UChar32>(text[i]));
    out.append(reinterpret_cast<const char*>(buffer), length);
  }
  return out;
}

bool is_whitespace(char32_t c) {
  return c == U'\t' || c == U'\n' || c == U'\r' || u_hasBinaryProperty(c, UCHAR_WHITE_SPACE);
}

// Controls, formats, surrogates and private use (Cc, Cf, Cs, Co) except the three whitespace
// controls. Unassigned code points (Cn) stay, as in the `tokenizers` package, whose tables
// list no Cn: a word holding one becomes [UNK].
bool is_control(char32_t c) {
  if (c == U'\t' || c == U'\n' || c == U'\r')
    return false;
  switch (u_charType(c)) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
      return true;
    default:
      return false;
  }
}

// ASCII punctuation (which counts $, +, <, =, >, ^, `, |, ~ that Unicode calls symbols) or any
// Unicode punctuation category.
bool is_punctuation(char32_t c) {
  const bool ascii = (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
                     (c >= 123 && c <= 126);
  return ascii || u_ispunct(c);
}

// The CJK blocks that BERT splits into single characters.
bool is_chinese(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// BertNormalizer with clean_text, handle_chinese_chars, strip_accents and lowercase, in its
// order.
std::u32string normalize(const std::u32string& text) {
  std::u32string cleaned;
  for (char32_t c : text) {
    if (c == 0 || c == 0xFFFD || is_control(c))
      continue;
    if (is_chinese(c)) {
      cleaned += U' ';
      cleaned += c;
      cleaned += U' ';
    } else {
      cleaned += is_whitespace(c) ? U' ' : c;
    }
  }
  // Accents: decomposed (NFD), then the nonspacing marks dropped.
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(status);
  const auto source = icu::UnicodeString::fromUTF32(
      reinterpret_cast<const UChar32*>(cleaned.data()), static_cast<int32_t>(cleaned.size()));
  const icu::UnicodeString decomposed = nfd->normalize(source, status);
  if (U_FAILURE(status))
    throw std::runtime_error(std::string("ICU's NFD failed: ") + u_errorName(status));
  std::u32string out;
  for (int32_t i = 0; i < decomposed.length(); i = decomposed.moveIndex32(i, 1)) {
    const UChar32 c = decomposed.char32At(i);
    if (u_charType(c) == U_NON_SPACING_MARK)
      continue;
    // Each character lowercased alone (full mappings, as Rust's char::to_lowercase: no
    // context, so a final sigma stays σ).
    UChar in[2];
    int32_t in_length = 0;
    U16_APPEND_UNSAFE(in, in_length, c);
    UChar lower[8];
    UErrorCode lower_status = U_ZERO_ERROR;
    const int32_t lower_length = u_strToLower(lower, 8, in, in_length, "", &lower_status);
    if (U_FAILURE(lower_status))
      throw std::runtime_error(std::string("ICU's lowercase failed: ") + u_errorName(lower_status));
    for (int32_t j = 0; j < lower_length;) {
      UChar32 l;
      U16_NEXT(lower, j, lower_length, l);
      out.push_back(static_cast<char32_t>(l));
    }
  }
  return out;
}

}  // namespace

WordPieceTokenizer::WordPieceTokenizer(const std::string& vocab_path) {
  std::ifstream in(vocab_path);
  if (!in)
    throw std::runtime_error("cannot open the vocabulary '" + vocab_path + "'");
  std::string line;
  int64_t id = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    vocab_.emplace(line, id++);  // a repeated token keeps its first id, as `tokenizers` does
  }
  pad_id_ = id_of("[PAD]", vocab_path);
  unk_id_ = id_of("[UNK]", vocab_path);
  cls_id_ = id_of("[CLS]", vocab_path);
  sep_id_ = id_of("[SEP]", vocab_path);
  for (const std::string token : {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"})
    special_.emplace_back(token, id_of(token, vocab_path));
}

int64_t WordPieceTokenizer::id_of(const std::string& token, const std::string& vocab_path) const {
  const auto found = vocab_.find(token);
  if (found == vocab_.end())
    throw std::runtime_error("the vocabulary '" + vocab_path + "' has no " + token);
  return found->second;
}

void WordPieceTokenizer::word_pieces(const std::u32string& word, std::vector<int64_t>& ids) const {
  if (word.size() > kMaxWordChars) {
    ids.push_back(unk_id_);
    return;
  }
  // Greedy longest match first, from each piece's start.
  std::vector<int64_t> pieces;
  for (size_t start = 0; start < word.size();) {
    size_t end = word.size();
    int64_t piece = -1;
    for (; end > start; --end) {
      std::string candidate = encode_utf8(word.substr(start, end - start));
      if (start > 0)
        candidate = kSubwordPrefix + candidate;
      const auto found = vocab_.find(candidate);
      if (found != vocab_.end()) {
        piece = found->second;
        break;
      }
    }
    if (piece < 0) {
      ids.push_back(unk_id_);
      return;
    }
    pieces.push_back(piece);
    start = end;
  }
  ids.insert(ids.end(), pieces.begin(), pieces.end());
}

void WordPieceTokenizer::encode_plain(const std::string& text, std::vector<int64_t>& ids) const {
  // BertPreTokenizer: whitespace separates words and is dropped; each punctuation character
  // is a word of its own.
  std::u32string word;
  const auto flush = [&] {
    if (!word.empty())
      word_pieces(word, ids);
    word.clear();
  };
  for (char32_t c : normalize(decode_utf8(text))) {
    if (is_whitespace(c)) {
      flush();
    } else if (is_punctuation(c)) {
      flush();
      word_pieces(std::u32string(1, c), ids);
    } else {
      word += c;
    }
  }
  flush();
}

std::vector<int64_t> WordPieceTokenizer::encode(const std::string& text, int64_t max_tokens) const {
  if (max_tokens < 2)
    throw std::invalid_argument("max_tokens must be at least 2 ([CLS] and [SEP]), got " +
                                std::to_string(max_tokens));
  // The special tokens' spellings in the raw text are those tokens (added tokens, matched
  // before normalisation); the text between them is tokenised.
  std::vector<int64_t> ids;
  size_t from = 0;
  while (from <= text.size()) {
    size_t next = std::string::npos;
    const std::pair<std::string, int64_t>* special = nullptr;
    for (const auto& candidate : special_) {
      const size_t at = text.find(candidate.first, from);
      if (at < next) {
        next = at;
        special = &candidate;
      }
    }
    encode_plain(text.substr(from, next == std::string::npos ? std::string::npos : next - from),
                 ids);
    if (special == nullptr)
      break;
    ids.push_back(special->second);
    from = next + special->first.size();
  }
  if (static_cast<int64_t>(ids.size()) > max_tokens - 2)
    ids.resize(static_cast<size_t>(max_tokens - 2));
  ids.insert(ids.begin(), cls_id_);
  ids.push_back(sep_id_);
  return ids;
}

}  // namespace sentence_encoder
