#pragma once

// A BERT encoder (MiniLM-L6 and the rest of BertModel's family) made of attnkit's modules:
// each layer's self-attention is an attnkit::MultiHeadAttention (not causal, with biases,
// keys masked by the sentences' lengths), with BERT's embeddings, post-LayerNorm residual
// blocks and exact (erf) GELU. It loads a Hugging Face `model.safetensors` through
// `bert_names()`, and pools sentence embeddings as sentence-transformers' all-MiniLM-L6-v2
// does: the mean over each sentence's tokens, then L2 normalisation.

#include <string>

#include <attnkit/attnkit.h>
#include <torch/torch.h>

namespace sentence_encoder {

/// The fields of a BertModel `config.json` that the encoder needs.
struct BertConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t intermediate_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t type_vocab_size = 0;
  double layer_norm_eps = 1e-12;
  // Not in config.json: how the attention layers run.
  /// The longest sequence an attention layer takes (its context_length). 0:
  /// max_position_embeddings; packed batches (`embed_packed`) need the batch's tokens.
  int64_t attention_context = 0;
  /// The chunked kernel's tiles (attnkit's defaults). Packed sentences want tiles near a
  /// sentence's length, so that few of a tile's scores fall outside its sentence.
  int64_t query_block_size = 128;
  int64_t key_block_size = 1024;

  /// Reads `config.json`; throws std::runtime_error naming the file and the field when one is
  /// missing, or when the model is not a BERT with absolute positions and GELU.
  static BertConfig from_json(const std::string& path);
};

/// Hugging Face's BertModel names (`encoder.layer.3.attention.self.query.weight`) to this
/// encoder's (`layers.3.attention.W_query.weight`); the embeddings keep their names, and the
/// pooler (which sentence embeddings do not use) and the `position_ids` buffer are dropped.
attnkit::NameMap bert_names();

struct BertEmbeddingsImpl : torch::nn::Module {
  explicit BertEmbeddingsImpl(const BertConfig& config);
  /// ids (b, n), positions (n) or (b, n) -> (b, n, hidden)
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions);

  torch::nn::Embedding word_embeddings{nullptr}, position_embeddings{nullptr},
      token_type_embeddings{nullptr};
  torch::nn::LayerNorm LayerNorm{nullptr};  // Hugging Face's name, kept
};
TORCH_MODULE(BertEmbeddings);

struct BertLayerImpl : torch::nn::Module {
  explicit BertLayerImpl(const BertConfig& config);
  /// x (b, n, hidden); mask: which keys each token sees (the sentences' lengths as a
  /// key-padding mask, or the sentences of a packed sequence as documents).
  torch::Tensor forward(torch::Tensor x, const attnkit::Mask& mask);

  attnkit::MultiHeadAttention attention{nullptr};
  torch::nn::LayerNorm attention_norm{nullptr};
  torch::nn::Linear ffn_in{nullptr}, ffn_out{nullptr};
  torch::nn::LayerNorm ffn_norm{nullptr};
};
TORCH_MODULE(BertLayer);

struct BertEncoderImpl : torch::nn::Module {
  explicit BertEncoderImpl(const BertConfig& config);
  /// ids (b, n) int64, right-padded; lengths (b) int64 -> hidden states (b, n, hidden).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& lengths);
  /// The sentence embeddings (b, hidden), in float32: the mean of each sentence's hidden
  /// states over its `lengths` tokens, L2-normalised.
  torch::Tensor embed(const torch::Tensor& ids, const torch::Tensor& lengths);
  /// The same embeddings (s, hidden) of s sentences packed into one sequence without padding:
  /// ids (total) int64, the sentences one after another; lengths (s) int64. Each sentence's
  /// tokens attend only to its own (attnkit::Mask::documents), from position 0.
  torch::Tensor embed_packed(const torch::Tensor& ids, const torch::Tensor& lengths);

  BertConfig config;
  BertEmbeddings embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};

 private:
  // ids (b, n), positions (n) or (b, n) -> hidden states (b, n, hidden)
  torch::Tensor hidden_states(const torch::Tensor& ids, const torch::Tensor& positions,
                              const attnkit::Mask& mask);
  // hidden (s, hidden) sums of each sentence's states, divided by lengths (s), L2-normalised
  static torch::Tensor mean_normalized(const torch::Tensor& sums, const torch::Tensor& lengths);
};
TORCH_MODULE(BertEncoder);

}  // namespace sentence_encoder
