// What a training run writes besides its checkpoints (run_output.h).

#include "run_output.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>

#include "core/base/checks.h"
#include "heatmap.h"
#include "line.h"

namespace attnkit::train {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

MetricsWriter::MetricsWriter(const std::string& path, bool text_task)
    : path_(path), text_task_(text_task) {
  if (path.empty())
    return;
  csv_ = ends_with(path, ".csv");
  out_.open(path, std::ios::trunc);
  TORCH_CHECK(out_.good(), "--metrics: cannot write '", path, "'");
  if (csv_) {
    out_ << "step,loss," << (text_task_ ? "bits_per_byte" : "accuracy")
         << ",train_loss,tokens_per_s,elapsed_s,final\n";
    out_.flush();
    TORCH_CHECK(out_.good(), "--metrics: writing '", path, "' failed (is the disk full?)");
  }
}

void MetricsWriter::write(int64_t step, const Evaluation& e, double train_loss, double tokens_per_s,
                          double elapsed_s, bool final) {
  if (!out_.is_open())
    return;
  const double metric = text_task_ ? e.bits_per_byte : e.accuracy;
  out_ << std::setprecision(6);
  if (csv_) {
    out_ << step << "," << e.loss << "," << metric << "," << train_loss << "," << tokens_per_s
         << "," << elapsed_s << "," << (final ? "true" : "false") << "\n";
  } else {
    out_ << "{\"step\": " << step << ", \"loss\": " << e.loss << ", \""
         << (text_task_ ? "bits_per_byte" : "accuracy") << "\": " << metric
         << ", \"train_loss\": " << train_loss << ", \"tokens_per_s\": " << tokens_per_s
         << ", \"elapsed_s\": " << elapsed_s << ", \"final\": " << (final ? "true" : "false")
         << "}\n";
  }
  out_.flush();  // a killed run keeps every line written so far
  TORCH_CHECK(out_.good(), "--metrics: writing '", path_, "' failed at step ", step,
              " (is the disk full?); the lines before it are in the file");
}

std::string format_eval(const Evaluation& e, bool text) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(4) << "held-out loss " << e.loss;
  if (text) {
    s << std::setprecision(3) << ", " << e.bits_per_byte << " bits/byte";
  } else {
    s << std::setprecision(2) << ", accuracy " << 100.0 * e.accuracy << "%";
  }
  return s.str();
}

void draw_progress(std::ostream& out, int64_t step, int64_t steps, double loss, double accuracy,
                   bool text, double tokens_per_s, double eta_s) {
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(steps, 1));
  Line line(out);
  line << "\r[" << std::string(filled, '#') << std::string(kWidth - filled, '.') << "] step "
       << step << "/" << steps << std::fixed << std::setprecision(4) << " loss " << loss;
  if (!text)
    line << std::setprecision(1) << " acc " << 100.0 * accuracy << "%";
  line << std::setprecision(0) << " " << tokens_per_s << " tok/s ETA " << eta_s << "s   ";
}

std::string sample_text(AttentionModel& model, const Task& task, const torch::Device& device,
                        const TrainConfig& config) {
  model->eval();
  const auto sequence = task.eval_batches(1).front().inputs[0];
  const int64_t prompt_length = std::min<int64_t>(16, sequence.size(0));
  const auto prompt = sequence.slice(0, 0, prompt_length).unsqueeze(0).to(device);  // (1, n)
  const auto start = Clock::now();
  const auto tokens = generate(*model, prompt,
                               GenerateOptions(config.sample)
                                   .temperature(0.8)
                                   .seed(config.seed)
                                   .use_kv_cache(config.kv_cache))
                          .to(torch::kCPU);
  const double seconds = seconds_since(start);
  const auto* ids = tokens.data_ptr<int64_t>();
  const std::string text(ids, ids + tokens.size(1));
  return c10::str("sample (", config.sample, " bytes, ",
                  config.kv_cache ? "KV cache" : "no KV cache", ", ",
                  static_cast<int64_t>(config.sample / std::max(seconds, 1e-9)), " tokens/s): [",
                  text.substr(0, prompt_length), "]", text.substr(prompt_length));
}

std::vector<std::string> read_prompts(const std::string& path) {
  attnkit::detail::check_not_directory("--prompts", path);
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "--prompts: cannot read '", path, "'");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(file, line);) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    if (!line.empty())
      prompts.push_back(line);
  }
  TORCH_CHECK(!prompts.empty(), "--prompts: '", path, "' has no non-empty line");
  return prompts;
}

std::string sample_prompts(AttentionModel& model, const torch::Device& device,
                           const TrainConfig& config) {
  model->eval();
  std::vector<GenerationRequest> requests;
  const auto prompts = read_prompts(config.prompts);
  for (const auto& prompt : prompts) {
    const std::vector<int64_t> bytes(prompt.begin(), prompt.end());
    requests.emplace_back(torch::tensor(bytes, torch::kInt64).bitwise_and(255).to(device));
  }
  const auto start = Clock::now();
  const auto rows =
      generate(*model, requests, GenerateOptions(config.sample).temperature(0.8).seed(config.seed));
  const double seconds = seconds_since(start);
  std::ostringstream text;
  text << "samples (" << prompts.size() << " prompts in one batch, " << config.sample
       << " bytes each, KV cache, "
       << static_cast<int64_t>(static_cast<double>(config.sample * prompts.size()) /
                               std::max(seconds, 1e-9))
       << " tokens/s):";
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto row = rows[r].to(torch::kCPU);
    const auto* ids = row.data_ptr<int64_t>();
    const std::string bytes(ids, ids + row.size(0));
    text << "\n[" << prompts[r] << "]" << bytes.substr(prompts[r].size());
  }
  return text.str();
}

void dump_attention(const std::string& path, AttentionModel& model, const Task& task,
                    const torch::Device& device) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto example_batch = task.eval_batches(1).front();
  const auto& example = example_batch.inputs;  // (1, n)
  std::vector<std::string> labels;
  for (int64_t i = 0; i < example.size(1); ++i) {
    labels.push_back(task.token_label(example[0][i].item<int64_t>()));
  }
  std::vector<torch::Tensor> maps;
  const auto& ids = example_batch.document_ids;  // (1, n) with --pack
  for (const auto& layer :
       model->attention_maps(example.to(device), ids.defined() ? ids.to(device) : ids)) {
    maps.push_back(layer[0].cpu());  // (h, n, n)
  }
  write_attention_heatmap(path, maps, labels, model->config().module + " on " + task.name());
}

std::string non_finite_message(const char* what, double value, int64_t step,
                               const TrainConfig& config, int64_t saved_step) {
  std::string checkpoint = " (no --save given)";
  if (!config.save.empty()) {
    checkpoint = saved_step > 0 ? c10::str("; the last good checkpoint is ", config.save, " (step ",
                                           saved_step, ")")
                                : c10::str("; nothing was saved, ", config.save, " is unchanged");
  }
  return c10::str(what, " became ", std::isnan(value) ? "NaN" : "infinite", " at step ", step,
                  "; training stopped", checkpoint, ". Try a smaller --lr (now ", config.lr, ")");
}

}  // namespace attnkit::train
