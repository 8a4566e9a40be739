// libFuzzer target: attnkit-train's --resume path (the state-dict parser, then every check
// of restore_checkpoint into a small model, its optimizer and generators) on arbitrary bytes.

#include <cstddef>
#include <cstdint>
#include <string>

#include "io/state_dict_reader.h"
#include "train/checkpoint.h"

namespace T = attnkit::train;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The model of the seed checkpoint (data/fuzz/checkpoint/): attnkit-train --task copy
  // --seq-len 8 --d-model 32 --heads 2 (16 tokens per sequence, vocab 11).
  static T::AttentionModel model = [] {
    T::ModelConfig config;
    config.vocab_size = 11;
    config.context_length = 16;
    config.d_model = 32;
    config.heads = 2;
    config.backend = "fused";  // the default backend of --module mha
    return T::AttentionModel(config);
  }();
  static T::FlatAdamW optimizer(model->parameters(), /*lr=*/3e-3, /*weight_decay=*/0.0);
  static const T::CheckpointSettings settings{
      {"task", "copy"}, {"seq-len", "8"},   {"module", "mha"}, {"d-model", "32"},
      {"heads", "2"},   {"layers", "1"},    {"ffn", "false"},  {"kv-groups", "0"},
      {"window", "0"},  {"latent-dim", "0"}};
  static at::Generator generator = at::detail::createCPUGenerator(0);
  try {
    const auto dict = attnkit::detail::parse_state_dict(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz-input.pt");
    T::restore_checkpoint(dict, "fuzz-input.pt", settings, model, optimizer, generator,
                          /*rank=*/static_cast<int>(size % 2));
  } catch (const c10::Error&) {
  }
  return 0;
}
