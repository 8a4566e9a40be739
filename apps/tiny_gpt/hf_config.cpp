#include "hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <attnkit/memory_budget.h>
#include <nlohmann/json.hpp>

namespace tiny_gpt {

// ---- config.json, read as transformers reads it ------------------------------------------

namespace {

// config.json's fields, each read once with its name in any error.
class HfConfig {
 public:
  explicit HfConfig(const std::string& path) : path_(path) {
    std::ifstream in(path);
    if (!in)
      throw std::runtime_error("cannot open '" + path + "'; --hf needs a folder with config.json");
    try {
      json_ = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& error) {
      throw std::runtime_error("'" + path + "' is not valid JSON: " + error.what());
    }
    if (!json_.is_object())
      throw std::runtime_error("'" + path + "' is not a JSON object");
  }
  int64_t positive(const char* name) const {
    const auto& value = field(name);
    if (!value.is_number_integer() || value.get<int64_t>() <= 0)
      fail(name, "a positive integer", value);
    return value.get<int64_t>();
  }
  // An integer field that may be absent or null: `fallback` then.
  int64_t positive_or(const char* name, int64_t fallback) const {
    return json_.contains(name) && !json_[name].is_null() ? positive(name) : fallback;
  }
  // A number field that may be absent or null: `fallback` then.
  double number_or(const char* name, double fallback) const {
    if (!json_.contains(name) || json_[name].is_null())
      return fallback;
    if (!json_[name].is_number())
      fail(name, "a number", json_[name]);
    return json_[name].get<double>();
  }
  // A bool or string field that may be absent or null: `fallback` then.
  template <typename T>
  T value_or(const char* name, const T& fallback) const {
    static_assert(std::is_same_v<T, bool> || std::is_same_v<T, std::string>);
    if (!json_.contains(name) || json_[name].is_null())
      return fallback;
    const auto& value = json_[name];
    if constexpr (std::is_same_v<T, bool>) {
      if (!value.is_boolean())
        fail(name, "true or false", value);  // "false", a string, would read as true
    } else if (!value.is_string()) {
      fail(name, "a string", value);
    }
    return value.get<T>();
  }
  // A number field that may be absent or null (`fallback` then), else finite and above 0.
  double positive_number_or(const char* name, double fallback) const {
    if (!json_.contains(name) || json_[name].is_null())
      return fallback;
    const double value = number_or(name, fallback);
    if (!(value > 0.0) || !std::isfinite(value))
      fail(name, "null or a finite positive number", json_[name]);
    return value;
  }
  // Fails unless the field is absent or equals `expected` (what tiny_gpt's model computes).
  template <typename T>
  void require(const char* name, const T& expected) const {
    if (json_.contains(name) && !json_[name].is_null() && json_[name] != nlohmann::json(expected))
      fail(name, nlohmann::json(expected).dump() + " (what tiny_gpt's model computes)",
           json_[name]);
  }
  const nlohmann::json& field(const char* name) const {
    if (!json_.contains(name))
      throw std::runtime_error("'" + path_ + "' has no \"" + name + "\"");
    return json_[name];
  }
  const nlohmann::json& json() const { return json_; }
  [[noreturn]] void fail(const std::string& message) const {
    throw std::runtime_error("'" + path_ + "': " + message);
  }
  [[noreturn]] void fail(const std::string& name, const std::string& expected,
                         const nlohmann::json& actual) const {
    throw std::runtime_error("'" + path_ + "': \"" + name + "\" must be " + expected + ", got " +
                             actual.dump());
  }

 private:
  std::string path_;
  nlohmann::json json_;
};

// GPT2LMHeadModel: Conv1D weights stored (in, out), so transposed; c_attn's fused query, key
// and value split in three; the causal-mask buffers dropped.
attnkit::NameMap gpt2_names(bool tied) {
  const std::string layer = R"(h\.(\d+)\.)";
  attnkit::NameMap names{
      /*prefix=*/"transformer.",
      /*ignored=*/{layer + R"(attn\.(bias|masked_bias))"},
      /*rules=*/
      {
          {R"(wte\.weight)", {"token_embedding.weight"}},
          {R"(wpe\.weight)", {"position_embedding.weight"}},
          {layer + R"(ln_1\.(weight|bias))", {"blocks.$1.attention_norm.$2"}},
          {layer + R"(attn\.c_attn\.weight)",
           {"blocks.$1.attention.W_query.weight", "blocks.$1.attention.W_key.weight",
            "blocks.$1.attention.W_value.weight"},
           /*transpose=*/true},
          {layer + R"(attn\.c_attn\.bias)",
           {"blocks.$1.attention.W_query.bias", "blocks.$1.attention.W_key.bias",
            "blocks.$1.attention.W_value.bias"}},
          {layer + R"(attn\.c_proj\.weight)", {"blocks.$1.attention.out_proj.weight"}, true},
          {layer + R"(attn\.c_proj\.bias)", {"blocks.$1.attention.out_proj.bias"}},
          {layer + R"(ln_2\.(weight|bias))", {"blocks.$1.feed_forward_norm.$2"}},
          {layer + R"(mlp\.c_fc\.weight)", {"blocks.$1.feed_forward.0.weight"}, true},
          {layer + R"(mlp\.c_fc\.bias)", {"blocks.$1.feed_forward.0.bias"}},
          {layer + R"(mlp\.c_proj\.weight)", {"blocks.$1.feed_forward.2.weight"}, true},
          {layer + R"(mlp\.c_proj\.bias)", {"blocks.$1.feed_forward.2.bias"}},
          {R"(ln_f\.(weight|bias))", {"final_norm.$1"}},
          {R"(lm_head\.weight)", {"head.weight"}},
      }};
  if (tied)  // a copy of wte in some checkpoints: the model reads wte
    names.ignored.push_back(R"(lm_head\.weight)");
  return names;
}

// The Llama family's checkpoints: LlamaForCausalLM, Qwen3ForCausalLM (whose q_norm and k_norm
// are attnkit's qk_norm), Qwen2ForCausalLM (query, key and value biases), MistralForCausalLM;
// Phi3ForCausalLM's fused qkv_proj (split by sizes: the query heads, then the key and value
// heads) and gate_up_proj (split in two); Gemma2ForCausalLM and Gemma3ForCausalLM, whose
// post_attention_layernorm is the norm after attention, and pre_feedforward_layernorm and
// post_feedforward_layernorm the two around the feed-forward.
attnkit::NameMap llama_names(const std::string& architecture, const ModelConfig& c) {
  const std::string layer = R"(layers\.(\d+)\.)";
  const std::string attention = "blocks.$1.attention.";
  attnkit::NameMap names{
      /*prefix=*/"model.",
      /*ignored=*/{layer + R"(self_attn\.rotary_emb\.inv_freq)"},
      /*rules=*/
      {
          {R"(embed_tokens\.weight)", {"token_embedding.weight"}},
          {layer + R"(self_attn\.q_proj\.(weight|bias))", {attention + "W_query.$2"}},
          {layer + R"(self_attn\.k_proj\.(weight|bias))", {attention + "W_key.$2"}},
          {layer + R"(self_attn\.v_proj\.(weight|bias))", {attention + "W_value.$2"}},
          {layer + R"(self_attn\.o_proj\.weight)", {attention + "out_proj.weight"}},
          {layer + R"(self_attn\.(q_norm|k_norm)\.weight)", {attention + "$2.weight"}},
          {layer + R"(input_layernorm\.weight)", {"blocks.$1.attention_norm.weight"}},
          {layer + R"(mlp\.gate_proj\.weight)", {"blocks.$1.feed_forward.fc1.weight"}},
          {layer + R"(mlp\.up_proj\.weight)", {"blocks.$1.feed_forward.fc2.weight"}},
          {layer + R"(mlp\.down_proj\.weight)", {"blocks.$1.feed_forward.fc3.weight"}},
          {R"(norm\.weight)", {"final_norm.weight"}},
          {R"(lm_head\.weight)", {"head.weight"}},
      }};
  if (c.gemma) {
    names.rules.push_back(
        {layer + R"(post_attention_layernorm\.weight)", {"blocks.$1.post_attention_norm.weight"}});
    names.rules.push_back(
        {layer + R"(pre_feedforward_layernorm\.weight)", {"blocks.$1.feed_forward_norm.weight"}});
    names.rules.push_back({layer + R"(post_feedforward_layernorm\.weight)",
                           {"blocks.$1.post_feed_forward_norm.weight"}});
  } else {
    names.rules.push_back(
        {layer + R"(post_attention_layernorm\.weight)", {"blocks.$1.feed_forward_norm.weight"}});
  }
  if (architecture == "phi3") {
    const int64_t head_dim = c.head_dim > 0 ? c.head_dim : c.d_model / c.heads;
    names.rules.push_back(
        {layer + R"(self_attn\.qkv_proj\.weight)",
         {attention + "W_query.weight", attention + "W_key.weight", attention + "W_value.weight"},
         /*transpose=*/false,
         /*split_sizes=*/
         {c.heads * head_dim, c.kv_groups * head_dim, c.kv_groups * head_dim}});
    names.rules.push_back(
        {layer + R"(mlp\.gate_up_proj\.weight)",
         {"blocks.$1.feed_forward.fc1.weight", "blocks.$1.feed_forward.fc2.weight"}});
  }
  if (c.tied_head)
    names.ignored.push_back(R"(lm_head\.weight)");
  return names;
}

ModelConfig gpt2_config(const HfConfig& json) {
  ModelConfig c;
  c.vocab = json.positive("vocab_size");
  c.d_model = json.positive("n_embd");
  c.layers = json.positive("n_layer");
  c.heads = json.positive("n_head");
  c.context_length = json.positive("n_positions");
  c.norm_eps = json.number_or("layer_norm_epsilon", 1e-5);
  c.tied_head = json.value_or("tie_word_embeddings", true);
  c.qkv_bias = true;
  const auto activation = json.value_or<std::string>("activation_function", "gelu_new");
  if (activation != "gelu_new" && activation != "gelu")
    json.fail("activation_function", "\"gelu_new\" (tanh) or \"gelu\" (erf)",
              json.field("activation_function"));
  c.gelu_tanh = activation == "gelu_new";
  if (json.positive_or("n_inner", 4 * c.d_model) != 4 * c.d_model)
    json.fail("n_inner", "null or 4 * n_embd", json.field("n_inner"));
  json.require("scale_attn_weights", true);
  json.require("scale_attn_by_inverse_layer_idx", false);
  json.require("add_cross_attention", false);
  return c;
}

// One RoPE parameter set (transformers 5's rope_parameters, or 4.x's rope_theta and
// rope_scaling, or Gemma 3's per layer type): its base, and Llama 3's frequency scaling.
// `where` names the field in errors.
attnkit::RopeOptions rope_of(const HfConfig& json, const nlohmann::json& rope, double theta,
                             int64_t context_length, const std::string& where) {
  auto options = attnkit::RopeOptions(context_length).theta_base(rope.value("rope_theta", theta));
  const auto type = rope.value("rope_type", rope.value("type", std::string("default")));
  if (type == "llama3") {
    options.freq_config(
        attnkit::RopeFrequencyConfig()
            .factor(rope.at("factor").get<double>())
            .low_freq_factor(rope.at("low_freq_factor").get<double>())
            .high_freq_factor(rope.at("high_freq_factor").get<double>())
            .original_context_length(rope.at("original_max_position_embeddings").get<int64_t>()));
  } else if (type != "default") {
    json.fail(where + ".rope_type",
              "\"default\" or \"llama3\" (the RoPE that tiny_gpt's model computes)",
              nlohmann::json(type));
  }
  if (rope.contains("partial_rotary_factor") && rope["partial_rotary_factor"] != 1.0)
    json.fail(where + ".partial_rotary_factor", "1 (RoPE over the whole head)",
              rope["partial_rotary_factor"]);
  return options;
}

// Each layer's window: config.json's layer_types ("sliding_attention" takes sliding_window,
// "full_attention" none); without it, Gemma 2's alternation (every other layer from the
// first), Gemma 3's pattern (every sliding_window_pattern-th layer full), or, for Mistral
// and Phi-3, sliding_window on every layer when it is set.
std::vector<int64_t> windows_of(const HfConfig& json, const std::string& architecture,
                                int64_t layers, int64_t context_length) {
  // LlamaForCausalLM has no window: it ignores sliding_window (a Llama config with one gave
  // other logits than transformers).
  if (architecture == "llama")
    return {};
  const auto& root = json.json();
  // Qwen2 and Qwen3 read sliding_window only with use_sliding_window (transformers sets it to
  // None otherwise, whatever layer_types says).
  if ((architecture == "qwen2" || architecture == "qwen3") &&
      !json.value_or("use_sliding_window", false))
    return {};
  const bool has_window = root.contains("sliding_window") && !root["sliding_window"].is_null();
  // A window as long as the context is none: clamped to it (a window of 10^12 is allowed).
  const int64_t window = has_window ? std::min(json.positive("sliding_window"), context_length) : 0;
  std::vector<std::string> types;
  if (root.contains("layer_types") && !root["layer_types"].is_null()) {
    const auto& listed = root["layer_types"];
    if (!listed.is_array() || static_cast<int64_t>(listed.size()) != layers)
      json.fail("layer_types", c10::str("a list of ", layers, " (num_hidden_layers) entries"),
                listed);
    for (const auto& type : listed)
      types.push_back(type.is_string() ? type.get<std::string>() : type.dump());
  } else if (architecture == "gemma2" || architecture == "gemma3_text") {
    const int64_t pattern = architecture == "gemma2"
                                ? 2
                                : json.positive_or("sliding_window_pattern",
                                                   json.positive_or("_sliding_window_pattern", 6));
    for (int64_t i = 0; i < layers; ++i)
      types.push_back((i + 1) % pattern != 0 ? "sliding_attention" : "full_attention");
  } else if (architecture == "qwen2" || architecture == "qwen3") {
    // use_sliding_window without layer_types: the layers from max_window_layers on slide.
    json.fail("use_sliding_window",
              "false without layer_types (tiny_gpt reads the windowed layers from layer_types)",
              root["use_sliding_window"]);
  } else {
    return has_window ? std::vector<int64_t>(static_cast<size_t>(layers), window)
                      : std::vector<int64_t>{};
  }
  std::vector<int64_t> windows;
  for (size_t i = 0; i < types.size(); ++i) {
    const auto name = c10::str("layer_types[", i, "]");
    if (types[i] == "sliding_attention") {
      if (!has_window)
        json.fail("sliding_window", "a positive integer (" + name + " is sliding_attention)",
                  root.value("sliding_window", nlohmann::json()));
      windows.push_back(window);
    } else if (types[i] == "full_attention") {
      windows.push_back(0);
    } else {
      json.fail(name, "\"sliding_attention\" or \"full_attention\"", nlohmann::json(types[i]));
    }
  }
  return windows;
}

// The Llama family: llama, qwen3, qwen2, mistral, phi3, gemma2, gemma3_text.
ModelConfig llama_config(const HfConfig& json, const std::string& architecture) {
  const bool gemma = architecture == "gemma2" || architecture == "gemma3_text";
  ModelConfig c;
  c.llama = true;
  c.gemma = gemma;
  c.qk_norm = architecture == "qwen3" || architecture == "gemma3_text";
  c.qkv_bias = architecture == "qwen2";
  c.vocab = json.positive("vocab_size");
  c.d_model = json.positive("hidden_size");
  c.layers = json.positive("num_hidden_layers");
  c.heads = json.positive("num_attention_heads");
  c.kv_groups = json.positive_or("num_key_value_heads", c.heads);
  c.head_dim = json.positive_or("head_dim", c.d_model / c.heads);
  c.hidden = json.positive("intermediate_size");
  c.context_length = json.positive("max_position_embeddings");
  c.norm_eps = json.number_or("rms_norm_eps", 1e-6);
  c.tied_head = json.value_or("tie_word_embeddings", gemma);
  if (gemma) {
    json.require("hidden_activation", "gelu_pytorch_tanh");
    json.require("hidden_act", "gelu_pytorch_tanh");
    json.require("use_bidirectional_attention", false);
    c.attention_scale =
        1.0 / std::sqrt(json.positive_number_or("query_pre_attn_scalar", c.head_dim));
    // null: no softcap; 0 is refused, as transformers divides by it.
    const auto cap = [&](const char* name) { return json.positive_number_or(name, 0.0); };
    c.attention_softcap = cap("attn_logit_softcapping");
    c.final_softcap = cap("final_logit_softcapping");
  } else {
    json.require("hidden_act", "silu");
  }
  json.require("attention_bias", c.qkv_bias);
  json.require("mlp_bias", false);
  c.windows = windows_of(json, architecture, c.layers, c.context_length);
  // transformers 5 writes rope_parameters (Gemma 3: one set per layer type); 4.x wrote
  // rope_theta and rope_scaling.
  const auto& root = json.json();
  const nlohmann::json rope =
      root.contains("rope_parameters") && root["rope_parameters"].is_object()
          ? root["rope_parameters"]
      : root.contains("rope_scaling") && root["rope_scaling"].is_object()
          ? root["rope_scaling"]
          : nlohmann::json::object();
  const double theta = json.number_or("rope_theta", 10000.0);
  if (rope.contains("full_attention") || rope.contains("sliding_attention")) {
    const auto full = rope.value("full_attention", nlohmann::json::object());
    c.rope = rope_of(json, full, theta, c.context_length, "rope_parameters.full_attention");
    const auto local = rope.value("sliding_attention", nlohmann::json::object());
    c.window_rope_theta = rope_of(json, local, json.number_or("rope_local_base_freq", 10000.0),
                                  c.context_length, "rope_parameters.sliding_attention")
                              .theta_base();
  } else {
    c.rope = rope_of(json, rope, theta, c.context_length, "rope_parameters");
    if (architecture == "gemma3_text")  // 4.x: the local layers' base on its own
      c.window_rope_theta = json.number_or("rope_local_base_freq", 10000.0);
  }
  if (c.heads % c.kv_groups != 0)
    json.fail("num_key_value_heads",
              "a divisor of num_attention_heads (" + std::to_string(c.heads) + ")",
              nlohmann::json(c.kv_groups));
  return c;
}

// The weights' float32 bytes (a lower bound: what the model holds besides is left out), checked
// against attnkit::memory_budget() before anything is built, naming the sizes of the largest
// part (num_hidden_layers 10^9 built layers until the process was killed; vocab_size 10^12
// failed in the allocator, naming no field).
void check_weights_fit(const HfConfig& json, const ModelConfig& c, bool gpt2) {
  struct Part {
    std::string sizes;
    double floats;
  };
  const double d = static_cast<double>(c.d_model), n = static_cast<double>(c.context_length);
  const double head_dim = c.head_dim > 0 ? c.head_dim : d / static_cast<double>(c.heads);
  const double kv_heads = static_cast<double>(gpt2 ? c.heads : c.kv_groups);
  const double attention = d * head_dim * 2.0 * (static_cast<double>(c.heads) + kv_heads);
  const double feed_forward = gpt2 ? 8.0 * d * d : 3.0 * d * static_cast<double>(c.hidden);
  const char* width = gpt2 ? "n_embd " : "hidden_size ";
  const std::vector<Part> parts{
      {c10::str("vocab_size ", c.vocab, " x ", width, c.d_model,
                c.tied_head ? " (the token embedding)" : " x 2 (the token embedding and the head)"),
       static_cast<double>(c.vocab) * d * (c.tied_head ? 1.0 : 2.0)},
      {c10::str(gpt2 ? "n_layer " : "num_hidden_layers ", c.layers, " x ", width, c.d_model,
                gpt2 ? "" : c10::str(", intermediate_size ", c.hidden),
                " (each layer's attention and feed-forward)"),
       static_cast<double>(c.layers) * (attention + feed_forward)},
      {gpt2 ? c10::str("n_positions ", c.context_length, " x n_embd ", c.d_model,
                       " (the position embedding)")
            : c10::str("max_position_embeddings ", c.context_length, " x head_dim ", head_dim,
                       " (RoPE's cosine and sine tables)"),
       gpt2 ? n * d : 2.0 * n * head_dim},
  };
  double total = 0.0;
  const Part* largest = &parts.front();
  for (const auto& part : parts) {
    total += part.floats;
    largest = part.floats > largest->floats ? &part : largest;
  }
  const double budget = static_cast<double>(attnkit::memory_budget());
  if (4.0 * total > budget) {
    json.fail(c10::str("the model's float32 weights would take at least ", 4.0 * total / 1e9,
                       " GB, more than attnkit::memory_budget() (", budget / 1e9,
                       " GB: half of physical memory unless attnkit::set_memory_budget says "
                       "otherwise); the largest part: ",
                       largest->sizes));
  }
}

}  // namespace

const std::vector<std::string> kLlamaFamily{"llama", "qwen2",  "qwen3",      "mistral",
                                            "phi3",  "gemma2", "gemma3_text"};

HfModel read_hf_model(const std::string& dir) {
  const HfConfig json(dir + "/config.json");
  HfModel model;
  model.architecture = json.value_or<std::string>("model_type", "");
  if (model.architecture == "gpt2") {
    model.config = gpt2_config(json);
    check_weights_fit(json, model.config, /*gpt2=*/true);
    model.names = gpt2_names(model.config.tied_head);
  } else if (std::find(kLlamaFamily.begin(), kLlamaFamily.end(), model.architecture) !=
             kLlamaFamily.end()) {
    model.config = llama_config(json, model.architecture);
    check_weights_fit(json, model.config, /*gpt2=*/false);
    model.names = llama_names(model.architecture, model.config);
  } else {
    json.fail("model_type",
              "\"gpt2\", \"llama\", \"qwen2\", \"qwen3\", \"mistral\", \"phi3\", "
              "\"gemma2\" or \"gemma3_text\"",
              json.json().value("model_type", nlohmann::json()));
  }
  return model;
}

TinyGpt load_hf_model(const std::string& dir, torch::ScalarType dtype, torch::Device device) {
  const auto hf = read_hf_model(dir);
  TinyGpt model(hf.config, /*dropout=*/0.0);
  model->to(dtype);
  attnkit::load_safetensors(*model, dir + "/model.safetensors", hf.names);  // strict
  model->to(device);
  model->eval();
  return model;
}

}  // namespace tiny_gpt
