// attnkit-decode-bench: tokens/s of attnkit::generate with and without KV caches over
// attnkit-train's model (token + position embeddings, pre-LayerNorm blocks of attention and
// a GELU feed-forward, final LayerNorm, vocabulary head), untrained, at any shape: the
// GPT-2-small shape of the chapter-4 bonus material by default. scripts/bench_generate.sh
// runs it next to the Python reference (scripts/bench_generate.py).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include "attnkit/functional.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/serialize.h"
#include "attnkit/threads.h"
#include "command_line.h"
#include "core/kernels/decode_attention.h"
#include "train/line.h"
#include "train/mixed_precision.h"
#include "train/model.h"
#include "train/trainer.h"

using attnkit::train::Line;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Bytes of the parameters one decode step reads: all but the embedding tables, of which a
// step reads one row each.
int64_t weight_bytes_per_token(attnkit::train::AttentionModel& model) {
  int64_t bytes = 0;
  for (const auto& p : model->named_parameters()) {
    const bool embedding = p.key().find("embedding") != std::string::npos;
    const auto& t = p.value();
    bytes += (embedding ? t.size(-1) : t.numel()) * static_cast<int64_t>(t.element_size());
  }
  return bytes;
}

// Read bandwidth of the device in GB/s: the median of summing a 512 MiB float tensor there
// (item() waits for the sum, so a GPU's time is counted whole).
double read_bandwidth_gbs(const torch::Device& device) {
  const auto big = torch::ones({int64_t{128} << 20}, torch::TensorOptions().device(device));
  std::vector<double> rates;
  for (int i = 0; i < 5; ++i) {
    const auto start = Clock::now();
    const auto sum = big.sum().item<double>();
    rates.push_back(static_cast<double>(big.nbytes()) / seconds_since(start) / 1e9);
    // The sum is read so that the pass cannot be skipped.
    TORCH_CHECK(sum > 0, "[read_bandwidth_gbs] the sum of ones was ", sum);
  }
  return median(rates);
}

// Feeds `tokens` (1, n) through fresh caches one token at a time, as decoding does, and
// reports the most positions a cache held and whether any cache's storage moved.
struct CacheTrace {
  int64_t max_held = 0;
  bool storage_moved = false;
};

CacheTrace trace_caches(attnkit::train::AttentionModel& model, const torch::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  auto caches = model->make_kv_caches(1, tokens.size(1));
  std::vector<const void*> storage;
  CacheTrace trace;
  for (int64_t t = 0; t < tokens.size(1); ++t) {
    model->logits_with_cache(tokens.narrow(1, t, 1), caches);
    for (size_t i = 0; i < caches.size(); ++i) {
      trace.max_held = std::max(trace.max_held, caches[i].held());
      const void* data = caches[i].keys().data_ptr();
      if (storage.size() <= i)
        storage.push_back(data);
      trace.storage_moved = trace.storage_moved || storage[i] != data;
    }
  }
  return trace;
}

struct Run {
  std::string mode;  // "cached" or "uncached"
  double tokens_per_second;
  torch::Tensor tokens;
};

// --batch-prompts: `count` prompts of min_length..max_length tokens generated one after
// another and together; exit 1 when a row's tokens differ.
int run_batch(attnkit::train::AttentionModel& model, const attnkit::train::ModelConfig& config,
              const torch::Device& device, int64_t count, int64_t min_length, int64_t max_length,
              int64_t new_tokens, int64_t repeats, const std::string& json) {
  std::vector<attnkit::GenerationRequest> requests;
  const auto lengths = torch::randint(min_length, max_length + 1, {count}, torch::kInt64);
  for (int64_t i = 0; i < count; ++i)
    requests.emplace_back(
        torch::randint(0, config.vocab_size, {lengths[i].item<int64_t>()}, torch::kInt64)
            .to(device));
  const auto options = attnkit::GenerateOptions(new_tokens);
  attnkit::generate(*model, requests, attnkit::GenerateOptions(2));  // warm-up
  const double total = static_cast<double>(count * new_tokens);
  std::vector<double> alone_rates, together_rates;
  std::vector<torch::Tensor> alone, together;
  for (int64_t r = 0; r < repeats; ++r) {
    auto start = Clock::now();
    alone.clear();
    for (const auto& request : requests)
      alone.push_back(attnkit::generate(*model, request.prompt().unsqueeze(0), options)[0]);
    alone_rates.push_back(total / seconds_since(start));
    start = Clock::now();
    together = attnkit::generate(*model, requests, options);
    together_rates.push_back(total / seconds_since(start));
  }
  bool identical = true;
  for (int64_t i = 0; i < count; ++i)
    identical = identical && alone[i].equal(together[i]);
  const double one_by_one = median(alone_rates), batched = median(together_rates);
  Line(std::cout) << std::fixed << std::setprecision(1) << "attnkit-decode-bench: " << config.module
                  << " (" << config.backend << "), vocab " << config.vocab_size << ", context "
                  << config.context_length << ", d " << config.d_model << ", " << config.heads
                  << " heads, " << config.layers << " layers, LibTorch " << TORCH_VERSION_MAJOR
                  << "." << TORCH_VERSION_MINOR << ", " << device << ", "
                  << torch::get_num_threads() << " thread(s) (" << attnkit::blas_threads() << ")\n"
                  << count << " prompts of " << lengths.min().item<int64_t>() << ".."
                  << lengths.max().item<int64_t>() << " tokens, " << new_tokens
                  << " new tokens each, greedy, median of " << repeats << "\n"
                  << "  one after another " << std::setw(10) << one_by_one << " tokens/s\n"
                  << "  in one batch      " << std::setw(10) << batched << " tokens/s\n"
                  << std::setprecision(2) << "  batch / one after another: " << batched / one_by_one
                  << "x; tokens " << (identical ? "identical" : "DIFFER") << "\n";
  if (!json.empty()) {
    attnkit::write_atomically(json, "--json:", [&](std::ostream& out) {
      out << std::setprecision(6) << "{\"language\": \"C++\", \"torch\": \"" << TORCH_VERSION_MAJOR
          << "." << TORCH_VERSION_MINOR << "\", \"threads\": " << torch::get_num_threads()
          << ", \"module\": \"" << config.module << "\", \"prompts\": " << count
          << ", \"new_tokens\": " << new_tokens << ", \"one_by_one_tokens_per_s\": " << one_by_one
          << ", \"batched_tokens_per_s\": " << batched
          << ", \"identical_tokens\": " << (identical ? "true" : "false") << "}\n";
    });
  }
  return identical ? 0 : 1;
}

// --attention-step: the attention of one decode step alone, `batch` rows of `length` cached
// positions each, on a contiguous cache (the decode kernel on (batch, kv_heads, length,
// head_dim) storage, as KVCache holds it) or a paged one (paged_attention over a PagedKVCache
// whose rows' pages interleave, as requests' pages do in a shared pool). With `queries` > 1,
// a prefill chunk of that many queries per row at the end of the length instead: on a
// contiguous cache through attnkit::functional::attention (causal, bottom-right: the fused
// tile kernel), on a paged one through paged_attention. With `evict_mib` > 0, that many MiB
// are written before each timed step, outside its time, so that it reads its cache from
// memory as a model's layer does after the other layers ran. Prints one row per length:
// "step MODE LENGTH DTYPE MEDIAN us".
int run_attention_step(const std::string& mode, const std::vector<int64_t>& lengths, int64_t batch,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size,
                       torch::ScalarType dtype, int64_t repeats, int64_t queries,
                       int64_t evict_mib) {
  TORCH_CHECK(mode == "contiguous" || mode == "paged",
              "--attention-step: expected contiguous or paged, got '", mode, "'");
  torch::NoGradGuard no_grad;
  const auto options = torch::TensorOptions(dtype);
  const auto query = torch::randn({batch, heads, queries, head_dim}).to(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  // (evict_mib MiB of float32)
  auto evict = torch::empty({evict_mib * (int64_t{1} << 18)}, torch::kFloat);
  for (const int64_t length : lengths) {
    TORCH_CHECK(length >= queries, "--cached: expected lengths >= --step-queries (", queries,
                "), got ", length);
    std::function<torch::Tensor()> step;
    // Both sides' storage lives to the end of the length's timing.
    torch::Tensor keys, values;
    std::unique_ptr<attnkit::PagedKVCache> pool;
    attnkit::PagedKV view;
    if (mode == "contiguous") {
      keys = torch::randn({batch, kv_heads, length, head_dim}).to(dtype);
      values = torch::randn({batch, kv_heads, length, head_dim}).to(dtype);
      if (queries == 1) {
        step = [&] { return attnkit::detail::decode_attention(query, keys, values, scale); };
      } else {
        // Grouped-query heads as they are: each key head serves its group of query heads.
        step = [&] {
          return attnkit::functional::attention(query, keys, values,
                                                attnkit::functional::AttentionOptions().mask(
                                                    attnkit::Mask::causal(length - queries)));
        };
      }
    } else {
      const int64_t pages = (length + page_size - 1) / page_size;
      pool = std::make_unique<attnkit::PagedKVCache>(batch * pages, page_size, kv_heads, head_dim,
                                                     options);
      std::vector<int64_t> rows;
      for (int64_t r = 0; r < batch; ++r)
        rows.push_back(pool->add_sequence());
      for (int64_t done = 0; done < length; done += page_size) {  // a page of each row in turn
        const int64_t n = std::min(page_size, length - done);
        for (const int64_t row : rows)
          pool->append(row, torch::randn({kv_heads, n, head_dim}).to(dtype),
                       torch::randn({kv_heads, n, head_dim}).to(dtype));
      }
      view = pool->view(rows);
      step = [&] { return attnkit::paged_attention(query, view); };
    }
    step();  // warm-up
    std::vector<double> times;
    for (int64_t r = 0; r < repeats; ++r) {
      if (evict_mib > 0)
        evict.fill_(static_cast<double>(r));
      const auto start = Clock::now();
      step();
      times.push_back(seconds_since(start) * 1e6);
    }
    Line(std::cout) << std::fixed << std::setprecision(1) << "step " << mode << " " << length << " "
                    << c10::toString(dtype) << " " << median(times) << " us\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  attnkit::cli::CommandLine cli(
      "attnkit-decode-bench",
      "Tokens/s of greedy generation with and without KV caches over attnkit-train's model "
      "(untrained), and the bytes and bandwidth it needs.");
  cli.value("Model", "vocab", "vocabulary size", "50257")
      .value("Model", "context", "context length (position embedding)", "1024")
      .value("Model", "d-model", "embedding width", "768")
      .value("Model", "heads", "attention heads", "12")
      .value("Model", "layers", "blocks", "12")
      .value("Model", "module",
             "mha | mha-combined | gqa | mqa | mla (the modules with a KV cache)", "mha")
      .value("Model", "backend", "math | fused | chunked", "fused")
      .value("Model", "kv-groups", "gqa: key/value groups; 0 = 2", "0")
      .value("Model", "window", "mha, mha-combined, gqa, mqa: sliding window; 0 = none", "0")
      .value("Model", "latent-dim", "mla: latent width; 0 = max(16, d-model / 8)", "0")
      .flag("Model", "rope",
            "mha, mha-combined, gqa, mqa: rotary position embeddings instead of a position table");
  cli.value("Run", "prompt", "prompt tokens", "4")
      .value("Run", "new-tokens", "tokens to generate", "200")
      .value("Run", "repeats", "timed runs of each mode (the median is reported)", "3")
      .value("Run", "device", "auto | cpu | cuda | cuda:N (auto: a GPU when one is visible)", "cpu")
      .value("Run", "threads", "CPU threads, for LibTorch and its BLAS; 0 = their defaults", "1")
      .value("Run", "dtype",
             "float32 | bfloat16 | float16: the weights' and the KV caches' dtype (16-bit caches "
             "are read in place by the decode kernel)",
             "float32")
      .value("Run", "seed", "seed of the weights and the prompt", "123")
      .flag("Run", "no-uncached", "time only the cached mode")
      .value("Run", "batch-prompts",
             "N > 0: instead, N prompts of --prompt-min..--prompt tokens (seeded), generated "
             "together in one batch and one after another (both cached); reports both rates "
             "and checks that each row's tokens are the same",
             "0")
      .value("Run", "prompt-min", "with --batch-prompts: the shortest prompt", "4")
      .value("Run", "attention-step",
             "contiguous | paged: instead, time one decode step's attention alone, over "
             "--step-rows rows of each --cached length, on a contiguous cache or a paged one "
             "(heads from --heads, head width d-model / heads, key heads --kv-groups or, "
             "at 0, --heads; --dtype, --repeats, --threads)")
      .value("Run", "cached", "with --attention-step: cached lengths, comma-separated",
             "1024,4096,16384,32768")
      .value("Run", "step-rows", "with --attention-step: rows (sequences) per step", "2")
      .value("Run", "page-size", "with --attention-step paged: positions per page", "16")
      .value("Run", "step-queries",
             "with --attention-step: queries per row, the last of each cached length (1: a "
             "decode step; more: a prefill chunk)",
             "1")
      .value("Run", "evict-mib",
             "with --attention-step: MiB written before each timed step, outside its time, so "
             "that the step reads its cache from memory as in a model whose other layers ran "
             "in between (more than the last-level cache: 64 for 32 MiB); 0: the cache as the "
             "last step left it",
             "0");
  cli.flag("Output", "trace-cache",
           "feed the generated sequence again one token at a time through fresh caches and "
           "report the most positions a cache held and whether its storage moved")
      .value("Output", "json", "also write the results as JSON to FILE")
      .flag("Output", "h,help", "show this help");
  cli.example("attnkit-decode-bench --new-tokens 100",
              "GPT-2-small shape: tokens/s with and without KV caches, one thread")
      .example("attnkit-decode-bench --module gqa --kv-groups 4 --window 256 --no-uncached",
               "a grouped-query model with a rolling 256-token cache, cached mode only")
      .example("attnkit-decode-bench --batch-prompts 8 --prompt 64 --prompt-min 4",
               "8 prompts of 4..64 tokens: one batch against one after another")
      .example(
          "attnkit-decode-bench --attention-step paged --heads 32 --kv-groups 8 "
          "--d-model 4096 --repeats 20",
          "a Llama-shaped decode step's attention on a paged cache at 1k-32k positions");
  attnkit::train::ModelConfig config;
  int64_t prompt_length = 0, new_tokens = 0, repeats = 0, threads = 0, batch_prompts = 0,
          prompt_min = 0;
  uint64_t seed = 0;
  bool uncached = true, trace = false;
  std::string json, device_name, dtype_name, step_mode;
  std::vector<int64_t> step_lengths;
  int64_t step_rows = 0, page_size = 0, step_queries = 0, evict_mib = 0;
  try {
    cli.parse(argc, argv);
    if (cli.given("help")) {
      Line(std::cout) << cli.help() << "\n";
      return 0;
    }
    config.vocab_size = cli.integer("vocab");
    config.context_length = cli.integer("context");
    config.d_model = cli.integer("d-model");
    config.heads = cli.integer("heads");
    config.layers = cli.integer("layers");
    config.module = cli.text("module");
    config.backend = cli.text("backend");
    config.kv_groups = cli.integer("kv-groups");
    config.window = cli.integer("window");
    config.latent_dim = cli.integer("latent-dim");
    config.rope = cli.given("rope");
    config.ffn = true;
    prompt_length = cli.integer("prompt");
    new_tokens = cli.integer("new-tokens");
    repeats = cli.integer("repeats");
    threads = cli.integer("threads");
    device_name = cli.text("device");
    dtype_name = cli.text("dtype");
    seed = cli.unsigned_integer("seed");
    uncached = !cli.given("no-uncached");
    batch_prompts = cli.integer("batch-prompts");
    prompt_min = cli.integer("prompt-min");
    trace = cli.given("trace-cache");
    step_mode = cli.text("attention-step");
    std::istringstream cached(cli.text("cached"));
    for (std::string item; std::getline(cached, item, ',');)
      step_lengths.push_back(std::stoll(item));
    step_rows = cli.integer("step-rows");
    page_size = cli.integer("page-size");
    step_queries = cli.integer("step-queries");
    evict_mib = cli.integer("evict-mib");
    json = cli.text("json");
  } catch (const attnkit::cli::UsageError& e) {
    Line(std::cerr) << "attnkit-decode-bench: " << e.what() << "\n";
    return 2;
  } catch (const std::logic_error&) {  // std::stoll's
    Line(std::cerr) << "attnkit-decode-bench: --cached: expected comma-separated integers, got '"
                    << cli.text("cached") << "'\n";
    return 2;
  }
  try {
    TORCH_CHECK(attnkit::train::has_backends_and_kv_cache(config.module),
                "--module: expected mha, mha-combined, gqa, mqa or mla (the modules with a KV "
                "cache), got '",
                config.module, "'");
    TORCH_CHECK(config.vocab_size >= 1 && config.context_length >= 1,
                "--vocab and --context must be >= 1, got ", config.vocab_size, " and ",
                config.context_length);
    TORCH_CHECK(batch_prompts >= 0, "--batch-prompts: expected >= 0, got ", batch_prompts);
    // Batches may run past the context (their caches refill); the single prompt's cached and
    // uncached tokens agree only inside it.
    TORCH_CHECK(prompt_length >= 1 && new_tokens >= 1 &&
                    (batch_prompts > 0 || prompt_length + new_tokens <= config.context_length),
                "--prompt and --new-tokens: expected >= 1 each and prompt + new tokens <= "
                "--context ",
                config.context_length, ", got ", prompt_length, " + ", new_tokens);
    TORCH_CHECK(batch_prompts == 0 || (prompt_min >= 1 && prompt_min <= prompt_length),
                "--prompt-min: expected 1..--prompt (", prompt_length, "), got ", prompt_min);
    TORCH_CHECK(repeats >= 1, "--repeats: expected >= 1, got ", repeats);
    TORCH_CHECK(threads >= 0, "--threads: expected >= 0, got ", threads);
    if (threads > 0)
      attnkit::set_num_threads(static_cast<int>(threads));

    const auto device = attnkit::train::resolve_device(device_name);  // fails without CUDA
    const auto dtype = attnkit::train::parse_train_dtype(dtype_name);
    attnkit::train::check_dtype_runs_on(dtype, device);

    torch::manual_seed(seed);
    if (!step_mode.empty()) {
      TORCH_CHECK(config.heads >= 1 && config.d_model % config.heads == 0, "--d-model ",
                  config.d_model, " must be a multiple of --heads ", config.heads);
      TORCH_CHECK(step_rows >= 1 && page_size >= 1 && step_queries >= 1,
                  "--step-rows, --page-size and --step-queries: expected >= 1 each, got ",
                  step_rows, ", ", page_size, " and ", step_queries);
      TORCH_CHECK(evict_mib >= 0, "--evict-mib: expected >= 0 (0: none), got ", evict_mib);
      const int64_t kv_heads = config.kv_groups > 0 ? config.kv_groups : config.heads;
      TORCH_CHECK(device.is_cpu(), "--attention-step runs on the CPU, got --device ", device);
      return run_attention_step(step_mode, step_lengths, step_rows, config.heads, kv_heads,
                                config.d_model / config.heads, page_size, dtype, repeats,
                                step_queries, evict_mib);
    }
    attnkit::train::AttentionModel model(config);  // validates the sizes
    model->to(device, dtype);
    model->eval();
    if (batch_prompts > 0)
      return run_batch(model, config, device, batch_prompts, prompt_min, prompt_length, new_tokens,
                       repeats, json);
    const auto prompt =
        torch::randint(0, config.vocab_size, {1, prompt_length}, torch::kInt64).to(device);
    const auto options = attnkit::GenerateOptions(new_tokens);
    attnkit::generate(*model, prompt, attnkit::GenerateOptions(2));  // warm-up

    std::vector<Run> runs;
    for (const bool cache : {true, false}) {
      if (!cache && !uncached)
        continue;
      std::vector<double> rates;
      torch::Tensor tokens;
      for (int64_t r = 0; r < repeats; ++r) {
        const auto start = Clock::now();
        tokens = attnkit::generate(*model, prompt,
                                   attnkit::GenerateOptions(options).use_kv_cache(cache));
        rates.push_back(static_cast<double>(new_tokens) / seconds_since(start));
      }
      runs.push_back({cache ? "cached" : "uncached", median(rates), tokens});
    }

    const int64_t positions = prompt_length + new_tokens;
    const auto caches = model->make_kv_caches(1, positions);
    int64_t cache_bytes = 0;
    for (const auto& c : caches)
      cache_bytes += c.nbytes();
    const int64_t cache_bytes_per_token = caches.front().bytes_per_token();  // one layer
    const int64_t weights = weight_bytes_per_token(model);
    const double bandwidth = read_bandwidth_gbs(device);
    const double needed = static_cast<double>(weights) * runs.front().tokens_per_second / 1e9;

    Line(std::cout) << std::fixed << std::setprecision(1)
                    << "attnkit-decode-bench: " << config.module << " (" << config.backend << ")"
                    << (config.kv_groups > 0 ? ", kv-groups " + std::to_string(config.kv_groups)
                                             : "")
                    << (config.window > 0 ? ", window " + std::to_string(config.window) : "")
                    << (config.rope ? ", rope" : "")
                    << (config.latent_dim > 0 ? ", latent-dim " + std::to_string(config.latent_dim)
                                              : "")
                    << ", vocab " << config.vocab_size << ", context " << config.context_length
                    << ", d " << config.d_model << ", " << config.heads << " heads, "
                    << config.layers << " layers, " << dtype_name << ", LibTorch "
                    << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << ", " << device << ", "
                    << torch::get_num_threads() << " thread(s) (" << attnkit::blas_threads()
                    << ")\n"
                    << "prompt " << prompt_length << ", " << new_tokens
                    << " new tokens, greedy, median of " << repeats << "\n";
    for (const auto& run : runs) {
      Line(std::cout) << std::fixed << std::setprecision(1) << "  " << std::left << std::setw(9)
                      << run.mode << std::right << std::setw(10) << run.tokens_per_second
                      << " tokens/s\n";
    }
    if (runs.size() == 2) {
      Line(std::cout) << std::fixed << "  cached / uncached: " << std::setprecision(2)
                      << runs[0].tokens_per_second / runs[1].tokens_per_second << "x; tokens "
                      << (runs[0].tokens.equal(runs[1].tokens) ? "identical" : "DIFFER") << "\n";
    }
    Line(std::cout) << std::fixed << "  KV cache " << cache_bytes_per_token
                    << " bytes per token per layer; " << std::setprecision(2)
                    << cache_bytes / 1048576.0 << " MiB in all for " << positions << " positions ("
                    << caches.front().capacity() << " held at most per layer)\n"
                    << std::setprecision(1) << "  weights " << weights / 1048576.0
                    << " MiB read per token -> " << needed << " GB/s at the cached rate, "
                    << std::setprecision(0) << 100.0 * needed / bandwidth << "% of " << device
                    << "'s " << std::setprecision(1) << bandwidth << " GB/s read bandwidth\n";
    CacheTrace traced;
    if (trace) {
      traced = trace_caches(model, runs.front().tokens);
      Line(std::cout) << std::fixed << "  traced " << runs.front().tokens.size(1)
                      << " one-token steps: a cache held at most " << traced.max_held
                      << " positions; storage " << (traced.storage_moved ? "MOVED" : "never moved")
                      << "\n";
    }
    if (!json.empty()) {
      attnkit::write_atomically(json, "--json:", [&](std::ostream& out) {
        out << std::setprecision(6) << "{\"language\": \"C++\", \"torch\": \""
            << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << "\", \"device\": \"" << device
            << "\", \"dtype\": \"" << dtype_name << "\", \"threads\": " << torch::get_num_threads()
            << ", \"blas\": \"" << attnkit::blas_threads().name
            << "\", \"blas_threads\": " << attnkit::blas_threads().num_threads << ", \"module\": \""
            << config.module << "\", \"backend\": \"" << config.backend
            << "\", \"kv_groups\": " << config.kv_groups << ", \"window\": " << config.window
            << ", \"latent_dim\": " << config.latent_dim
            << ", \"rope\": " << (config.rope ? "true" : "false")
            << ", \"cache_bytes\": " << cache_bytes
            << ", \"cache_bytes_per_token_per_layer\": " << cache_bytes_per_token
            << ", \"weight_bytes_per_token\": " << weights
            << ", \"read_bandwidth_gbs\": " << bandwidth;
        for (const auto& run : runs)
          out << ", \"" << run.mode << "_tokens_per_s\": " << run.tokens_per_second;
        if (trace)
          out << ", \"traced_max_held\": " << traced.max_held
              << ", \"traced_storage_moved\": " << (traced.storage_moved ? "true" : "false");
        if (runs.size() == 2)
          out << ", \"identical_tokens\": "
              << (runs[0].tokens.equal(runs[1].tokens) ? "true" : "false");
        out << "}\n";
      });
    }
    const bool differ = runs.size() == 2 && !runs[0].tokens.equal(runs[1].tokens);
    return differ || traced.storage_moved ? 1 : 0;
  } catch (const c10::Error& e) {
    Line(std::cerr) << "attnkit-decode-bench: " << e.what_without_backtrace() << "\n";
    return 2;
  }
}
