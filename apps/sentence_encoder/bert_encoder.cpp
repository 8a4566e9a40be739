#include "bert_encoder.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

#include <attnkit/memory_budget.h>
#include <nlohmann/json.hpp>

namespace sentence_encoder {

BertConfig BertConfig::from_json(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("cannot open the model's config '" + path + "'");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& error) {
    throw std::runtime_error("'" + path + "' is not valid JSON: " + error.what());
  }
  const auto field = [&](const char* name) -> const nlohmann::json& {
    if (!json.contains(name))
      throw std::runtime_error("'" + path + "' has no \"" + name + "\"");
    return json[name];
  };
  const auto positive = [&](const char* name) {
    const auto& value = field(name);
    if (!value.is_number_integer() || value.get<int64_t>() <= 0)
      throw std::runtime_error("'" + path + "': \"" + name + "\" must be a positive integer, got " +
                               value.dump());
    return value.get<int64_t>();
  };
  BertConfig config;
  config.vocab_size = positive("vocab_size");
  config.hidden_size = positive("hidden_size");
  config.num_hidden_layers = positive("num_hidden_layers");
  config.num_attention_heads = positive("num_attention_heads");
  config.intermediate_size = positive("intermediate_size");
  config.max_position_embeddings = positive("max_position_embeddings");
  config.type_vocab_size = positive("type_vocab_size");
  if (json.contains("layer_norm_eps")) {
    const auto& eps = json["layer_norm_eps"];
    if (!eps.is_number() || !(eps.get<double>() > 0))
      throw std::runtime_error(
          "'" + path + "': \"layer_norm_eps\" must be a positive number, got " + eps.dump());
    config.layer_norm_eps = eps.get<double>();
  }
  // The weights' size, from the sizes alone, before anything is allocated: a config of
  // 1e12-wide layers is refused here, not by the allocator.
  const double h = static_cast<double>(config.hidden_size);
  const double weights = (static_cast<double>(config.vocab_size) + config.max_position_embeddings +
                          config.type_vocab_size) *
                             h +
                         static_cast<double>(config.num_hidden_layers) *
                             (4 * h * h + 2 * h * config.intermediate_size);
  const double bytes = 4 * weights;  // float32
  if (bytes > static_cast<double>(attnkit::memory_budget())) {
    std::ostringstream message;
    message << "'" << path << "': the model's float32 weights would take " << bytes / 1e9
            << " GB (vocab_size " << config.vocab_size << ", hidden_size " << config.hidden_size
            << ", num_hidden_layers " << config.num_hidden_layers << ", intermediate_size "
            << config.intermediate_size << ", max_position_embeddings "
            << config.max_position_embeddings << "), more than the memory budget of "
            << static_cast<double>(attnkit::memory_budget()) / 1e9
            << " GB (attnkit::memory_budget(): half of physical memory by default)";
    throw std::runtime_error(message.str());
  }
  if (json.value("model_type", "") != "bert")
    throw std::runtime_error("'" + path + "': expected \"model_type\": \"bert\", got " +
                             json.value("model_type", nlohmann::json("none")).dump());
  if (json.value("hidden_act", "gelu") != "gelu")
    throw std::runtime_error("'" + path + "': only \"hidden_act\": \"gelu\" is supported, got " +
                             field("hidden_act").dump());
  if (json.value("position_embedding_type", "absolute") != "absolute")
    throw std::runtime_error("'" + path + "': only absolute position embeddings are supported");
  if (config.hidden_size % config.num_attention_heads != 0)
    throw std::runtime_error("'" + path + "': hidden_size " + std::to_string(config.hidden_size) +
                             " is not a multiple of num_attention_heads " +
                             std::to_string(config.num_attention_heads));
  return config;
}

attnkit::NameMap bert_names() {
  const std::string layer = R"(encoder\.layer\.(\d+)\.)";
  return attnkit::NameMap{
      /*prefix=*/"bert.",  // BertFor... checkpoints hold the BertModel under "bert."
      /*ignored=*/{R"(embeddings\.position_ids)", R"(pooler\..*)"},
      /*rules=*/
      {
          {layer + R"(attention\.self\.query\.(weight|bias))", {"layers.$1.attention.W_query.$2"}},
          {layer + R"(attention\.self\.key\.(weight|bias))", {"layers.$1.attention.W_key.$2"}},
          {layer + R"(attention\.self\.value\.(weight|bias))", {"layers.$1.attention.W_value.$2"}},
          {layer + R"(attention\.output\.dense\.(weight|bias))",
           {"layers.$1.attention.out_proj.$2"}},
          {layer + R"(attention\.output\.LayerNorm\.(weight|bias))",
           {"layers.$1.attention_norm.$2"}},
          {layer + R"(intermediate\.dense\.(weight|bias))", {"layers.$1.ffn_in.$2"}},
          {layer + R"(output\.dense\.(weight|bias))", {"layers.$1.ffn_out.$2"}},
          {layer + R"(output\.LayerNorm\.(weight|bias))", {"layers.$1.ffn_norm.$2"}},
      }};
}

namespace {

torch::nn::LayerNorm layer_norm(const BertConfig& config) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({config.hidden_size}).eps(config.layer_norm_eps));
}

}  // namespace

BertEmbeddingsImpl::BertEmbeddingsImpl(const BertConfig& config)
    : word_embeddings(register_module("word_embeddings",
                                      torch::nn::Embedding(config.vocab_size, config.hidden_size))),
      position_embeddings(register_module(
          "position_embeddings",
          torch::nn::Embedding(config.max_position_embeddings, config.hidden_size))),
      token_type_embeddings(
          register_module("token_type_embeddings",
                          torch::nn::Embedding(config.type_vocab_size, config.hidden_size))),
      LayerNorm(register_module("LayerNorm", layer_norm(config))) {}

torch::Tensor BertEmbeddingsImpl::forward(const torch::Tensor& ids,
                                          const torch::Tensor& positions) {
  // One sentence per input: every token has type 0.
  const auto x = word_embeddings(ids) + position_embeddings(positions) +
                 token_type_embeddings->weight[0];  // (b, n, hidden)
  return LayerNorm(x);
}

namespace {

attnkit::MultiHeadAttention self_attention(const BertConfig& config) {
  const int64_t context =
      config.attention_context > 0 ? config.attention_context : config.max_position_embeddings;
  return attnkit::MultiHeadAttention(
      attnkit::MultiHeadAttentionOptions(config.hidden_size, config.hidden_size, context,
                                         /*dropout=*/0.0, config.num_attention_heads)
          .qkv_bias(true)
          .causal(false)
          .backend(attnkit::AttentionBackend::kAuto)  // the planner's pick, not the book's math
          .query_block_size(config.query_block_size)
          .key_block_size(config.key_block_size));
}

}  // namespace

BertLayerImpl::BertLayerImpl(const BertConfig& config)
    : attention(register_module("attention", self_attention(config))),
      attention_norm(register_module("attention_norm", layer_norm(config))),
      ffn_in(register_module("ffn_in",
                             torch::nn::Linear(config.hidden_size, config.intermediate_size))),
      ffn_out(register_module("ffn_out",
                              torch::nn::Linear(config.intermediate_size, config.hidden_size))),
      ffn_norm(register_module("ffn_norm", layer_norm(config))) {}

torch::Tensor BertLayerImpl::forward(torch::Tensor x, const attnkit::Mask& mask) {
  x = attention_norm(x + attention->forward(x, {}, {}, mask));
  return ffn_norm(x + ffn_out(torch::gelu(ffn_in(x))));
}

BertEncoderImpl::BertEncoderImpl(const BertConfig& config_)
    : config(config_),
      embeddings(register_module("embeddings", BertEmbeddings(config_))),
      layers(register_module("layers", torch::nn::ModuleList())) {
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    layers->push_back(BertLayer(config));
}

torch::Tensor BertEncoderImpl::hidden_states(const torch::Tensor& ids,
                                             const torch::Tensor& positions,
                                             const attnkit::Mask& mask) {
  if (ids.dim() != 2 || ids.size(1) == 0)
    throw std::invalid_argument("ids: expected (batch, tokens), got " + c10::str(ids.sizes()));
  auto x = embeddings(ids, positions);
  for (const auto& layer : *layers)
    x = layer->as<BertLayer>()->forward(x, mask);
  return x;
}

torch::Tensor BertEncoderImpl::forward(const torch::Tensor& ids, const torch::Tensor& lengths) {
  if (ids.dim() == 2 && ids.size(1) > config.max_position_embeddings)
    throw std::invalid_argument("ids: expected at most " +
                                std::to_string(config.max_position_embeddings) +
                                " tokens per sentence, got " + std::to_string(ids.size(1)));
  const auto positions = torch::arange(ids.size(-1), ids.options());  // (n)
  return hidden_states(ids, positions, attnkit::Mask::key_padding(lengths));
}

torch::Tensor BertEncoderImpl::mean_normalized(const torch::Tensor& sums,
                                               const torch::Tensor& lengths) {
  const auto mean = sums / lengths.unsqueeze(1).to(torch::kFloat32).clamp_min(1e-9);
  return torch::nn::functional::normalize(mean,
                                          torch::nn::functional::NormalizeFuncOptions().dim(1));
}

torch::Tensor BertEncoderImpl::embed(const torch::Tensor& ids, const torch::Tensor& lengths) {
  const auto hidden = forward(ids, lengths).to(torch::kFloat32);  // (b, n, hidden)
  const auto valid =
      (torch::arange(ids.size(1), lengths.options()).unsqueeze(0) < lengths.unsqueeze(1))
          .unsqueeze(-1)
          .to(torch::kFloat32);  // (b, n, 1)
  return mean_normalized((hidden * valid).sum(1), lengths);
}

torch::Tensor BertEncoderImpl::embed_packed(const torch::Tensor& ids,
                                            const torch::Tensor& lengths) {
  if (lengths.numel() > 0 && lengths.max().item<int64_t>() > config.max_position_embeddings)
    throw std::invalid_argument(
        "lengths: expected at most " + std::to_string(config.max_position_embeddings) +
        " tokens per sentence, got " + std::to_string(lengths.max().item<int64_t>()));
  const auto sentence = torch::repeat_interleave(lengths);  // (total): each token's sentence
  const auto starts = lengths.cumsum(0) - lengths;          // (s)
  const auto positions =
      torch::arange(ids.size(0), ids.options()) - starts.index_select(0, sentence);
  const auto hidden =
      hidden_states(ids.unsqueeze(0), positions.unsqueeze(0), attnkit::Mask::documents(sentence))
          .squeeze(0)
          .to(torch::kFloat32);  // (1, total, hidden) -> (total, hidden)
  const auto sums = torch::zeros({lengths.size(0), hidden.size(1)}, hidden.options())
                        .index_add_(0, sentence, hidden);  // (s, hidden)
  return mean_normalized(sums, lengths);
}

}  // namespace sentence_encoder
