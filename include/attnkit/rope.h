#pragma once

/// Rotary position embeddings (RoPE), as Llama, Qwen and Gemma apply them to queries and keys.
/// Names and the default split-half layout follow the book's Llama code (ch05:
/// compute_rope_params / apply_rope); docs/rope.md has the conventions. RopeFrequencyConfig,
/// RopeLayout and the modules' RopeOptions are in attnkit/options.h.

#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <tuple>

#include "attnkit/options.h"

namespace attnkit::functional {

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

namespace attnkit::detail {

/// A module's RoPE: compute_rope_params's tables for its RopeOptions, built once in float64
/// and handed out on the device and in the precision of the heads they rotate (float64 for
/// float64 heads, else float32; the rotation's result keeps the heads' dtype). A conversion
/// is kept, so a module on CUDA copies its tables once, not per call. Copies share the kept
/// conversions; rebuild (construct again) after changing the options.
class RopeTables {
 public:
  RopeTables() = default;
  RopeTables(const RopeOptions& options, int64_t head_dim);

  bool defined() const { return cos64_.defined(); }
  /// Positions the tables cover.
  int64_t context_length() const { return cos64_.defined() ? cos64_.size(0) : 0; }
  /// heads (b, h, n, head_dim) rotated, row r's token i at position offsets + i, offsets an
  /// int64 scalar or a (b) tensor (functional::apply_rope).
  torch::Tensor rotate(const torch::Tensor& heads, int64_t offset) const;
  torch::Tensor rotate(const torch::Tensor& heads, const torch::Tensor& offsets) const;

 private:
  std::pair<torch::Tensor, torch::Tensor> tables_like(const torch::Tensor& heads) const;

  torch::Tensor cos64_, sin64_;  // (context_length, head_dim), float64, CPU
  functional::RopeLayout layout_ = functional::RopeLayout::kSplitHalf;
  struct Converted {
    std::mutex mutex;
    torch::Tensor cos, sin;  // the last conversion handed out
  };
  std::shared_ptr<Converted> converted_;
};

}  // namespace attnkit::detail
