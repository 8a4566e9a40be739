// sentence_encoder: sentence embeddings from a pretrained BERT encoder (sentence-transformers'
// all-MiniLM-L6-v2) run by attnkit's modules, from its Hugging Face files alone.
//
//   sentence_encoder --model DIR [options] "a sentence" "another sentence" ...
//   sentence_encoder --model DIR --input sentences.txt --embeddings-out out.safetensors
//
// DIR holds config.json, vocab.txt and model.safetensors (and sentence_bert_config.json for
// the token limit). See README.md for the options and a sample run; --help lists them.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include <attnkit/attnkit.h>
// A sentence is one argument, commas included: cxxopts would split list values at commas.
#define CXXOPTS_VECTOR_DELIMITER '\0'
#include <torch/torch.h>
#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include "bert_encoder.h"
#include "wordpiece.h"

namespace {

using sentence_encoder::BertConfig;
using sentence_encoder::BertEncoder;
using sentence_encoder::WordPieceTokenizer;

struct Settings {
  std::string model_dir;
  std::vector<std::string> sentences;
  int64_t batch_size = 16;
  int64_t max_tokens = 0;  // 0: the model's own limit
  torch::Dtype dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  int repeat = 1;
  std::string ids_out, embeddings_out;
  bool quiet = false;
  bool pack = false;
};

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "sentence_encoder: " << message << "\n";
  std::exit(2);
}

std::vector<std::string> read_lines(const std::string& path) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    fail("--input: '" + path + "' is a directory; expected a file of sentences, one per line");
  std::ifstream in(path);
  if (!in)
    fail("--input: cannot open '" + path + "'");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

// The model's token limit: sentence-transformers' max_seq_length where the folder has one.
int64_t model_token_limit(const std::string& dir, const BertConfig& config) {
  std::ifstream in(dir + "/sentence_bert_config.json");
  if (!in)
    return config.max_position_embeddings;
  const auto json = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!json.is_object() || !json.contains("max_seq_length") ||
      !json["max_seq_length"].is_number_integer())
    fail("'" + dir + "/sentence_bert_config.json' has no integer max_seq_length");
  return std::min(json["max_seq_length"].get<int64_t>(), config.max_position_embeddings);
}

Settings parse(int argc, char** argv) {
  cxxopts::Options options(
      "sentence_encoder",
      "Sentence embeddings from a pretrained BERT encoder (e.g. all-MiniLM-L6-v2) made of "
      "attnkit::MultiHeadAttention, loaded from its Hugging Face files.");
  options.positional_help("[SENTENCE...]");
  // clang-format off
  options.add_options()
      ("model", "folder with config.json, vocab.txt, model.safetensors (and "
                "sentence_bert_config.json)", cxxopts::value<std::string>())
      ("input", "a file of sentences, one per line (instead of SENTENCE...)",
       cxxopts::value<std::string>())
      ("batch-size", "sentences per batch (sorted by length first)",
       cxxopts::value<int64_t>()->default_value("16"))
      ("pack", "run each batch as one sequence without padding, each sentence attending to "
               "itself only (attnkit::Mask::documents); default: padded, with a key-padding "
               "mask")
      ("max-tokens", "tokens per sentence with [CLS] and [SEP], longer ones cut (default: "
                     "sentence_bert_config.json's max_seq_length, else the model's positions)",
       cxxopts::value<int64_t>())
      ("dtype", "float32 or bfloat16", cxxopts::value<std::string>()->default_value("float32"))
      ("device", "cpu or cuda", cxxopts::value<std::string>()->default_value("cpu"))
      ("threads", "CPU threads, 1 to the usable cores (default: LibTorch's choice)", cxxopts::value<int>())
      ("repeat", "encode everything this many times and report the median (timing)",
       cxxopts::value<int>()->default_value("1"))
      ("ids-out", "write each sentence's token ids, one line per sentence",
       cxxopts::value<std::string>())
      ("embeddings-out", "write the embeddings (float32, \"embeddings\": sentences x hidden) "
                         "as a safetensors file", cxxopts::value<std::string>())
      ("quiet", "print only the timing line")
      ("h,help", "this help")
      ("sentences", "", cxxopts::value<std::vector<std::string>>());
  // clang-format on
  options.parse_positional({"sentences"});
  cxxopts::ParseResult result;
  try {
    result = options.parse(argc, argv);
  } catch (const std::exception& error) {
    fail(std::string(error.what()) + " (see --help)");
  }
  if (result.count("help")) {
    std::cout << options.help() << "\n";
    std::exit(0);
  }
  Settings settings;
  if (!result.count("model"))
    fail("--model DIR is required: the folder of config.json, vocab.txt and model.safetensors");
  settings.model_dir = result["model"].as<std::string>();
  if (result.count("input")) {
    if (result.count("sentences"))
      fail("give sentences either as arguments or with --input, not both");
    settings.sentences = read_lines(result["input"].as<std::string>());
  } else if (result.count("sentences")) {
    settings.sentences = result["sentences"].as<std::vector<std::string>>();
  }
  if (settings.sentences.empty())
    fail("no sentences: pass them as arguments or with --input FILE");
  settings.batch_size = result["batch-size"].as<int64_t>();
  if (settings.batch_size < 1)
    fail("--batch-size: expected at least 1, got " + std::to_string(settings.batch_size));
  if (result.count("max-tokens"))
    settings.max_tokens = result["max-tokens"].as<int64_t>();
  if (result.count("max-tokens") && settings.max_tokens < 2)
    fail("--max-tokens: expected at least 2 ([CLS] and [SEP]), got " +
         std::to_string(settings.max_tokens));
  const auto dtype = result["dtype"].as<std::string>();
  if (dtype == "bfloat16")
    settings.dtype = torch::kBFloat16;
  else if (dtype != "float32")
    fail("--dtype: expected float32 or bfloat16, got '" + dtype + "'");
  const auto device = result["device"].as<std::string>();
  if (device == "cuda") {
    if (!torch::cuda::is_available())
      fail("--device cuda: this LibTorch sees no CUDA device");
    settings.device = torch::kCUDA;
  } else if (device != "cpu") {
    fail("--device: expected cpu or cuda, got '" + device + "'");
  }
  if (result.count("threads")) {
    const int threads = result["threads"].as<int>();
    // More threads than cores only spin in OpenMP; 100000 crashed its runtime.
    const int cores = attnkit::usable_cores();
    if (threads < 1 || threads > cores) {
      fail("--threads " + std::to_string(threads) + ": this process may use " +
           std::to_string(cores) + " cores; expected 1.." + std::to_string(cores));
    }
    torch::set_num_threads(threads);
  }
  settings.repeat = result["repeat"].as<int>();
  if (settings.repeat < 1)
    fail("--repeat: expected at least 1, got " + std::to_string(settings.repeat));
  if (result.count("ids-out"))
    settings.ids_out = result["ids-out"].as<std::string>();
  if (result.count("embeddings-out"))
    settings.embeddings_out = result["embeddings-out"].as<std::string>();
  settings.quiet = result.count("quiet") > 0;
  settings.pack = result.count("pack") > 0;
  return settings;
}

// Every sentence's embedding, in the input's order: sentences sorted by length (longest
// first, as sentence-transformers does), cut into batches, each padded to its longest or
// (--pack) packed.
torch::Tensor encode(BertEncoder& encoder, const std::vector<std::vector<int64_t>>& ids,
                     const Settings& settings, int64_t pad_id) {
  std::vector<size_t> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return ids[a].size() > ids[b].size(); });
  auto embeddings = torch::empty({static_cast<int64_t>(ids.size()), encoder->config.hidden_size});
  torch::NoGradGuard no_grad;
  for (size_t start = 0; start < order.size(); start += settings.batch_size) {
    const size_t end = std::min(order.size(), start + static_cast<size_t>(settings.batch_size));
    torch::Tensor batch_embeddings;
    auto lengths = torch::empty({static_cast<int64_t>(end - start)}, torch::kInt64);
    for (size_t i = start; i < end; ++i)
      lengths[static_cast<int64_t>(i - start)] = static_cast<int64_t>(ids[order[i]].size());
    if (settings.pack) {
      std::vector<int64_t> packed;  // the sentences one after another
      for (size_t i = start; i < end; ++i)
        packed.insert(packed.end(), ids[order[i]].begin(), ids[order[i]].end());
      batch_embeddings = encoder->embed_packed(
          torch::tensor(packed, torch::kInt64).to(settings.device), lengths.to(settings.device));
    } else {
      const auto longest = static_cast<int64_t>(ids[order[start]].size());
      auto batch = torch::full({static_cast<int64_t>(end - start), longest}, pad_id, torch::kInt64);
      for (size_t i = start; i < end; ++i) {
        const auto& sentence = ids[order[i]];
        std::copy(sentence.begin(), sentence.end(),
                  batch[static_cast<int64_t>(i - start)].data_ptr<int64_t>());
      }
      batch_embeddings = encoder->embed(batch.to(settings.device), lengths.to(settings.device));
    }
    batch_embeddings = batch_embeddings.cpu();
    for (size_t i = start; i < end; ++i)
      embeddings[static_cast<int64_t>(order[i])] =
          batch_embeddings[static_cast<int64_t>(i - start)];
  }
  return embeddings;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings settings = parse(argc, argv);
  const std::string& dir = settings.model_dir;
  try {
    auto config = BertConfig::from_json(dir + "/config.json");
    const WordPieceTokenizer tokenizer(dir + "/vocab.txt");
    // A token id past the embedding table would fail deep inside the model.
    if (tokenizer.vocab_size() > config.vocab_size) {
      fail("'" + dir + "/vocab.txt' has " + std::to_string(tokenizer.vocab_size()) +
           " tokens, more than config.json's vocab_size " + std::to_string(config.vocab_size));
    }
    const int64_t limit = model_token_limit(dir, config);
    const int64_t max_tokens = settings.max_tokens > 0 ? settings.max_tokens : limit;
    if (max_tokens > config.max_position_embeddings)
      fail("--max-tokens: expected at most " + std::to_string(config.max_position_embeddings) +
           " (the model's positions), got " + std::to_string(max_tokens));

    // Every sentence's ids; tokenised inside each timed encoding, as sentence-transformers'
    // encode does.
    const auto tokenize = [&] {
      std::vector<std::vector<int64_t>> all;
      for (size_t i = 0; i < settings.sentences.size(); ++i) {
        try {
          all.push_back(tokenizer.encode(settings.sentences[i], max_tokens));
        } catch (const std::invalid_argument& error) {
          fail("sentence " + std::to_string(i + 1) + ": " + error.what());
        }
      }
      return all;
    };
    if (settings.pack) {
      // A packed batch is one sequence of up to batch-size sentences; tiles of 64 queries by
      // 128 keys measured fastest for all-MiniLM-L6-v2's sentences (docs/benchmarks.md).
      config.attention_context = max_tokens * settings.batch_size;
      config.query_block_size = 64;
      config.key_block_size = 128;
    }
    BertEncoder encoder(config);
    const auto load_start = std::chrono::steady_clock::now();
    attnkit::load_safetensors(*encoder, dir + "/model.safetensors", sentence_encoder::bert_names());
    const double load_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    encoder->to(settings.device, settings.dtype);
    encoder->eval();

    std::vector<std::vector<int64_t>> ids;
    torch::Tensor embeddings;
    std::vector<double> seconds;
    for (int r = 0; r < settings.repeat; ++r) {
      const auto start = std::chrono::steady_clock::now();
      ids = tokenize();
      embeddings = encode(encoder, ids, settings, tokenizer.pad_id());
      seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    if (!settings.ids_out.empty()) {
      std::ofstream out(settings.ids_out);
      for (const auto& sentence : ids) {
        for (size_t j = 0; j < sentence.size(); ++j)
          out << (j ? " " : "") << sentence[j];
        out << "\n";
      }
      out.flush();
      if (!out)
        fail("--ids-out: cannot write '" + settings.ids_out + "'");
    }
    const double median = seconds[seconds.size() / 2];

    if (!settings.embeddings_out.empty()) {
      attnkit::StateDict out;
      out.insert("embeddings", embeddings);
      attnkit::save_safetensors(out, settings.embeddings_out, {{"model", dir}});
    }
    std::ostringstream report;
    report << std::fixed << std::setprecision(4);
    if (!settings.quiet) {
      report << "sentence_encoder: " << config.num_hidden_layers << " layers of "
             << "attnkit::MultiHeadAttention (" << config.num_attention_heads << " heads, hidden "
             << config.hidden_size << ") from " << dir << "/model.safetensors, "
             << (settings.dtype == torch::kBFloat16 ? "bfloat16" : "float32") << " on "
             << settings.device << "\n";
      const size_t shown = std::min<size_t>(ids.size(), 8);
      for (size_t i = 0; i < shown; ++i) {
        report << "[" << i << "] " << ids[i].size() << " tokens, embedding[:4] = ["
               << embeddings[i][0].item<float>() << ", " << embeddings[i][1].item<float>() << ", "
               << embeddings[i][2].item<float>() << ", " << embeddings[i][3].item<float>()
               << ", ...]  " << settings.sentences[i] << "\n";
      }
      if (shown > 1) {
        report << "cosine similarity:\n";
        const auto similarity =
            torch::mm(embeddings.slice(0, 0, shown), embeddings.slice(0, 0, shown).t());
        for (size_t i = 0; i < shown; ++i) {
          report << "  ";
          for (size_t j = 0; j < shown; ++j)
            report << std::setw(8) << similarity[i][j].item<float>();
          report << "\n";
        }
      }
    }
    report << std::setprecision(1) << "loaded model.safetensors in " << load_seconds * 1e3
           << " ms; encoded " << ids.size() << " sentences in " << median * 1e3 << " ms (median of "
           << settings.repeat << "): " << ids.size() / median << " sentences/s\n";
    std::cout << report.str() << std::flush;
    if (!std::cout)
      fail("cannot write to stdout");
  } catch (const c10::Error& error) {
    fail(error.what_without_backtrace());
  } catch (const std::exception& error) {
    fail(error.what());
  }
  return 0;
}
