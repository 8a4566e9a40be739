#pragma once

/// Rotary position embeddings (RoPE), as Llama, Qwen and Gemma apply them to queries and keys.
/// Names and the default split-half layout follow the book's Llama code (ch05:
/// compute_rope_params / apply_rope); docs/rope.md has the conventions.

#include <torch/torch.h>

#include <tuple>

namespace attnkit::functional {

/// Llama 3.1 / 3.2 frequency smoothing: wavelengths longer than
/// original_context_length / low_freq_factor are divided by `factor`, those shorter than
/// original_context_length / high_freq_factor are kept, and those between are blended.
/// The defaults are Llama 3.1's (Llama 3.2 uses factor 32).
/// Example: `compute_rope_params(64, 500000, 8192, RopeFrequencyConfig().factor(32))`.
struct RopeFrequencyConfig {
  TORCH_ARG(double, factor) = 8.0;
  TORCH_ARG(double, low_freq_factor) = 1.0;
  TORCH_ARG(double, high_freq_factor) = 4.0;
  TORCH_ARG(int64_t, original_context_length) = 8192;
};

/// Which elements of a head are rotated together.
enum class RopeLayout {
  kSplitHalf,    // element i with element i + head_dim / 2 (the book's, Hugging Face Llama's)
  kInterleaved,  // element 2i with element 2i + 1 (GPT-J's, Meta's original Llama code)
};

/// The cosine and sine tables, each (context_length, head_dim): row p holds position p's
/// angles p * inv_freq[i], i < head_dim / 2, written twice ([angles, angles]), as the book
/// does; `dtype` is the tables' (float64 for exact references). Without freq_config,
/// inv_freq[i] = theta_base^(-2i / head_dim). head_dim must be even.
std::tuple<torch::Tensor, torch::Tensor> compute_rope_params(
    int64_t head_dim, double theta_base = 10000.0, int64_t context_length = 4096,
    const c10::optional<RopeFrequencyConfig>& freq_config = c10::nullopt,
    torch::ScalarType dtype = torch::kFloat32);

/// x (b, h, n, head_dim) rotated: token i of row r at position offset + i. `cos` and `sin`
/// are compute_rope_params's tables (on x's device); the result has x's dtype. Differentiable
/// in x. A position past the tables' context_length is an error.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         int64_t offset = 0, RopeLayout layout = RopeLayout::kSplitHalf);

/// The same with a position per row: `offsets` is an int64 tensor, a scalar or (b), row r's
/// token i at offsets[r] + i (a batch of sequences at different lengths).
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& offsets, RopeLayout layout = RopeLayout::kSplitHalf);

}  // namespace attnkit::functional
