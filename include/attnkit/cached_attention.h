#pragma once

/// What every multi-head attention layer with a KV cache shares: `CachedAttentionLayer`, the
/// interface a model holds to take any of them (MultiHeadAttention,
/// MultiHeadAttentionCombinedQKV, GroupedQueryAttention, MultiHeadLatentAttention), and
/// `CachedAttentionModule`, the base that each of them (and a layer of your own) derives from.

#include <memory>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/mask.h"
#include "attnkit/options.h"
#include "attnkit/paged_kv_cache.h"

namespace attnkit {

namespace detail {
/// reset_parameters() of each Linear and RMSNorm child of `module`, in registration order.
void reset_child_parameters(torch::nn::Module& module);
}  // namespace detail

/// An attention layer with a KV cache, whatever its projections and cache. A model keeps a
/// `std::shared_ptr<CachedAttentionLayer>` (any module holder's `.ptr()` converts to it) and
/// registers `as_module()`.
/// Example:
///   std::shared_ptr<attnkit::CachedAttentionLayer> attention =
///       attnkit::GroupedQueryAttention(GroupedQueryAttentionOptions(64, 64, 0.0, 4, 2)).ptr();
///   register_module("attention", attention->as_module());
///   auto cache = attention->make_kv_cache(/*batch=*/1, /*capacity=*/128);
///   auto y = attention->forward_with_cache(x, cache);
class CachedAttentionLayer {
 public:
  virtual ~CachedAttentionLayer() = default;

  /// Self-attention `forward(x)`: (b, n, d_in) -> (b, n, d_out). Cross-attention
  /// `forward(query, key, value)`: queries from query (b, n, d_in), keys and values from key
  /// and value (b, m, d_in), value defaulting to key; m may differ from n. `mask`
  /// (docs/masks.md) combines with the layer's own causal and window mask, e.g.
  /// `Mask::key_padding(lengths)` for padded batches or `Mask::documents(ids)` for packed
  /// ones. Computed by `backend()`, through the planner like every attnkit call.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key = {},
                        const torch::Tensor& value = {}, const Mask& mask = {}) {
    return attend_inputs(query, key, value, mask, /*with_weights=*/false).context;
  }

  /// `forward`, also returning the attention weights (b, num_heads, n, m): the math core,
  /// since the other kernels never form them.
  functional::AttentionOutput forward_with_weights(const torch::Tensor& query,
                                                   const torch::Tensor& key = {},
                                                   const torch::Tensor& value = {},
                                                   const Mask& mask = {}) {
    return attend_inputs(query, key, value, mask, /*with_weights=*/true);
  }

  /// A cache for `forward_with_cache`: `batch` sequences of up to `capacity` positions, in the
  /// parameters' dtype and on their device. Its layout is the layer's: key/value heads, a
  /// rolling window, or latents (each module's header says which).
  virtual KVCache make_kv_cache(int64_t batch, int64_t capacity) const = 0;

  /// Inference with a KV cache: x (b, n, d_in) holds the next n tokens of b sequences, at
  /// positions [cache.size(), cache.size() + n). Their keys and values (or latents) are
  /// appended to the cache and their queries attend to every position held, with the causal
  /// mask aligned bottom-right. Returns (b, n, d_out): the rows of forward() over the whole
  /// sequence, for a prompt at once (prefill), in pieces, or a token at a time. `mask`
  /// combines with the causal one (and the window) at positions in the sequence, as in
  /// training: q_idx and kv_idx of a problem of the positions [0, cache.size() + n), or of
  /// the whole sequence a mask was made for (a documents mask of every position's ids, a
  /// block mask of the sequence's length: the same mask at every step), on a rolling cache
  /// too, e.g. `Mask::key_padding`, `Mask::documents` or `Mask::from_block_mask`.
  /// Runs without autograd. Fails (c10::Error), writing nothing, in training mode, with a mask
  /// that does not fit those positions, and when the positions would pass the layer's or the
  /// cache's limits.
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache, const Mask& mask = {}) {
    return attend_new_tokens(x, cache, torch::Tensor(), mask);
  }

  /// A right-padded batch whose rows hold different numbers of new tokens: row r's first
  /// lengths[r] tokens of x (b, n, d_in), `lengths` a (b) int64 tensor with entries in [0, n],
  /// sit at positions [cache.lengths()[r], cache.lengths()[r] + lengths[r]) of its own
  /// sequence, so a batch of prompts of different lengths is prefilled and decoded together.
  /// Each row's outputs at its valid tokens equal that row run alone; those at padding are
  /// finite and meaningless. The padding's keys and values are not cached. `mask` reads each
  /// row's positions, of a problem of [0, the longest row's end).
  torch::Tensor forward_with_cache(const torch::Tensor& x, KVCache& cache,
                                   const torch::Tensor& lengths, const Mask& mask = {}) {
    return attend_new_tokens(x, cache, lengths, mask);
  }

  /// A paged pool for forward_with_cache(x, cache, sequences): num_pages pages of page_size
  /// positions of the layer's key/value heads (latent attention: of its latents,
  /// PagedKVCache::latents), in the parameters' dtype and on their device. One pool per
  /// layer; a sequence's id is the same in every layer's pool when each pool's add_sequence,
  /// fork and release are called in the same order. A layer of your own that does not
  /// override it refuses.
  virtual PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const;

  /// Inference on a paged cache: x (b, n, d_in), row r the next n tokens of the sequence
  /// `sequences[r]` of `cache` (distinct ids, one per row), at its positions [cache.length(
  /// sequences[r]), ... + n). Their keys and values are appended to the sequence's pages and
  /// their queries attend to its positions in place (attnkit::paged_attention), with the
  /// layer's causal mask, window, scale, score_mod (a softcap, ALiBi, a relative bias, a
  /// score graph, a C++ function: at each sequence's own positions, a window's included) and
  /// sinks. Returns (b, n, d_out): the rows that forward_with_cache on a KVCache gives. A
  /// windowed layer frees the pages its window has left. Runs without autograd. Fails
  /// (c10::Error), writing nothing, in training mode, with a score_mod that does not fit the
  /// heads (ALiBi's slopes, a bias table), when the pool has no room for every row, and on a
  /// pool of another layout, dtype or device. `mask` combines with the causal one and the window,
  /// at b the row of x, q_idx and kv_idx positions in the row's sequence (documents, a prefix-LM),
  /// as PagedAttentionOptions::mask.
  torch::Tensor forward_with_cache(const torch::Tensor& x, PagedKVCache& cache,
                                   const std::vector<int64_t>& sequences, const Mask& mask = {}) {
    return attend_paged_tokens(x, cache, sequences, mask);
  }

  /// The backend the layer's options name.
  virtual AttentionBackend backend() const = 0;
  /// Sets the backend in the layer's options.
  virtual void set_backend(AttentionBackend backend) = 0;

  /// This layer as the torch::nn::Module it is: its parameters, train()/eval(), to(),
  /// register_module. Needs the layer to be owned by a shared_ptr (any module holder's is).
  virtual std::shared_ptr<torch::nn::Module> as_module() = 0;

 protected:
  /// forward and forward_with_weights: the checks, the projections, attention (with
  /// `with_weights`, the math core's weights too) and the output projection.
  virtual functional::AttentionOutput attend_inputs(const torch::Tensor& query,
                                                    const torch::Tensor& key,
                                                    const torch::Tensor& value, const Mask& mask,
                                                    bool with_weights) = 0;
  /// Both forward_with_cache overloads: `lengths` undefined for a step where every row brings
  /// n tokens.
  virtual torch::Tensor attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                          const torch::Tensor& lengths, const Mask& mask) = 0;
  /// The paged forward_with_cache; the default refuses.
  virtual torch::Tensor attend_paged_tokens(const torch::Tensor& x, PagedKVCache& cache,
                                            const std::vector<int64_t>& sequences,
                                            const Mask& mask);
};

/// The base of a cached attention module `Impl`: a cloneable torch::nn::Module and a
/// CachedAttentionLayer whose backend lives in `Impl::options` (an AttentionBackendOptions).
/// `Impl` implements `make_kv_cache`, `attend_inputs` and `attend_new_tokens`; forward(x)
/// also works through torch::nn::AnyModule and Sequential.
template <typename Impl>
class CachedAttentionModule : public torch::nn::Cloneable<Impl>, public CachedAttentionLayer {
 public:
  /// Re-initialises the projections (and QK-norm's weights) in the order the constructor
  /// made them, so after the same seed they are the constructor's draws.
  void reset_parameters() { detail::reset_child_parameters(*this); }

  AttentionBackend backend() const override { return impl().options.backend(); }
  void set_backend(AttentionBackend backend) override {
    static_cast<Impl&>(*this).options.backend(backend);
  }
  std::shared_ptr<torch::nn::Module> as_module() override { return this->shared_from_this(); }

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(Mask())})

 private:
  const Impl& impl() const { return static_cast<const Impl&>(*this); }
};

}  // namespace attnkit
