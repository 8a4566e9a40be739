#pragma once

/// Options for every attnkit module, in the style of LibTorch's `torch::nn::*Options`.
///
/// Field names are the Python keyword names of the chapter-3 classes, so
/// `CausalAttentionOptions(3, 2, 6, 0.0).qkv_bias(true)` reads like
/// `CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, qkv_bias=True)`.

#include <cstdint>
#include <string>
#include <utility>

#include <c10/util/Optional.h>
#include <torch/arg.h>

#include "attnkit/score_mod.h"

namespace attnkit {

namespace functional {

/// Llama 3.1 / 3.2 frequency smoothing of RoPE (functional::compute_rope_params):
/// wavelengths longer than original_context_length / low_freq_factor are divided by `factor`,
/// those shorter than original_context_length / high_freq_factor are kept, and those between
/// are blended. The defaults are Llama 3.1's (Llama 3.2 uses factor 32).
/// Example: `compute_rope_params(64, 500000, 8192, RopeFrequencyConfig().factor(32))`.
struct RopeFrequencyConfig {
  TORCH_ARG(double, factor) = 8.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_context_length) = 8192;
};

/// Which elements of a head RoPE rotates together.
enum class RopeLayout {
  kSplitHalf,    // element i with element i + head_dim / 2 (the book's, Hugging Face Llama's)
  kInterleaved,  // element 2i with element 2i + 1 (GPT-J's, Meta's original Llama code)
};

/// Rotary position embeddings inside a module (`.rope(RopeOptions(...))` on
/// MultiHeadAttention and GroupedQueryAttention): queries and keys rotated at their
/// positions, after QK-norm and before attention and the KV cache. `context_length` is the
/// most positions the tables cover. Example: Llama 3.2's
/// `RopeOptions(131072).theta_base(500000).freq_config(RopeFrequencyConfig().factor(32))`.
struct RopeOptions {
  /* implicit */ RopeOptions(int64_t context_length = 4096) : context_length_(context_length) {}

  TORCH_ARG(int64_t, context_length);
  TORCH_ARG(double, theta_base) = 10000.0;
  /// Unset: no frequency smoothing.
  TORCH_ARG(c10::optional<RopeFrequencyConfig>, freq_config) = c10::nullopt;
  TORCH_ARG(RopeLayout, layout) = RopeLayout::kSplitHalf;
};

}  // namespace functional

using functional::RopeFrequencyConfig;
using functional::RopeLayout;
using functional::RopeOptions;

/// Options for `RMSNorm` (PyTorch's `nn.RMSNorm(normalized_shape, eps)` over the last
/// dimension): x / sqrt(mean(x^2) + eps) * weight. Example: `RMSNormOptions(64).eps(1e-5)`;
/// Gemma's `RMSNormOptions(64).unit_offset(true)`.
struct RMSNormOptions {
  /* implicit */ RMSNormOptions(int64_t dim) : dim_(dim) {}

  /// Width of the last dimension, normalised over.
  TORCH_ARG(int64_t, dim);
  /// Added to the mean square (Qwen3's and Gemma 3's 1e-6).
  TORCH_ARG(double, eps) = 1e-6;
  /// Gemma's norm: `weight` holds an offset from 1, x / sqrt(mean(x^2) + eps) * (1 + weight),
  /// and starts at zeros, as Gemma's checkpoints store it.
  TORCH_ARG(bool, unit_offset) = false;
};

/// Options for `SelfAttentionV1` (Python `SelfAttention_v1(d_in, d_out)`).
/// Example: `SelfAttentionV1Options(/*d_in=*/3, /*d_out=*/2)`.
struct SelfAttentionV1Options {
  SelfAttentionV1Options(int64_t d_in, int64_t d_out) : d_in_(d_in), d_out_(d_out) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the query, key, value and output vectors.
  TORCH_ARG(int64_t, d_out);
};

/// Options for `SelfAttentionV2` (Python `SelfAttention_v2(d_in, d_out, qkv_bias=False)`).
/// Example: `SelfAttentionV2Options(3, 2).qkv_bias(true)`.
struct SelfAttentionV2Options {
  SelfAttentionV2Options(int64_t d_in, int64_t d_out) : d_in_(d_in), d_out_(d_out) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the query, key, value and output vectors.
  TORCH_ARG(int64_t, d_out);
  /// Whether the query, key and value projections have a bias.
  TORCH_ARG(bool, qkv_bias) = false;
};

/// Options for `CausalAttention`
/// (Python `CausalAttention(d_in, d_out, context_length, dropout, qkv_bias=False)`).
/// Example: `CausalAttentionOptions(/*d_in=*/3, /*d_out=*/2, /*context_length=*/6,
/// /*dropout=*/0.1)`.
struct CausalAttentionOptions {
  CausalAttentionOptions(int64_t d_in, int64_t d_out, int64_t context_length, double dropout)
      : d_in_(d_in), d_out_(d_out), context_length_(context_length), dropout_(dropout) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the query, key, value and output vectors.
  TORCH_ARG(int64_t, d_out);
  /// Largest number of tokens a forward call accepts (size of the `mask` buffer).
  TORCH_ARG(int64_t, context_length);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Whether the query, key and value projections have a bias.
  TORCH_ARG(bool, qkv_bias) = false;
};

/// Options for `MultiHeadAttentionWrapper` (Python
/// `MultiHeadAttentionWrapper(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)`).
/// Each head has width `d_out`; the output has width `d_out * num_heads`, as in the book.
/// Example: `MultiHeadAttentionWrapperOptions(3, 2, 6, 0.0, /*num_heads=*/2)`.
struct MultiHeadAttentionWrapperOptions {
  MultiHeadAttentionWrapperOptions(int64_t d_in, int64_t d_out, int64_t context_length,
                                   double dropout, int64_t num_heads)
      : d_in_(d_in),
        d_out_(d_out),
        context_length_(context_length),
        dropout_(dropout),
        num_heads_(num_heads) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of each head's output.
  TORCH_ARG(int64_t, d_out);
  /// Largest number of tokens a forward call accepts.
  TORCH_ARG(int64_t, context_length);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Number of independent `CausalAttention` heads.
  TORCH_ARG(int64_t, num_heads);
  /// Whether the query, key and value projections have a bias.
  TORCH_ARG(bool, qkv_bias) = false;
};

/// How `MultiHeadAttention` and `MultiHeadAttentionCombinedQKV` compute attention. The
/// parameters are the same for every backend, so a trained model switches without conversion.
enum class AttentionBackend {
  /// The book's computation (separate Q/K/V products, masked softmax); seed-exact.
  kMath,
  /// One GEMM for Q, K and V; LibTorch's fused scaled_dot_product_attention from 2.0 on,
  /// attnkit's CPU kernels on 1.13 (`functional::fused_backend_attention`). A module set to
  /// kFused runs masks those kernels do not take (padding, documents, a mask_mod) on kChunked;
  /// `functional::attention` forced to kFused refuses them.
  kFused,
  /// One GEMM for Q, K and V, then memory-efficient blocks with an online softmax
  /// (`functional::chunked_attention`): memory linear in num_tokens; dropout from its own
  /// random stream.
  kChunked,
  /// `functional::attention` picks: fused where it supports the problem, else chunked
  /// (`functional::choose_backend`).
  kAuto,
};

/// "math", "fused", "chunked" or "auto".
/// Example: `attnkit::backend_name(AttentionBackend::kFused)`.
std::string backend_name(AttentionBackend backend);

/// Parses "math", "fused", "chunked" or "auto"; anything else is a c10::Error naming the choices.
/// Example: `attnkit::parse_backend("chunked")`.
AttentionBackend parse_backend(const std::string& name);

/// What the options of every module with attention backends (MultiHeadAttention,
/// GroupedQueryAttention, MultiHeadLatentAttention) share: the backend and the tile sizes of
/// the blocked kernels, as in `functional::AttentionOptions`. Each setter returns the module's
/// own options, so they chain with its other setters in any order.
/// Example: `MultiHeadAttentionOptions(768, 768, 1024, 0.0, 12).backend(kChunked).causal(false)`.
template <typename Options>
struct AttentionBackendOptions {
  /// How attention is computed; see `AttentionBackend`. A backend that cannot run a call (a
  /// padding mask on kFused, say) hands it to one that can, as kAuto would.
  Options& backend(AttentionBackend value) {
    backend_ = value;
    return self();
  }
  const AttentionBackend& backend() const noexcept { return backend_; }
  /// Query tokens per tile of the chunked backend, and the block size of the block mask it
  /// makes for a masked call (`functional::AttentionOptions::query_block_size`).
  Options& query_block_size(int64_t value) {
    query_block_size_ = value;
    return self();
  }
  const int64_t& query_block_size() const noexcept { return query_block_size_; }
  /// Key tokens per tile of the chunked backend at most.
  Options& key_block_size(int64_t value) {
    key_block_size_ = value;
    return self();
  }
  const int64_t& key_block_size() const noexcept { return key_block_size_; }
  /// A score function on every call's scaled scores (`functional::AttentionOptions::score_mod`),
  /// e.g. Gemma 2's `score_mods::softcap(50.0)`; its q_idx and kv_idx are positions in the
  /// sequence, in cached calls too. Default: none.
  Options& score_mod(ScoreMod value) {
    score_mod_ = std::move(value);
    return self();
  }
  const ScoreMod& score_mod() const noexcept { return score_mod_; }
  /// The score multiplier (`functional::AttentionOptions::scale`), e.g. Gemma 2's
  /// query_pre_attn_scalar^-0.5. Unset: 1 / sqrt(head width).
  Options& scale(c10::optional<double> value) {
    scale_ = value;
    return self();
  }
  const c10::optional<double>& scale() const noexcept { return scale_; }

  /// The old name of `query_block_size`, kept for one release.
  [[deprecated("use query_block_size")]] Options& chunk_size(int64_t value) {
    return query_block_size(value);
  }
  [[deprecated("use query_block_size")]] int64_t chunk_size() const { return query_block_size_; }
  /// The old name of `key_block_size`, kept for one release.
  [[deprecated("use key_block_size")]] Options& key_chunk_size(int64_t value) {
    return key_block_size(value);
  }
  [[deprecated("use key_block_size")]] int64_t key_chunk_size() const { return key_block_size_; }

 private:
  Options& self() { return static_cast<Options&>(*this); }

  AttentionBackend backend_ = AttentionBackend::kMath;
  int64_t query_block_size_ = 128;
  int64_t key_block_size_ = 1024;
  ScoreMod score_mod_;
  c10::optional<double> scale_;
};

/// Options for `MultiHeadAttention` and `MultiHeadAttentionCombinedQKV` (Python
/// `MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)`).
/// `d_out` must be divisible by `num_heads`; each head has width `d_out / num_heads`.
/// Example: `MultiHeadAttentionOptions(768, 768, 1024, 0.1, 12).causal(false)`.
struct MultiHeadAttentionOptions : AttentionBackendOptions<MultiHeadAttentionOptions> {
  MultiHeadAttentionOptions(int64_t d_in, int64_t d_out, int64_t context_length, double dropout,
                            int64_t num_heads)
      : d_in_(d_in),
        d_out_(d_out),
        context_length_(context_length),
        dropout_(dropout),
        num_heads_(num_heads) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the output (and of all heads together).
  TORCH_ARG(int64_t, d_out);
  /// Largest number of tokens a forward call accepts (the side of the Python class's `mask`
  /// buffer, which attnkit makes only in the state dict).
  TORCH_ARG(int64_t, context_length);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Number of heads; must divide `d_out`.
  TORCH_ARG(int64_t, num_heads);
  /// Whether the query, key and value projections have a bias (`out_proj` always has one).
  TORCH_ARG(bool, qkv_bias) = false;
  /// Apply the causal mask (decoder); `false` gives unmasked encoder self-attention.
  TORCH_ARG(bool, causal) = true;
  /// Sliding-window attention (Mistral, Gemma 3): token i attends to tokens j with
  /// 0 <= i - j < sliding_window_size; its KV cache is a rolling buffer of that many
  /// positions. Unset: full causal attention. Must be >= 1 and needs `causal`.
  TORCH_ARG(c10::optional<int64_t>, sliding_window_size) = c10::nullopt;
  /// Rotary position embeddings on queries and keys (Llama, Qwen, Gemma); unset: none.
  /// Needs an even head width; self-attention only.
  TORCH_ARG(c10::optional<RopeOptions>, rope) = c10::nullopt;
  /// QK-norm (Qwen3, Gemma 3): RMSNorm over each query and key head, with learnable weights
  /// `q_norm.weight` and `k_norm.weight` (head width), before RoPE.
  TORCH_ARG(bool, qk_norm) = false;
};

/// Same options as `MultiHeadAttention`.
using MultiHeadAttentionCombinedQKVOptions = MultiHeadAttentionOptions;

/// Options for `GroupedQueryAttention` (the bonus material's Python
/// `GroupedQueryAttention(d_in, d_out, dropout, num_heads, num_kv_groups, qkv_bias=False)`).
/// `num_heads` query heads of width d_out / num_heads share `num_kv_groups` key/value heads;
/// num_kv_groups = 1 is multi-query attention, num_kv_groups = num_heads multi-head
/// attention. Always causal; no length limit (no mask buffer).
/// Example: `GroupedQueryAttentionOptions(768, 768, 0.0, 12, /*num_kv_groups=*/4)`.
struct GroupedQueryAttentionOptions : AttentionBackendOptions<GroupedQueryAttentionOptions> {
  GroupedQueryAttentionOptions(int64_t d_in, int64_t d_out, double dropout, int64_t num_heads,
                               int64_t num_kv_groups)
      : d_in_(d_in),
        d_out_(d_out),
        dropout_(dropout),
        num_heads_(num_heads),
        num_kv_groups_(num_kv_groups) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the output (and of all query heads together).
  TORCH_ARG(int64_t, d_out);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Number of query heads; must divide `d_out`.
  TORCH_ARG(int64_t, num_heads);
  /// Number of key/value heads; must divide `num_heads`.
  TORCH_ARG(int64_t, num_kv_groups);
  /// Whether the query, key and value projections have a bias (`out_proj` never has one).
  TORCH_ARG(bool, qkv_bias) = false;
  /// Sliding-window attention, as in `MultiHeadAttentionOptions`. Unset: full causal.
  TORCH_ARG(c10::optional<int64_t>, sliding_window_size) = c10::nullopt;
  /// Rotary position embeddings on queries and keys, as in `MultiHeadAttentionOptions`.
  TORCH_ARG(c10::optional<RopeOptions>, rope) = c10::nullopt;
  /// QK-norm (Qwen3, Gemma 3), as in `MultiHeadAttentionOptions`.
  TORCH_ARG(bool, qk_norm) = false;
  /// QK-norm's eps (config.json's rms_norm_eps in Qwen3 and Gemma 3).
  TORCH_ARG(double, qk_norm_eps) = 1e-6;
  /// QK-norm as Gemma 3's norm, its weights an offset from 1 (`RMSNormOptions::unit_offset`).
  TORCH_ARG(bool, qk_norm_unit_offset) = false;
  /// Attention sinks (GPT-OSS): a learned logit per query head, the parameter `sinks`
  /// (num_heads, starting at zeros), in every row's softmax with no value
  /// (`functional::AttentionOptions::sinks`). Whole sequences run on the fused tile kernel's
  /// split path (or the math core), decode steps on the decode kernel.
  TORCH_ARG(bool, sinks) = false;
  /// Width of the output: `out_proj` maps d_out to it. Unset: d_out. Qwen3 sets d_in, since
  /// its heads together (num_heads * head_dim) are wider than the model.
  TORCH_ARG(c10::optional<int64_t>, output_dim) = c10::nullopt;
};

/// Options for `MultiHeadLatentAttention` (the bonus material's Python
/// `MultiHeadLatentAttention(d_in, d_out, dropout, num_heads, qkv_bias=False, latent_dim=None)`).
/// Keys and values are up-projected from a `latent_dim`-wide latent of each token, and the
/// KV cache holds only the latents. Always causal; no length limit.
/// Example: `MultiHeadLatentAttentionOptions(768, 768, 0.0, 12).latent_dim(96)`.
struct MultiHeadLatentAttentionOptions : AttentionBackendOptions<MultiHeadLatentAttentionOptions> {
  MultiHeadLatentAttentionOptions(int64_t d_in, int64_t d_out, double dropout, int64_t num_heads)
      : d_in_(d_in), d_out_(d_out), dropout_(dropout), num_heads_(num_heads) {}

  /// Width of each input token embedding.
  TORCH_ARG(int64_t, d_in);
  /// Width of the output (and of all heads together).
  TORCH_ARG(int64_t, d_out);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Number of heads; must divide `d_out`.
  TORCH_ARG(int64_t, num_heads);
  /// Whether W_query, W_DKV, W_UK and W_UV have a bias (`out_proj` always has one).
  TORCH_ARG(bool, qkv_bias) = false;
  /// Width of the per-token latent; unset: max(16, d_out / 8), as in Python.
  TORCH_ARG(c10::optional<int64_t>, latent_dim) = c10::nullopt;
};

}  // namespace attnkit
