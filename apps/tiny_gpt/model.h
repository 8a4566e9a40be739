#pragma once
// tiny_gpt's model: pre-norm decoder blocks on attnkit's attention layers, in three designs
// (GPT-2 style, Llama style, and Gemma's variant of the Llama style), one torch::nn::Module
// that attnkit::generate decodes.

#include <attnkit/attnkit.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tiny_gpt {

struct ModelConfig {
  int64_t vocab = 256;  // bytes
  int64_t context_length = 64;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  bool llama = false;
  double norm_eps = 1e-5;  // every LayerNorm or RMSNorm of the blocks and the final norm
  // The head reuses the token embedding's weight (GPT-2, Qwen3): no head module, no bias.
  bool tied_head = false;
  // GPT style only.
  bool qkv_bias = false;
  bool gelu_tanh = false;  // GPT-2's "gelu_new"; otherwise the exact (erf) GELU
  // Llama style only.
  int64_t kv_groups = 2;
  int64_t hidden = 192;  // SwiGLU width, about 8/3 d_model
  bool qk_norm = false;  // Qwen3's RMSNorm of queries and keys
  int64_t head_dim = 0;  // 0: d_model / heads; Qwen3's heads together may be wider
  attnkit::RopeOptions rope = attnkit::RopeOptions(64);
  // Per layer: a sliding window of that many tokens (Mistral, Phi-3, Gemma's local layers),
  // or 0 for full causal attention. Empty: every layer full.
  std::vector<int64_t> windows;
  // Gemma 3: the window layers' RoPE base (its local layers); unset: rope's for every layer.
  c10::optional<double> window_rope_theta;
  // Gemma 2: cap * tanh(score / cap) on the attention scores (0: none) and on the logits.
  double attention_softcap = 0.0;
  double final_softcap = 0.0;
  // The attention scores' scale (Gemma's query_pre_attn_scalar^-0.5); unset: 1 / sqrt(head_dim).
  c10::optional<double> attention_scale;
  // Gemma's design on top of the Llama style: RMSNorms whose weights are offsets from 1, a
  // norm after attention and after the feed-forward as well as before, GeGLU (tanh GELU) for
  // SwiGLU, and token embeddings scaled by sqrt(d_model).
  bool gemma = false;

  int64_t window_of(int64_t layer) const {
    return windows.empty() ? 0 : windows.at(static_cast<size_t>(layer));
  }
};

// One pre-norm decoder block: x + attention(norm(x)), then x + feed_forward(norm(x)). Any
// attnkit attention layer with a KV cache attends; each design supplies its norms and
// feed-forward.
struct DecoderBlock : torch::nn::Module {
  explicit DecoderBlock(std::shared_ptr<attnkit::CachedAttentionLayer> layer)
      : attention(std::move(layer)) {
    register_module("attention", attention->as_module());
  }

  torch::Tensor forward(torch::Tensor x) {  // (b, n, d) -> (b, n, d)
    x = x + after_attention(attention->forward(attention_norm(x)));
    return x + after_feed_forward(feed_forward(feed_forward_norm(x)));
  }
  // The same for the next tokens of sequences whose earlier keys and values are in `cache`;
  // with `lengths` (b), row r brings its first lengths[r] tokens, the rest is padding.
  torch::Tensor forward_with_cache(torch::Tensor x, attnkit::KVCache& cache,
                                   const torch::Tensor& lengths) {
    x = x + after_attention(attention->forward_with_cache(attention_norm(x), cache, lengths));
    return x + after_feed_forward(feed_forward(feed_forward_norm(x)));
  }
  // The same on a paged pool: row r brings the next n tokens of sequences[r].
  torch::Tensor forward_with_cache(torch::Tensor x, attnkit::PagedKVCache& pool,
                                   const std::vector<int64_t>& sequences) {
    x = x + after_attention(attention->forward_with_cache(attention_norm(x), pool, sequences));
    return x + after_feed_forward(feed_forward(feed_forward_norm(x)));
  }
  attnkit::KVCache make_kv_cache(int64_t batch, int64_t capacity) {
    return attention->make_kv_cache(batch, capacity);
  }
  attnkit::PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) {
    return attention->make_paged_kv_cache(num_pages, page_size);
  }

  virtual torch::Tensor attention_norm(const torch::Tensor& x) = 0;
  virtual torch::Tensor feed_forward_norm(const torch::Tensor& x) = 0;
  virtual torch::Tensor feed_forward(const torch::Tensor& x) = 0;
  // What a design does to each branch's output before the residual sum (Gemma: a norm).
  virtual torch::Tensor after_attention(const torch::Tensor& y) { return y; }
  virtual torch::Tensor after_feed_forward(const torch::Tensor& y) { return y; }

  std::shared_ptr<attnkit::CachedAttentionLayer> attention;
};

// GPT-2 style: LayerNorms, multi-head attention and a GELU MLP.
struct GptBlock : DecoderBlock {
  GptBlock(const ModelConfig& c, double dropout)
      : DecoderBlock(attnkit::MultiHeadAttention(c.d_model, c.d_model, c.context_length, dropout,
                                                 c.heads, c.qkv_bias)
                         .ptr()),
        attention_norm_(register_module("attention_norm", norm(c))),
        feed_forward_norm_(register_module("feed_forward_norm", norm(c))),
        feed_forward_(register_module(
            "feed_forward",
            torch::nn::Sequential(torch::nn::Linear(c.d_model, 4 * c.d_model),
                                  torch::nn::GELU(torch::nn::GELUOptions().approximate(
                                      c.gelu_tanh ? "tanh" : "none")),
                                  torch::nn::Linear(4 * c.d_model, c.d_model)))) {}
  static torch::nn::LayerNorm norm(const ModelConfig& c) {
    return torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model}).eps(c.norm_eps));
  }

  torch::Tensor attention_norm(const torch::Tensor& x) override { return attention_norm_(x); }
  torch::Tensor feed_forward_norm(const torch::Tensor& x) override { return feed_forward_norm_(x); }
  torch::Tensor feed_forward(const torch::Tensor& x) override { return feed_forward_->forward(x); }

  torch::nn::LayerNorm attention_norm_;
  torch::nn::LayerNorm feed_forward_norm_;
  torch::nn::Sequential feed_forward_;
};

// Llama's feed-forward, SwiGLU: fc3(silu(fc1(x)) * fc2(x)), no biases; Gemma's GeGLU has the
// tanh GELU for silu.
struct GatedFeedForwardImpl : torch::nn::Module {
  GatedFeedForwardImpl(int64_t d_model, int64_t hidden, bool gelu)
      : fc1(register_module("fc1", linear(d_model, hidden))),
        fc2(register_module("fc2", linear(d_model, hidden))),
        fc3(register_module("fc3", linear(hidden, d_model))),
        gelu(gelu) {}
  static torch::nn::Linear linear(int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto gate = fc1(x);
    return fc3((gelu ? torch::gelu(gate, "tanh") : torch::silu(gate)) * fc2(x));
  }

  torch::nn::Linear fc1, fc2, fc3;
  bool gelu;
};
TORCH_MODULE(GatedFeedForward);

// Llama style: RMSNorm, grouped-query attention with RoPE (and QK-norm for Qwen3, biases for
// Qwen2, a window for Mistral), SwiGLU.
struct LlamaBlock : DecoderBlock {
  LlamaBlock(const ModelConfig& c, double dropout, int64_t layer)
      : DecoderBlock(attnkit::GroupedQueryAttention(attention_options(c, dropout, layer)).ptr()),
        attention_norm_(register_module("attention_norm", norm(c))),
        feed_forward_norm_(register_module("feed_forward_norm", norm(c))),
        feed_forward_(
            register_module("feed_forward", GatedFeedForward(c.d_model, c.hidden, c.gemma))) {}
  static attnkit::RMSNorm norm(const ModelConfig& c) {
    return attnkit::RMSNorm(
        attnkit::RMSNormOptions(c.d_model).eps(c.norm_eps).unit_offset(c.gemma));
  }
  // Layer `layer`'s attention: its window (and, for Gemma 3's window layers, their RoPE base).
  static attnkit::GroupedQueryAttentionOptions attention_options(const ModelConfig& c,
                                                                 double dropout, int64_t layer) {
    const int64_t heads_width = c.heads * (c.head_dim > 0 ? c.head_dim : c.d_model / c.heads);
    const int64_t window = c.window_of(layer);
    auto rope = c.rope;
    if (window > 0 && c.window_rope_theta)
      rope.theta_base(*c.window_rope_theta).freq_config(c10::nullopt);
    auto options =
        attnkit::GroupedQueryAttentionOptions(c.d_model, heads_width, dropout, c.heads, c.kv_groups)
            .qkv_bias(c.qkv_bias)
            .rope(rope)
            .qk_norm(c.qk_norm)
            .qk_norm_eps(c.norm_eps)
            .qk_norm_unit_offset(c.gemma)
            .scale(c.attention_scale);
    if (window > 0)
      options.sliding_window_size(window);
    if (c.attention_softcap > 0.0)
      options.score_mod(attnkit::score_mods::softcap(c.attention_softcap));
    if (heads_width != c.d_model)
      options.output_dim(c.d_model);
    return options;
  }

  torch::Tensor attention_norm(const torch::Tensor& x) override { return attention_norm_(x); }
  torch::Tensor feed_forward_norm(const torch::Tensor& x) override { return feed_forward_norm_(x); }
  torch::Tensor feed_forward(const torch::Tensor& x) override { return feed_forward_(x); }

  attnkit::RMSNorm attention_norm_;
  attnkit::RMSNorm feed_forward_norm_;
  GatedFeedForward feed_forward_;
};

// Gemma 2 and 3: the Llama block with a norm on each branch's output too.
struct GemmaBlock : LlamaBlock {
  GemmaBlock(const ModelConfig& c, double dropout, int64_t layer)
      : LlamaBlock(c, dropout, layer),
        post_attention_norm_(register_module("post_attention_norm", norm(c))),
        post_feed_forward_norm_(register_module("post_feed_forward_norm", norm(c))) {}

  torch::Tensor after_attention(const torch::Tensor& y) override { return post_attention_norm_(y); }
  torch::Tensor after_feed_forward(const torch::Tensor& y) override {
    return post_feed_forward_norm_(y);
  }

  attnkit::RMSNorm post_attention_norm_;
  attnkit::RMSNorm post_feed_forward_norm_;
};

// A torch::nn::Module and an attnkit::CausalLanguageModel, so attnkit::generate can decode it,
// one prompt or a batch of prompts of different lengths.
struct TinyGptImpl : torch::nn::Module, attnkit::CausalLanguageModel {
  TinyGptImpl(const ModelConfig& config, double dropout)
      : config(config),
        token_embedding(
            register_module("token_embedding", torch::nn::Embedding(config.vocab, config.d_model))),
        blocks(register_module("blocks", torch::nn::ModuleList())) {
    if (!config.llama) {
      position_embedding = register_module(
          "position_embedding", torch::nn::Embedding(config.context_length, config.d_model));
      final_norm = torch::nn::AnyModule(GptBlock::norm(config));
    } else {
      final_norm = torch::nn::AnyModule(LlamaBlock::norm(config));
    }
    register_module("final_norm", final_norm.ptr());
    if (!config.tied_head) {
      head = register_module(
          "head", torch::nn::Linear(
                      torch::nn::LinearOptions(config.d_model, config.vocab).bias(!config.llama)));
    }
    for (int64_t i = 0; i < config.layers; ++i) {
      if (config.gemma)
        blocks->push_back(std::make_shared<GemmaBlock>(config, dropout, i));
      else if (config.llama)
        blocks->push_back(std::make_shared<LlamaBlock>(config, dropout, i));
      else
        blocks->push_back(std::make_shared<GptBlock>(config, dropout));
    }
  }

  torch::Tensor forward(const torch::Tensor& tokens) {  // (b, n) -> logits (b, n, vocab)
    auto x = embed(tokens, torch::arange(tokens.size(1), tokens.options()));
    for (auto& block : *blocks) {
      x = block->as<DecoderBlock>()->forward(x);
    }
    return project_to_vocab(final_norm.forward(x));
  }
  // (b, n, d) -> (b, n, vocab), Gemma 2's logits capped.
  torch::Tensor project_to_vocab(const torch::Tensor& x) {
    const auto logits =
        config.tied_head ? torch::nn::functional::linear(x, token_embedding->weight) : head(x);
    if (config.final_softcap <= 0.0)
      return logits;
    return torch::tanh(logits / config.final_softcap) * config.final_softcap;
  }

  // attnkit::CausalLanguageModel
  torch::Tensor logits(const torch::Tensor& tokens) override { return forward(tokens); }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<attnkit::KVCache>& caches) override {
    return with_cache(tokens, {}, caches);
  }
  torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                         std::vector<attnkit::KVCache>& caches) override {
    return with_cache(tokens, lengths, caches);
  }
  std::vector<attnkit::KVCache> make_kv_caches(int64_t batch, int64_t capacity) override {
    std::vector<attnkit::KVCache> caches;
    for (auto& block : *blocks) {
      caches.push_back(block->as<DecoderBlock>()->make_kv_cache(batch, capacity));
    }
    return caches;
  }
  std::vector<attnkit::PagedKVCache> make_paged_kv_caches(int64_t num_pages,
                                                          int64_t page_size) override {
    std::vector<attnkit::PagedKVCache> pools;
    for (auto& block : *blocks)
      pools.push_back(block->as<DecoderBlock>()->make_paged_kv_cache(num_pages, page_size));
    return pools;
  }
  // Row r's tokens at positions [pools' length of sequences[r], ... + n).
  torch::Tensor paged_logits(const torch::Tensor& tokens, std::vector<attnkit::PagedKVCache>& pools,
                             const std::vector<int64_t>& sequences) override {
    std::vector<int64_t> starts;
    for (const int64_t sequence : sequences)
      starts.push_back(pools.front().length(sequence));
    const auto positions = torch::tensor(starts).to(tokens.device()).unsqueeze(1) +
                           torch::arange(tokens.size(1), tokens.options());  // (b, n)
    auto x = embed(tokens, positions);
    for (size_t i = 0; i < pools.size(); ++i)
      x = blocks[i]->as<DecoderBlock>()->forward_with_cache(x, pools[i], sequences);
    return project_to_vocab(final_norm.forward(x));
  }
  int64_t context_length() const override { return config.context_length; }

  // Tokens (b, n) continuing the sequences in `caches`: row r's token i at position
  // caches' length of row r + i. The padding of a ragged call may pass the position table; its
  // positions are clamped (its outputs are not used).
  torch::Tensor with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                           std::vector<attnkit::KVCache>& caches) {
    const auto starts = caches.front().lengths().to(tokens.device()).unsqueeze(1);  // (b, 1)
    const auto positions = (starts + torch::arange(tokens.size(1), tokens.options()))
                               .clamp_max(config.context_length - 1);  // (b, n)
    auto x = embed(tokens, positions);
    for (size_t i = 0; i < caches.size(); ++i) {
      x = blocks[i]->as<DecoderBlock>()->forward_with_cache(x, caches[i], lengths);
    }
    return project_to_vocab(final_norm.forward(x));
  }

  // Token embeddings of tokens (b, n), plus those of `positions` ((n) or (b, n)) in the GPT
  // design; the Llama design rotates positions into queries and keys instead, and Gemma's
  // scales the embeddings by sqrt(d_model).
  torch::Tensor embed(const torch::Tensor& tokens, const torch::Tensor& positions) {
    auto x = token_embedding(tokens);
    if (config.gemma)
      return x * std::sqrt(static_cast<double>(config.d_model));
    return config.llama ? x : x + position_embedding(positions);
  }

  ModelConfig config;
  torch::nn::Embedding token_embedding;
  torch::nn::Embedding position_embedding{nullptr};
  torch::nn::ModuleList blocks;
  torch::nn::AnyModule final_norm;
  torch::nn::Linear head{nullptr};  // unset with tied_head
};
TORCH_MODULE(TinyGpt);

}  // namespace tiny_gpt
