#pragma once

/// Multi-head latent attention (DeepSeek V2/V3): keys and values are up-projected from a
/// small per-token latent, and the KV cache holds only the latents. The chapter-4 bonus
/// material's `MultiHeadLatentAttention`, trainable.

#include <torch/torch.h>

#include "attnkit/attention.h"
#include "attnkit/cached_attention.h"
#include "attnkit/kv_cache.h"
#include "attnkit/options.h"

namespace attnkit {

/// Python `MultiHeadLatentAttention(d_in, d_out, dropout, num_heads, qkv_bias=False,
/// latent_dim=None)`: Linear `W_query` (d_in -> d_out), `W_DKV` (d_in -> latent_dim), `W_UK`
/// and `W_UV` (latent_dim -> d_out), created in that order, and `out_proj` (d_out -> d_out,
/// with bias). Keys W_UK(W_DKV(x)) and values W_UV(W_DKV(x)) are split into num_heads heads
/// like the queries. Causal. Input (b, n, d_in); output (b, n, d_out); forward,
/// forward_with_weights and forward_with_cache are CachedAttentionLayer's
/// (attnkit/cached_attention.h).
/// Example: `MultiHeadLatentAttention mla(MultiHeadLatentAttentionOptions(768, 768, 0.0, 12));`
class MultiHeadLatentAttentionImpl : public CachedAttentionModule<MultiHeadLatentAttentionImpl> {
 public:
  /// Positional arguments in the order of the Python constructor (latent_dim 0: the default).
  MultiHeadLatentAttentionImpl(int64_t d_in, int64_t d_out, double dropout, int64_t num_heads,
                               bool qkv_bias = false, int64_t latent_dim = 0)
      : MultiHeadLatentAttentionImpl(
            MultiHeadLatentAttentionOptions(d_in, d_out, dropout, num_heads)
                .qkv_bias(qkv_bias)
                .latent_dim(latent_dim == 0 ? c10::nullopt : c10::optional<int64_t>(latent_dim))) {}
  /// From options, e.g. with non-default fields set by their chained setters.
  explicit MultiHeadLatentAttentionImpl(const MultiHeadLatentAttentionOptions& options);

  /// Validates the options and registers the projections.
  void reset() override;
  /// `attnkit::MultiHeadLatentAttention(d_in=..., latent_dim=..., ...)`
  void pretty_print(std::ostream& stream) const override;

  /// The latent width in use: options.latent_dim(), or max(16, d_out / 8).
  int64_t latent_dim() const;

  /// A latent cache (`KVCache::latent`) for `forward_with_cache`: `batch` sequences of up to
  /// `capacity` (>= 1) positions, latent_dim() values per position.
  KVCache make_kv_cache(int64_t batch, int64_t capacity) const override;
  /// A pool of latents (PagedKVCache::latents) for the paged forward_with_cache: num_pages
  /// pages of page_size positions, latent_dim() wide, or latent_dim() + 1 with qkv_bias (a
  /// column of ones that carries W_UK's bias term into the scores and W_UV's into the output).
  PagedKVCache make_paged_kv_cache(int64_t num_pages, int64_t page_size) const override;

  /// The options this module was built with (reset() re-reads them).
  MultiHeadLatentAttentionOptions options;
  /// Query projection, d_in -> d_out.
  torch::nn::Linear W_query{nullptr};
  /// Down-projection to the latent, d_in -> latent_dim.
  torch::nn::Linear W_DKV{nullptr};
  /// Key up-projection, latent_dim -> d_out.
  torch::nn::Linear W_UK{nullptr};
  /// Value up-projection, latent_dim -> d_out.
  torch::nn::Linear W_UV{nullptr};
  /// Output projection after the heads are merged, d_out -> d_out, with bias.
  torch::nn::Linear out_proj{nullptr};

 protected:
  // Keys are up-projected from the latents of key, values from those of value (one set when
  // they are the same tensor).
  functional::AttentionOutput attend_inputs(const torch::Tensor& query, const torch::Tensor& key,
                                            const torch::Tensor& value, const Mask& mask,
                                            bool with_weights) override;
  // The new tokens' latents are appended; keys and values of every position come from the
  // latents held. A one-token step without a mask reads the latents in place, with the
  // up-projections absorbed into the query and the output; the padding's latents are not
  // cached.
  torch::Tensor attend_new_tokens(const torch::Tensor& x, KVCache& cache,
                                  const torch::Tensor& lengths, const Mask& mask) override;
  // The new tokens' latents are appended to the pages; every query reads the latents in place
  // with the up-projections absorbed, the decode steps and prefill chunks alike.
  torch::Tensor attend_paged_tokens(const torch::Tensor& x, PagedKVCache& cache,
                                    const std::vector<int64_t>& sequences,
                                    const Mask& mask) override;
};

/// Module holder for `MultiHeadLatentAttentionImpl` (shared-pointer semantics).
TORCH_MODULE(MultiHeadLatentAttention);

}  // namespace attnkit
