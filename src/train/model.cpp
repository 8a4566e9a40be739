#include "model.h"

#include <type_traits>
#include <utility>

#include "attnkit/attnkit.h"
#include "modules/module_helpers.h"

namespace attnkit::train {

const std::vector<std::string>& module_names() {
  static const std::vector<std::string> names{
      "sa-v1", "sa-v2", "causal", "mha-wrapper", "mha", "mha-combined", "gqa", "mqa", "mla"};
  return names;
}

bool has_backends_and_kv_cache(const std::string& module) {
  return module == "mha" || module == "mha-combined" || module == "gqa" || module == "mqa" ||
         module == "mla";
}

namespace {

int64_t kv_groups_of(const ModelConfig& c) {
  return c.module == "mqa" ? 1 : (c.kv_groups > 0 ? c.kv_groups : 2);
}

}  // namespace

void check_model_config(const ModelConfig& c) {
  const auto& names = module_names();
  TORCH_CHECK(std::find(names.begin(), names.end(), c.module) != names.end(),
              "--module: unknown module '", c.module,
              "'; expected sa-v1, sa-v2, causal, mha-wrapper, mha, mha-combined, gqa, mqa or mla");
  const bool unmasked = c.module == "sa-v1" || c.module == "sa-v2";
  const bool family = c.module == "gqa" || c.module == "mqa" || c.module == "mla";
  const bool always_causal = c.module == "causal" || c.module == "mha-wrapper" || family;
  TORCH_CHECK(!(unmasked && c.causal), "--module ", c.module,
              " has no causal mask, so on a causal task it would see the tokens it must "
              "predict; use causal, mha-wrapper, mha, mha-combined, gqa, mqa or mla");
  TORCH_CHECK(!(always_causal && !c.causal), "--module ", c.module,
              " always applies a causal mask, but this task needs every token to see every "
              "other (bidirectional); use sa-v1, sa-v2, mha or mha-combined");
  TORCH_CHECK(c.d_model >= 1, "--d-model: expected >= 1, got ", c.d_model);
  TORCH_CHECK(c.heads >= 1, "--heads: expected >= 1, got ", c.heads);
  TORCH_CHECK(c.layers >= 1, "--layers: expected >= 1, got ", c.layers);
  const bool multi_head =
      c.module == "mha-wrapper" || c.module == "mha" || c.module == "mha-combined" || family;
  TORCH_CHECK(!multi_head || c.d_model % c.heads == 0, "--d-model ", c.d_model,
              " must be divisible by --heads ", c.heads, " for --module ", c.module);
  TORCH_CHECK(c.dropout >= 0.0 && c.dropout < 1.0, "--dropout: expected a value in [0, 1), got ",
              c.dropout);
  const bool has_backends = has_backends_and_kv_cache(c.module);
  TORCH_CHECK(has_backends || c.backend.empty(), "--backend ", c.backend,
              ": only mha, mha-combined, gqa, mqa and mla have backends; --module ", c.module,
              " has one implementation");
  TORCH_CHECK(
      !has_backends || c.backend == "math" || c.backend == "fused" || c.backend == "chunked",
      "--backend: unknown backend '", c.backend, "'; expected math, fused or chunked");
  // The family's sizes: each flag only where the module has that size.
  TORCH_CHECK(c.kv_groups >= 0, "--kv-groups: expected >= 1, got ", c.kv_groups);
  TORCH_CHECK(c.kv_groups == 0 || c.module == "gqa", "--kv-groups ", c.kv_groups,
              ": only --module gqa has a choice of key/value groups (mqa has 1), got --module ",
              c.module);
  TORCH_CHECK(c.module != "gqa" || c.heads % kv_groups_of(c) == 0, "--kv-groups ", kv_groups_of(c),
              " must divide --heads ", c.heads, " for --module gqa");
  TORCH_CHECK(c.window >= 0, "--window: expected >= 1 (0 = no window), got ", c.window);
  const bool windowed =
      c.module == "mha" || c.module == "mha-combined" || c.module == "gqa" || c.module == "mqa";
  TORCH_CHECK(c.window == 0 || windowed, "--window ", c.window,
              ": only mha, mha-combined, gqa and mqa have a sliding window, got --module ",
              c.module);
  TORCH_CHECK(c.window == 0 || c.causal, "--window ", c.window,
              " limits how far back a token looks, so it needs a causal task");
  TORCH_CHECK(!(c.rope || c.qk_norm) || windowed, c.rope ? "--rope" : "--qk-norm",
              ": only mha, mha-combined, gqa and mqa take it, got --module ", c.module);
  TORCH_CHECK(!c.rope || (c.d_model / c.heads) % 2 == 0, "--rope rotates pairs of a head's ",
              "features, so d-model / heads must be even, got ", c.d_model, " / ", c.heads, " = ",
              c.d_model / c.heads);
  TORCH_CHECK(c.latent_dim >= 0, "--latent-dim: expected >= 1 (0 = the default), got ",
              c.latent_dim);
  TORCH_CHECK(c.latent_dim == 0 || c.module == "mla", "--latent-dim ", c.latent_dim,
              ": only --module mla has a latent, got --module ", c.module);
}

namespace {

using AttendWithWeights =
    std::function<functional::AttentionOutput(const torch::Tensor&, const Mask&)>;
using Attend = std::function<torch::Tensor(const torch::Tensor&, const Mask&)>;

// Binds the forward_with_weights and forward of a module that takes no mask (the book's
// modules) to the block's two callables.
template <typename Holder>
void bind(Holder holder, const std::string& name, AttendWithWeights& attend_with_weights,
          Attend& attend) {
  const auto check = [name](const Mask& mask) {
    TORCH_CHECK(mask.is_none(), "--module ", name,
                " takes no mask, so it cannot keep packed documents apart (--pack); use mha, "
                "mha-combined, gqa, mqa or mla");
  };
  attend_with_weights = [holder, check](const torch::Tensor& x, const Mask& mask) mutable {
    check(mask);
    return holder->forward_with_weights(x);
  };
  attend = [holder, check](const torch::Tensor& x, const Mask& mask) mutable {
    check(mask);
    return holder->forward(x);
  };
}

// The same for a module whose forward(query, key, value, mask) takes a mask (self-attention:
// no key, no value).
template <typename Holder>
void bind_masked(Holder holder, AttendWithWeights& attend_with_weights, Attend& attend) {
  attend_with_weights = [holder](const torch::Tensor& x, const Mask& mask) mutable {
    return holder->forward_with_weights(x, {}, {}, mask);
  };
  attend = [holder](const torch::Tensor& x, const Mask& mask) mutable {
    return holder->forward(x, {}, {}, mask);
  };
}

// Binds the KV-cache methods of a module that has them.
// Without lengths: forward_with_cache(x, cache); with: the ragged overload.
template <typename Holder>
void bind_cache(Holder holder,
                std::function<torch::Tensor(const torch::Tensor&, KVCache&, const torch::Tensor&)>&
                    attend_with_cache,
                std::function<KVCache(int64_t, int64_t)>& make_kv_cache) {
  attend_with_cache = [holder](const torch::Tensor& x, KVCache& cache,
                               const torch::Tensor& lengths) mutable {
    return lengths.defined() ? holder->forward_with_cache(x, cache, lengths)
                             : holder->forward_with_cache(x, cache);
  };
  make_kv_cache = [holder](int64_t batch, int64_t capacity) {
    return holder->make_kv_cache(batch, capacity);
  };
}

}  // namespace

BlockImpl::BlockImpl(const ModelConfig& c) : module_name_(c.module) {
  const auto d = c.d_model;
  attention_norm_ =
      register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  // Empty: the modules' own default (math); attnkit-train resolves it to fused first.
  const auto backend = c.backend.empty() ? AttentionBackend::kMath : parse_backend(c.backend);
  const auto window = c.window > 0 ? c10::optional<int64_t>(c.window) : c10::nullopt;
  const auto rope = c.rope ? c10::optional<RopeOptions>(RopeOptions(c.context_length))
                           : c10::optional<RopeOptions>();
  const auto mha_options = MultiHeadAttentionOptions(d, d, c.context_length, c.dropout, c.heads)
                               .causal(c.causal)
                               .backend(backend)
                               .sliding_window_size(window)
                               .rope(rope)
                               .qk_norm(c.qk_norm);
  if (c.module == "sa-v1") {
    SelfAttentionV1 attention(d, d);
    attention_ = register_module("attention", attention);
    bind(attention, c.module, attend_with_weights_, attend_);
  } else if (c.module == "sa-v2") {
    SelfAttentionV2 attention(d, d);
    attention_ = register_module("attention", attention);
    bind(attention, c.module, attend_with_weights_, attend_);
  } else if (c.module == "causal") {
    CausalAttention attention(d, d, c.context_length, c.dropout);
    attention_ = register_module("attention", attention);
    bind(attention, c.module, attend_with_weights_, attend_);
  } else if (c.module == "mha-wrapper") {
    // Each head d_model / heads wide, so the concatenation is d_model wide.
    MultiHeadAttentionWrapper attention(d, d / c.heads, c.context_length, c.dropout, c.heads);
    attention_ = register_module("attention", attention);
    bind(attention, c.module, attend_with_weights_, attend_);
  } else if (c.module == "mha") {
    MultiHeadAttention attention(mha_options);
    attention_ = register_module("attention", attention);
    bind_masked(attention, attend_with_weights_, attend_);
    bind_cache(attention, attend_with_cache_, make_kv_cache_);
  } else if (c.module == "mha-combined") {
    MultiHeadAttentionCombinedQKV attention(mha_options);
    attention_ = register_module("attention", attention);
    bind_masked(attention, attend_with_weights_, attend_);
    bind_cache(attention, attend_with_cache_, make_kv_cache_);
  } else if (c.module == "gqa" || c.module == "mqa") {
    GroupedQueryAttention attention(
        GroupedQueryAttentionOptions(d, d, c.dropout, c.heads, kv_groups_of(c))
            .backend(backend)
            .sliding_window_size(window)
            .rope(rope)
            .qk_norm(c.qk_norm));
    attention_ = register_module("attention", attention);
    bind_masked(attention, attend_with_weights_, attend_);
    bind_cache(attention, attend_with_cache_, make_kv_cache_);
  } else {
    MultiHeadLatentAttention attention(
        MultiHeadLatentAttentionOptions(d, d, c.dropout, c.heads)
            .backend(backend)
            .latent_dim(c.latent_dim > 0 ? c10::optional<int64_t>(c.latent_dim) : c10::nullopt));
    attention_ = register_module("attention", attention);
    bind_masked(attention, attend_with_weights_, attend_);
    bind_cache(attention, attend_with_cache_, make_kv_cache_);
  }
  if (c.ffn) {
    feed_forward_norm_ = register_module("feed_forward_norm",
                                         torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    feed_forward_up_ = torch::nn::Linear(d, 4 * d);
    feed_forward_down_ = torch::nn::Linear(4 * d, d);
    feed_forward_ = register_module(
        "feed_forward", torch::nn::Sequential(feed_forward_up_, torch::nn::GELU(),
                                              torch::nn::Dropout(c.dropout), feed_forward_down_));
  }
}

torch::Tensor BlockImpl::forward(torch::Tensor x, const Mask& mask, torch::Tensor* weights) {
  if (weights != nullptr) {
    auto attended = attend_with_weights_(attention_norm_(x), mask);
    // Single-head modules give (b, n, n): add the head dimension.
    *weights = attended.weights.dim() == 3 ? attended.weights.unsqueeze(1) : attended.weights;
    x = x + attended.context;
  } else {
    x = x + attend_(attention_norm_(x), mask);
  }
  if (feed_forward_) {
    x = x + feed_forward_->forward(feed_forward_norm_(x));
  }
  return x;
}

namespace {

// A ragged step's lengths (b) on the host; empty for an undefined tensor (a uniform step).
std::vector<int64_t> host_lengths(const torch::Tensor& lengths) {
  if (!lengths.defined())
    return {};
  const auto host = lengths.to(torch::kCPU, torch::kInt64).contiguous();
  return {host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel()};
}

}  // namespace

torch::Tensor BlockImpl::forward_with_cache(torch::Tensor x, KVCache& cache) {
  return forward_with_cache(std::move(x), cache, torch::Tensor());
}

torch::Tensor BlockImpl::forward_with_cache(torch::Tensor x, KVCache& cache,
                                            const torch::Tensor& lengths) {
  TORCH_CHECK(attend_with_cache_, "--module ", module_name_, " has no KV cache");
  x = x + attend_with_cache_(attention_norm_(x), cache, lengths);
  if (feed_forward_) {
    // Norm, Linear, GELU, Dropout (a no-op: caches are for inference), Linear, each per
    // token: a one-row step's products through detail::project, a mostly padded ragged
    // step's whole feed-forward on its valid tokens.
    const auto feed_forward = [&](const torch::Tensor& h) {
      return detail::project(feed_forward_down_,
                             torch::gelu(detail::project(feed_forward_up_, feed_forward_norm_(h))));
    };
    const detail::ValidTokens valid(x, host_lengths(lengths));
    x = valid.packs() ? valid.add_to(x, feed_forward(valid.pack(x))) : x + feed_forward(x);
  }
  return x;
}

KVCache BlockImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  TORCH_CHECK(make_kv_cache_, "--module ", module_name_,
              " has no KV cache (mha, mha-combined, gqa, mqa and mla have one); generate with "
              "--no-kv-cache");
  return make_kv_cache_(batch, capacity);
}

AttentionModelImpl::AttentionModelImpl(const ModelConfig& config) : config_(config) {
  check_model_config(config_);
  token_embedding_ =
      register_module("token_embedding", torch::nn::Embedding(config_.vocab_size, config_.d_model));
  if (!config_.rope) {  // RoPE gives the attention its positions instead
    position_embedding_ = register_module(
        "position_embedding", torch::nn::Embedding(config_.context_length, config_.d_model));
  }
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.layers; ++i) {
    blocks_->push_back(Block(config_));
  }
  final_norm_ = register_module(
      "final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config_.d_model})));
  head_ = register_module("head", torch::nn::Linear(config_.d_model, config_.vocab_size));
}

torch::Tensor AttentionModelImpl::embed(const torch::Tensor& tokens,
                                        const torch::Tensor& positions) {
  if (!position_embedding_)
    return token_embedding_(tokens);                                 // (b, n, d_model)
  return token_embedding_(tokens) + position_embedding_(positions);  // (b, n, d_model)
}

namespace {

// Each token's position in its document, (b, n): its index minus that of the document's
// first token (where the id changes, or 0), so every packed document starts at position 0
// as it does alone and in generation.
torch::Tensor positions_in_documents(const torch::Tensor& document_ids) {
  const auto n = document_ids.size(1);
  const auto index = torch::arange(n, document_ids.options()).expand_as(document_ids);
  const auto starts_document = torch::ones_like(document_ids, torch::kBool);
  starts_document.slice(1, 1).copy_(document_ids.slice(1, 1).ne(document_ids.slice(1, 0, -1)));
  const auto document_start =
      std::get<0>(index.masked_fill(starts_document.logical_not(), 0).cummax(1));
  return index - document_start;
}

}  // namespace

torch::Tensor AttentionModelImpl::run(const torch::Tensor& tokens,
                                      const torch::Tensor& document_ids,
                                      std::vector<torch::Tensor>* maps) {
  Mask mask;
  torch::Tensor positions = torch::arange(tokens.size(1), tokens.options());
  if (document_ids.defined()) {
    TORCH_CHECK(document_ids.sizes() == tokens.sizes(),
                "[AttentionModel::forward] document_ids: expected the tokens' shape ",
                tokens.sizes(), ", got ", document_ids.sizes());
    mask = Mask::documents(document_ids, /*causal=*/config_.causal);
    positions = positions_in_documents(document_ids);
  }
  auto x = embed(tokens, positions);
  for (auto& block : *blocks_) {
    torch::Tensor weights;
    x = block->as<BlockImpl>()->forward(x, mask, maps ? &weights : nullptr);
    if (maps)
      maps->push_back(weights);
  }
  return head_(final_norm_(x));
}

torch::Tensor AttentionModelImpl::forward(const torch::Tensor& tokens,
                                          const torch::Tensor& document_ids) {
  return run(tokens, document_ids, nullptr);
}

torch::Tensor AttentionModelImpl::logits_with_cache(const torch::Tensor& tokens,
                                                    std::vector<KVCache>& caches) {
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == config_.layers,
              "[AttentionModel::logits_with_cache] expected one cache per layer (", config_.layers,
              "), got ", caches.size());
  const int64_t start = caches.front().size();
  TORCH_CHECK(start + tokens.size(1) <= config_.context_length,
              "[AttentionModel::logits_with_cache] ", tokens.size(1), " tokens after the ", start,
              " cached would pass context_length ", config_.context_length);
  auto x = embed(tokens, torch::arange(start, start + tokens.size(1), tokens.options()));
  for (size_t i = 0; i < caches.size(); ++i) {
    x = blocks_[i]->as<BlockImpl>()->forward_with_cache(x, caches[i]);
  }
  return detail::project(head_, final_norm_(x));
}

torch::Tensor AttentionModelImpl::ragged_logits_with_cache(const torch::Tensor& tokens,
                                                           const torch::Tensor& lengths,
                                                           std::vector<KVCache>& caches) {
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == config_.layers,
              "[AttentionModel::ragged_logits_with_cache] expected one cache per layer (",
              config_.layers, "), got ", caches.size());
  // Row r's tokens at positions lengths()[r] + i: (b, n). The padding's positions may pass
  // the context; they are clamped (their outputs are not used, and the attention layers
  // check each row's real end).
  const auto starts = caches.front().lengths().to(tokens.device()).unsqueeze(1);
  const auto positions = (starts + torch::arange(tokens.size(1), tokens.options()).unsqueeze(0))
                             .clamp_max(config_.context_length - 1);
  auto x = embed(tokens, positions);
  for (size_t i = 0; i < caches.size(); ++i) {
    x = blocks_[i]->as<BlockImpl>()->forward_with_cache(x, caches[i], lengths);
  }
  const detail::ValidTokens valid(x, host_lengths(lengths));
  if (valid.packs())  // the norm and head per token: on the valid tokens alone
    return valid.unpack(detail::project(head_, final_norm_(valid.pack(x))));
  return detail::project(head_, final_norm_(x));
}

std::vector<KVCache> AttentionModelImpl::make_kv_caches(int64_t batch, int64_t capacity) {
  std::vector<KVCache> caches;
  for (auto& block : *blocks_) {
    caches.push_back(block->as<BlockImpl>()->make_kv_cache(batch, capacity));
  }
  return caches;
}

std::vector<torch::Tensor> AttentionModelImpl::attention_maps(const torch::Tensor& tokens,
                                                              const torch::Tensor& document_ids) {
  std::vector<torch::Tensor> maps;
  run(tokens, document_ids, &maps);
  return maps;
}

}  // namespace attnkit::train
