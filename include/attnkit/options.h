#pragma once

/// Options for every attnkit module, in the style of LibTorch's `torch::nn::*Options`.
///
/// Field names are the Python keyword names of the chapter-3 classes, so
/// `CausalAttentionOptions(3, 2, 6, 0.0).qkv_bias(true)` reads like
/// `CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, qkv_bias=True)`.

#include <cstdint>
#include <string>

#include <torch/arg.h>

namespace attnkit {

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
  /// the math core before.
  kFused,
  /// One GEMM for Q, K and V, then memory-efficient blocks with an online softmax
  /// (`functional::chunked_attention`): memory linear in num_tokens; dropout from its own
  /// random stream.
  kChunked,
};

/// "math", "fused" or "chunked".
/// Example: `attnkit::backend_name(AttentionBackend::kFused)`.
std::string backend_name(AttentionBackend backend);

/// Parses "math", "fused" or "chunked"; anything else is a c10::Error naming the choices.
/// Example: `attnkit::parse_backend("chunked")`.
AttentionBackend parse_backend(const std::string& name);

/// Options for `MultiHeadAttention` and `MultiHeadAttentionCombinedQKV` (Python
/// `MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)`).
/// `d_out` must be divisible by `num_heads`; each head has width `d_out / num_heads`.
/// Example: `MultiHeadAttentionOptions(768, 768, 1024, 0.1, 12).causal(false)`.
struct MultiHeadAttentionOptions {
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
  /// Largest number of tokens a forward call accepts (size of the `mask` buffer).
  TORCH_ARG(int64_t, context_length);
  /// Probability of zeroing an attention weight in training mode, in [0, 1).
  TORCH_ARG(double, dropout);
  /// Number of heads; must divide `d_out`.
  TORCH_ARG(int64_t, num_heads);
  /// Whether the query, key and value projections have a bias (`out_proj` always has one).
  TORCH_ARG(bool, qkv_bias) = false;
  /// Apply the causal mask (decoder); `false` gives unmasked encoder self-attention.
  TORCH_ARG(bool, causal) = true;
  /// How attention is computed; see `AttentionBackend`.
  TORCH_ARG(AttentionBackend, backend) = AttentionBackend::kMath;
  /// Query tokens per block of the chunked backend.
  TORCH_ARG(int64_t, chunk_size) = 128;
  /// Key tokens per block of the chunked backend.
  TORCH_ARG(int64_t, key_chunk_size) = 1024;
};

/// Same options as `MultiHeadAttention`.
using MultiHeadAttentionCombinedQKVOptions = MultiHeadAttentionOptions;

}  // namespace attnkit
