#pragma once

/// Text generation over any causal language model whose attention layers use attnkit's
/// KV caches: greedy or sampled (temperature, top-k) decoding, with or without the caches.

#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "attnkit/kv_cache.h"
#include "attnkit/paged_kv_cache.h"

namespace attnkit {

/// What `generate` needs of a model. Implement it next to your `torch::nn::Module` (see
/// apps/tiny_gpt): one cache per attention layer, positions taken from the caches.
class CausalLanguageModel {
 public:
  virtual ~CausalLanguageModel() = default;
  /// Logits (b, n, vocab) of tokens (b, n) at positions [0, n), no cache: the training forward.
  virtual torch::Tensor logits(const torch::Tensor& tokens) = 0;
  /// Logits (b, n, vocab) of the next n tokens (b, n) at positions
  /// [caches.front().size(), ... + n): each attention layer appends to and reads its cache.
  virtual torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                          std::vector<KVCache>& caches) = 0;
  /// Logits (b, n, vocab) of a right-padded batch whose rows bring different numbers of new
  /// tokens: row r's first lengths[r] tokens (lengths: (b) int64) at its own positions
  /// [caches.front().lengths()[r], ... + lengths[r]), each attention layer calling
  /// forward_with_cache(x, cache, lengths); the padding's logits are unspecified. `generate`
  /// needs it for prompts of different lengths. The default refuses.
  virtual torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens,
                                                 const torch::Tensor& lengths,
                                                 std::vector<KVCache>& caches);
  /// One empty cache per attention layer for `batch` sequences of up to `capacity` positions.
  virtual std::vector<KVCache> make_kv_caches(int64_t batch, int64_t capacity) = 0;
  /// One paged pool per attention layer (each layer's make_paged_kv_cache), for
  /// attnkit::Scheduler (serving.h). The default refuses.
  virtual std::vector<PagedKVCache> make_paged_kv_caches(int64_t num_pages, int64_t page_size);
  /// Logits (b, n, vocab) of the next n tokens (b, n) of `sequences` (one id per row, the
  /// same in every pool): row r's tokens at positions [pools.front().length(sequences[r]),
  /// ... + n), each attention layer calling forward_with_cache(x, pools[layer], sequences).
  /// The default refuses.
  virtual torch::Tensor paged_logits(const torch::Tensor& tokens, std::vector<PagedKVCache>& pools,
                                     const std::vector<int64_t>& sequences);
  /// Longest sequence the model takes (the size of its position embedding).
  virtual int64_t context_length() const = 0;
};

/// Options for `generate`.
/// Example: `GenerateOptions(200).temperature(0.8).top_k(40).seed(123)`.
struct GenerateOptions {
  explicit GenerateOptions(int64_t max_new_tokens) : max_new_tokens_(max_new_tokens) {}

  /// Tokens to append to each prompt, >= 0.
  TORCH_ARG(int64_t, max_new_tokens);
  /// 0 decodes greedily (argmax); > 0 samples from softmax(logits / temperature).
  TORCH_ARG(double, temperature) = 0.0;
  /// When sampling, only the top_k most likely tokens are drawn from (0: all).
  TORCH_ARG(int64_t, top_k) = 0;
  /// Seed of the sampler's own generator: a seed repeats the samples, and the global
  /// generator (dropout, initialisation) is left alone.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Decode one token per step against the KV caches (the prompt in one prefill). Without
  /// them every step recomputes the last context_length tokens, as the book's
  /// generate_text_simple does.
  TORCH_ARG(bool, use_kv_cache) = true;
  /// Token ids that end a row (kept in its output): the batch of prompts only, whose rows
  /// may end at different lengths.
  TORCH_ARG(std::vector<int64_t>, stop_tokens);
};

/// One prompt of a batch that `generate` continues together with others, with its own limits.
/// Example: `GenerationRequest(torch::tensor({5, 7, 2}, torch::kInt64)).max_new_tokens(20)
/// .stop_tokens({0})`
struct GenerationRequest {
  /* implicit */ GenerationRequest(torch::Tensor prompt) : prompt_(std::move(prompt)) {}

  /// The prompt's token ids, (n) int64 with n >= 1.
  TORCH_ARG(torch::Tensor, prompt);
  /// Most tokens to add to this prompt; unset: GenerateOptions::max_new_tokens.
  TORCH_ARG(c10::optional<int64_t>, max_new_tokens) = c10::nullopt;
  /// This row ends after producing one of these (kept in its output), besides
  /// GenerateOptions::stop_tokens.
  TORCH_ARG(std::vector<int64_t>, stop_tokens);
};

/// Continues each row of `prompt` (b, n) int64 token ids by `max_new_tokens` tokens and
/// returns (b, n + max_new_tokens). Runs without autograd; put the model in eval mode first
/// (the cached path refuses training mode).
///
/// Greedy decoding gives the same tokens with and without the caches while prompt and
/// output fit in context_length. Past it the uncached path slides its window by one token
/// per step, as the book's does, while the cached path refills its caches from the last
/// context_length / 2 tokens whenever they are full (so the two see different contexts
/// there), keeping the cost per token constant.
/// Example: `auto out = attnkit::generate(model, prompt, GenerateOptions(50));`
torch::Tensor generate(CausalLanguageModel& model, const torch::Tensor& prompt,
                       const GenerateOptions& options);

/// Continues prompts of different lengths together and returns each row's prompt followed by
/// its new tokens, (n_r + new_r) int64. Row r stops after its max_new_tokens or its first
/// stop token; a finished row leaves the batch (its cache rows are dropped with
/// KVCache::keep_rows), so it costs no more work. A row that reaches context_length starts
/// its caches over from its last context_length / 2 tokens (KVCache::reset_rows), as a
/// prompt generated alone does.
///
/// Greedy decoding gives each row the tokens that generating its prompt alone gives (cut at
/// its stop token), past the context too. Prompts of different lengths need the model's
/// ragged_logits_with_cache (attnkit's modules take rows of different lengths with every cache
/// kind); prompts of one length use logits_with_cache. Needs use_kv_cache. Sampling draws
/// every row from one generator, so a sampled row differs from that prompt sampled alone.
///
/// Example:
/// ```
/// auto rows = attnkit::generate(model, {prompt_a, prompt_b}, GenerateOptions(50));
/// ```
std::vector<torch::Tensor> generate(CausalLanguageModel& model,
                                    const std::vector<GenerationRequest>& requests,
                                    const GenerateOptions& options);

}  // namespace attnkit
