#include "model.h"

#include <type_traits>
#include <utility>

#include "attnkit/attnkit.h"

namespace attnkit::train {

namespace {

using AttendWithWeights =
    std::function<functional::AttentionOutput(const torch::Tensor&, const Mask&)>;
using Attend = std::function<torch::Tensor(const torch::Tensor&, const Mask&)>;
using Causality = ModuleKind::Causality;

// The names of the kinds that `keep`, as a list: "a, b, c or d" (`last` = "or" or "and").
template <typename Keep>
std::string names_where(Keep keep, const char* last = "or") {
  std::vector<std::string> names;
  for (const auto& kind : module_kinds()) {
    if (keep(kind))
      names.push_back(kind.name);
  }
  std::string text;
  for (size_t i = 0; i < names.size(); ++i)
    text += (i == 0 ? "" : i + 1 == names.size() ? std::string(" ") + last + " " : ", ") + names[i];
  return text;
}

std::string masked_module_names(const char* last = "or") {
  return names_where([](const ModuleKind& k) { return k.masks_backends_and_cache; }, last);
}

// A module of the book that takes no mask: its forward_with_weights and forward, refusing a
// mask (packed documents).
template <typename Holder>
BoundAttention bind_unmasked(Holder holder, const std::string& name) {
  const auto check = [name](const Mask& mask) {
    TORCH_CHECK(mask.is_none(), "--module ", name,
                " takes no mask, so it cannot keep packed documents apart (--pack); use ",
                masked_module_names());
  };
  BoundAttention bound;
  bound.module = holder.ptr();
  bound.attend_with_weights = [holder, check](const torch::Tensor& x, const Mask& mask) mutable {
    check(mask);
    return holder->forward_with_weights(x);
  };
  bound.attend = [holder, check](const torch::Tensor& x, const Mask& mask) mutable {
    check(mask);
    return holder->forward(x);
  };
  return bound;
}

// A module with a KV cache (CachedAttentionLayer), whose forward(query, key, value, mask)
// takes a mask; self-attention: no key, no value.
BoundAttention bind_masked(std::shared_ptr<CachedAttentionLayer> layer) {
  BoundAttention bound;
  bound.module = layer->as_module();
  bound.attend_with_weights = [layer](const torch::Tensor& x, const Mask& mask) {
    return layer->forward_with_weights(x, {}, {}, mask);
  };
  bound.attend = [layer](const torch::Tensor& x, const Mask& mask) {
    return layer->forward(x, {}, {}, mask);
  };
  bound.cached = std::move(layer);
  return bound;
}

// Empty --backend: the modules' own default (math); attnkit-train resolves it to fused first.
AttentionBackend backend_of(const ModelConfig& c) {
  return c.backend.empty() ? AttentionBackend::kMath : parse_backend(c.backend);
}

c10::optional<int64_t> window_of(const ModelConfig& c) {
  return c.window > 0 ? c10::optional<int64_t>(c.window) : c10::nullopt;
}

c10::optional<RopeOptions> rope_of(const ModelConfig& c) {
  return c.rope ? c10::optional<RopeOptions>(RopeOptions(c.context_length))
                : c10::optional<RopeOptions>();
}

MultiHeadAttentionOptions multi_head_options(const ModelConfig& c) {
  return MultiHeadAttentionOptions(c.d_model, c.d_model, c.context_length, c.dropout, c.heads)
      .causal(c.causal)
      .backend(backend_of(c))
      .sliding_window_size(window_of(c))
      .rope(rope_of(c))
      .qk_norm(c.qk_norm);
}

BoundAttention make_grouped(const ModelConfig& c, int64_t kv_groups) {
  return bind_masked(GroupedQueryAttention(GroupedQueryAttentionOptions(
                                               c.d_model, c.d_model, c.dropout, c.heads, kv_groups)
                                               .backend(backend_of(c))
                                               .sliding_window_size(window_of(c))
                                               .rope(rope_of(c))
                                               .qk_norm(c.qk_norm))
                         .ptr());
}

// gqa's key/value groups: --kv-groups, 2 by default.
int64_t gqa_groups(const ModelConfig& c) {
  return c.kv_groups > 0 ? c.kv_groups : 2;
}

}  // namespace

const std::vector<ModuleKind>& module_kinds() {
  // name, causality, multi-head, masks + backends + cache, windowed, kv-groups, latent, make
  static const std::vector<ModuleKind> kinds{
      {"sa-v1", Causality::kNever, false, false, false, false, false,
       [](const ModelConfig& c) {
         return bind_unmasked(SelfAttentionV1(c.d_model, c.d_model), "sa-v1");
       }},
      {"sa-v2", Causality::kNever, false, false, false, false, false,
       [](const ModelConfig& c) {
         return bind_unmasked(SelfAttentionV2(c.d_model, c.d_model), "sa-v2");
       }},
      {"causal", Causality::kAlways, false, false, false, false, false,
       [](const ModelConfig& c) {
         return bind_unmasked(CausalAttention(c.d_model, c.d_model, c.context_length, c.dropout),
                              "causal");
       }},
      {"mha-wrapper", Causality::kAlways, true, false, false, false, false,
       [](const ModelConfig& c) {
         // Each head d_model / heads wide, so the concatenation is d_model wide.
         return bind_unmasked(MultiHeadAttentionWrapper(c.d_model, c.d_model / c.heads,
                                                        c.context_length, c.dropout, c.heads),
                              "mha-wrapper");
       }},
      {"mha", Causality::kEither, true, true, true, false, false,
       [](const ModelConfig& c) {
         return bind_masked(MultiHeadAttention(multi_head_options(c)).ptr());
       }},
      {"mha-combined", Causality::kEither, true, true, true, false, false,
       [](const ModelConfig& c) {
         return bind_masked(MultiHeadAttentionCombinedQKV(multi_head_options(c)).ptr());
       }},
      {"gqa", Causality::kAlways, true, true, true, true, false,
       [](const ModelConfig& c) { return make_grouped(c, gqa_groups(c)); }},
      {"mqa", Causality::kAlways, true, true, true, false, false,
       [](const ModelConfig& c) { return make_grouped(c, 1); }},
      {"mla", Causality::kAlways, true, true, false, false, true,
       [](const ModelConfig& c) {
         return bind_masked(
             MultiHeadLatentAttention(
                 MultiHeadLatentAttentionOptions(c.d_model, c.d_model, c.dropout, c.heads)
                     .backend(backend_of(c))
                     .latent_dim(c.latent_dim > 0 ? c10::optional<int64_t>(c.latent_dim)
                                                  : c10::nullopt))
                 .ptr());
       }},
  };
  return kinds;
}

const ModuleKind& module_kind(const std::string& name) {
  for (const auto& kind : module_kinds()) {
    if (kind.name == name)
      return kind;
  }
  TORCH_CHECK(false, "--module: unknown module '", name, "'; expected ",
              names_where([](const ModuleKind&) { return true; }));
}

bool has_backends_and_kv_cache(const std::string& module) {
  return module_kind(module).masks_backends_and_cache;
}

void check_model_config(const ModelConfig& c) {
  const auto& kind = module_kind(c.module);
  TORCH_CHECK(!(kind.causality == Causality::kNever && c.causal), "--module ", c.module,
              " has no causal mask, so on a causal task it would see the tokens it must "
              "predict; use ",
              names_where([](const ModuleKind& k) { return k.causality != Causality::kNever; }));
  TORCH_CHECK(!(kind.causality == Causality::kAlways && !c.causal), "--module ", c.module,
              " always applies a causal mask, but this task needs every token to see every "
              "other (bidirectional); use ",
              names_where([](const ModuleKind& k) { return k.causality != Causality::kAlways; }));
  TORCH_CHECK(c.d_model >= 1, "--d-model: expected >= 1, got ", c.d_model);
  TORCH_CHECK(c.heads >= 1, "--heads: expected >= 1, got ", c.heads);
  TORCH_CHECK(c.layers >= 1, "--layers: expected >= 1, got ", c.layers);
  TORCH_CHECK(!kind.multi_head || c.d_model % c.heads == 0, "--d-model ", c.d_model,
              " must be divisible by --heads ", c.heads, " for --module ", c.module);
  TORCH_CHECK(c.dropout >= 0.0 && c.dropout < 1.0, "--dropout: expected a value in [0, 1), got ",
              c.dropout);
  const bool has_backends = kind.masks_backends_and_cache;
  TORCH_CHECK(has_backends || c.backend.empty(), "--backend ", c.backend, ": only ",
              masked_module_names("and"), " have backends; --module ", c.module,
              " has one implementation");
  TORCH_CHECK(
      !has_backends || c.backend == "math" || c.backend == "fused" || c.backend == "chunked",
      "--backend: unknown backend '", c.backend, "'; expected math, fused or chunked");
  // The family's sizes: each flag only where the module has that size.
  TORCH_CHECK(c.kv_groups >= 0, "--kv-groups: expected >= 1, got ", c.kv_groups);
  TORCH_CHECK(c.kv_groups == 0 || kind.kv_group_choice, "--kv-groups ", c.kv_groups,
              ": only --module gqa has a choice of key/value groups (mqa has 1), got --module ",
              c.module);
  TORCH_CHECK(!kind.kv_group_choice || c.heads % gqa_groups(c) == 0, "--kv-groups ", gqa_groups(c),
              " must divide --heads ", c.heads, " for --module gqa");
  TORCH_CHECK(c.window >= 0, "--window: expected >= 1 (0 = no window), got ", c.window);
  const auto windowed = names_where([](const ModuleKind& k) { return k.windowed; }, "and");
  TORCH_CHECK(c.window == 0 || kind.windowed, "--window ", c.window, ": only ", windowed,
              " have a sliding window, got --module ", c.module);
  TORCH_CHECK(c.window == 0 || c.causal, "--window ", c.window,
              " limits how far back a token looks, so it needs a causal task");
  TORCH_CHECK(!(c.rope || c.qk_norm) || kind.windowed, c.rope ? "--rope" : "--qk-norm", ": only ",
              windowed, " take it, got --module ", c.module);
  TORCH_CHECK(!c.rope || (c.d_model / c.heads) % 2 == 0, "--rope rotates pairs of a head's ",
              "features, so d-model / heads must be even, got ", c.d_model, " / ", c.heads, " = ",
              c.d_model / c.heads);
  TORCH_CHECK(c.latent_dim >= 0, "--latent-dim: expected >= 1 (0 = the default), got ",
              c.latent_dim);
  TORCH_CHECK(c.latent_dim == 0 || kind.latent, "--latent-dim ", c.latent_dim,
              ": only --module mla has a latent, got --module ", c.module);
}

BlockImpl::BlockImpl(const ModelConfig& c)
    : attention_(module_kind(c.module).make(c)), module_name_(c.module) {
  const auto d = c.d_model;
  attention_norm_ =
      register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  register_module("attention", attention_.module);
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
    auto attended = attention_.attend_with_weights(attention_norm_(x), mask);
    // Single-head modules give (b, n, n): add the head dimension.
    *weights = attended.weights.dim() == 3 ? attended.weights.unsqueeze(1) : attended.weights;
    x = x + attended.context;
  } else {
    x = x + attention_.attend(attention_norm_(x), mask);
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
  TORCH_CHECK(attention_.cached, "--module ", module_name_, " has no KV cache");
  x = x + attention_.cached->forward_with_cache(attention_norm_(x), cache, lengths);
  return cached_feed_forward(x, host_lengths(lengths));
}

torch::Tensor BlockImpl::forward_with_cache(torch::Tensor x, PagedKVCache& pool,
                                            const std::vector<int64_t>& sequences) {
  TORCH_CHECK(attention_.cached, "--module ", module_name_, " has no KV cache");
  x = x + attention_.cached->forward_with_cache(attention_norm_(x), pool, sequences);
  return cached_feed_forward(x, {});
}

torch::Tensor BlockImpl::cached_feed_forward(const torch::Tensor& x,
                                             const std::vector<int64_t>& lengths) {
  if (!feed_forward_)
    return x;
  // Norm, Linear, GELU, Dropout (a no-op: caches are for inference), Linear, each per
  // token: a one-row step's products through attnkit::project, a mostly padded ragged
  // step's whole feed-forward on its valid tokens.
  const auto feed_forward = [&](const torch::Tensor& h) {
    return attnkit::project(feed_forward_down_,
                            torch::gelu(attnkit::project(feed_forward_up_, feed_forward_norm_(h))));
  };
  const attnkit::ValidTokens valid(x, lengths);
  return valid.packs() ? valid.add_to(x, feed_forward(valid.pack(x))) : x + feed_forward(x);
}

KVCache BlockImpl::make_kv_cache(int64_t batch, int64_t capacity) const {
  TORCH_CHECK(attention_.cached, "--module ", module_name_, " has no KV cache (",
              masked_module_names("and"), " have one); generate with --no-kv-cache");
  return attention_.cached->make_kv_cache(batch, capacity);
}

PagedKVCache BlockImpl::make_paged_kv_cache(int64_t num_pages, int64_t page_size) const {
  TORCH_CHECK(attention_.cached, "--module ", module_name_, " has no KV cache (",
              masked_module_names("and"), " have one) to page");
  return attention_.cached->make_paged_kv_cache(num_pages, page_size);
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
  // Inside a ContextParallelScope the tokens are this rank's shard of the sequence: positions
  // are the shard's, and the document ids, mask and attention the whole sequence's.
  const auto* scope = ContextParallelScope::current();
  const auto n = scope != nullptr ? scope->shards().length() : tokens.size(1);
  torch::Tensor positions =
      scope != nullptr ? scope->positions(tokens.device()) : torch::arange(n, tokens.options());
  if (document_ids.defined()) {
    TORCH_CHECK(document_ids.dim() == 2 && document_ids.size(0) == tokens.size(0) &&
                    document_ids.size(1) == n,
                "[AttentionModel::forward] document_ids: expected (", tokens.size(0), ", ", n, ")",
                scope != nullptr ? ", the whole sequence's," : "", " got ", document_ids.sizes());
    // Judged once per step, read by every layer (FlexAttention's pattern): the block mask's
    // lists serve each layer's tiles, and the documents' ids are compared only on the tiles
    // where documents meet. Block size 128: the modules' default chunk size.
    mask = Mask::from_block_mask(
        create_block_mask(Mask::documents(document_ids, /*causal=*/config_.causal), tokens.size(0),
                          1, n, n, BlockMaskOptions().device(tokens.device())));
    positions = positions_in_documents(document_ids);
    if (scope != nullptr)
      positions = scope->shards().shard(positions, scope->exchange().rank(), 1);
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
  std::optional<attnkit::Autocast> autocast;
  if (forward_autocast_)
    autocast.emplace(tokens.device().type(), *forward_autocast_);
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
  return attnkit::project(head_, final_norm_(x));
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
  const attnkit::ValidTokens valid(x, host_lengths(lengths));
  if (valid.packs())  // the norm and head per token: on the valid tokens alone
    return valid.unpack(attnkit::project(head_, final_norm_(valid.pack(x))));
  return attnkit::project(head_, final_norm_(x));
}

std::vector<KVCache> AttentionModelImpl::make_kv_caches(int64_t batch, int64_t capacity) {
  std::vector<KVCache> caches;
  for (auto& block : *blocks_) {
    caches.push_back(block->as<BlockImpl>()->make_kv_cache(batch, capacity));
  }
  return caches;
}

std::vector<PagedKVCache> AttentionModelImpl::make_paged_kv_caches(int64_t num_pages,
                                                                   int64_t page_size) {
  std::vector<PagedKVCache> pools;
  for (auto& block : *blocks_)
    pools.push_back(block->as<BlockImpl>()->make_paged_kv_cache(num_pages, page_size));
  return pools;
}

torch::Tensor AttentionModelImpl::paged_logits(const torch::Tensor& tokens,
                                               std::vector<PagedKVCache>& pools,
                                               const std::vector<int64_t>& sequences) {
  const char* fn = "[AttentionModel::paged_logits]";
  TORCH_CHECK(static_cast<int64_t>(pools.size()) == config_.layers, fn,
              " expected one pool per layer (", config_.layers, "), got ", pools.size());
  TORCH_CHECK(tokens.dim() == 2 && static_cast<size_t>(tokens.size(0)) == sequences.size(), fn,
              " tokens: expected (", sequences.size(), ", n), one row per sequence, got ",
              tokens.sizes());
  // Row r's tokens at its own positions [length, length + n): (b, n).
  std::vector<int64_t> starts;
  for (const int64_t sequence : sequences) {
    starts.push_back(pools.front().length(sequence));
    TORCH_CHECK(starts.back() + tokens.size(1) <= config_.context_length, fn, " sequence ",
                sequence, ": ", tokens.size(1), " tokens after its ", starts.back(),
                " would pass context_length ", config_.context_length);
  }
  const auto positions = torch::tensor(starts, torch::kInt64).to(tokens.device()).unsqueeze(1) +
                         torch::arange(tokens.size(1), tokens.options()).unsqueeze(0);
  auto x = embed(tokens, positions);
  for (size_t i = 0; i < pools.size(); ++i)
    x = blocks_[i]->as<BlockImpl>()->forward_with_cache(x, pools[i], sequences);
  return attnkit::project(head_, final_norm_(x));
}

std::vector<torch::Tensor> AttentionModelImpl::attention_maps(const torch::Tensor& tokens,
                                                              const torch::Tensor& document_ids) {
  std::vector<torch::Tensor> maps;
  run(tokens, document_ids, &maps);
  return maps;
}

}  // namespace attnkit::train
