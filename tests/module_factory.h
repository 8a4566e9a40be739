#pragma once

// Builds any attnkit module from its class name and constructor arguments: the C++
// counterpart of scripts/reference_attention.py's build(), for golden and interop tests.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "attnkit/attnkit.h"
#include "test_support.h"

namespace attnkit::testing {

struct ModuleConfig {
  int64_t d_in = 1;
  int64_t d_out = 1;
  int64_t context_length = 1;
  double dropout = 0.0;
  int64_t num_heads = 1;
  bool qkv_bias = false;
  bool causal = true;
  // GroupedQueryAttention; MultiHeadAttention and GroupedQueryAttention (0: none);
  // MultiHeadLatentAttention (0: its default).
  int64_t num_kv_groups = 1;
  int64_t sliding_window_size = 0;
  int64_t latent_dim = 0;
  // MultiHeadAttention(CombinedQKV) and GroupedQueryAttention: RoPE (unset: none), QK-norm.
  c10::optional<RopeOptions> rope = c10::nullopt;
  bool qk_norm = false;

  /// The same arguments as JSON, for scripts/check_python_interop.py --config.
  std::string json() const {
    return c10::str(
        "{\"d_in\": ", d_in, ", \"d_out\": ", d_out, ", \"context_length\": ", context_length,
        ", \"dropout\": ", dropout, ", \"num_heads\": ", num_heads,
        ", \"qkv_bias\": ", qkv_bias ? "true" : "false",
        ", \"causal\": ", causal ? "true" : "false", ", \"num_kv_groups\": ", num_kv_groups,
        ", \"sliding_window_size\": ", sliding_window_size, ", \"latent_dim\": ", latent_dim,
        ", \"rope\": ", rope ? rope_json(*rope) : "null",
        ", \"qk_norm\": ", qk_norm ? "true" : "false", "}");
  }

 private:
  // scripts/reference_attention.py's rope dict.
  static std::string rope_json(const RopeOptions& rope) {
    std::string freq = "null";
    if (const auto& f = rope.freq_config()) {
      freq = c10::str("{\"factor\": ", f->factor(), ", \"low_freq_factor\": ", f->low_freq_factor(),
                      ", \"high_freq_factor\": ", f->high_freq_factor(),
                      ", \"original_context_length\": ", f->original_context_length(), "}");
    }
    return c10::str("{\"context_length\": ", rope.context_length(),
                    ", \"theta_base\": ", rope.theta_base(), ", \"layout\": \"",
                    rope.layout() == RopeLayout::kSplitHalf ? "split_half" : "interleaved",
                    "\", \"freq_config\": ", freq, "}");
  }
};

const std::vector<AttentionBackend> kBackends{AttentionBackend::kMath, AttentionBackend::kFused,
                                              AttentionBackend::kChunked};

/// The constructor arguments in a Python config dict (make_golden.py's config()); the
/// family's keys may be absent or None (then: no window, the default latent).
inline ModuleConfig module_config_of(const c10::IValue& config) {
  const auto dict = config.toGenericDict();
  const auto optional_int = [&](const char* key, int64_t none) {
    const auto found = dict.find(key);
    return found == dict.end() || found->value().isNone() ? none : found->value().toInt();
  };
  ModuleConfig c;
  c.d_in = dict.at("d_in").toInt();
  c.d_out = dict.at("d_out").toInt();
  c.context_length = dict.at("context_length").toInt();
  c.dropout = dict.at("dropout").toDouble();
  c.num_heads = dict.at("num_heads").toInt();
  c.qkv_bias = dict.at("qkv_bias").toBool();
  c.causal = dict.at("causal").toBool();
  c.num_kv_groups = optional_int("num_kv_groups", 1);
  c.sliding_window_size = optional_int("sliding_window_size", 0);
  c.latent_dim = optional_int("latent_dim", 0);
  return c;
}

/// A module with a KV cache, through the interface they share.
using CachedAttention = std::shared_ptr<CachedAttentionLayer>;

/// The classes with a KV cache: the multi-head ones and the attention family.
inline CachedAttention make_cached_attention(const std::string& name, const ModuleConfig& c) {
  const auto window =
      c.sliding_window_size > 0 ? c10::optional<int64_t>(c.sliding_window_size) : c10::nullopt;
  const auto latent = c.latent_dim > 0 ? c10::optional<int64_t>(c.latent_dim) : c10::nullopt;
  const auto mha =
      MultiHeadAttentionOptions(c.d_in, c.d_out, c.context_length, c.dropout, c.num_heads)
          .qkv_bias(c.qkv_bias)
          .causal(c.causal)
          .sliding_window_size(window)
          .rope(c.rope)
          .qk_norm(c.qk_norm);
  if (name == "MultiHeadAttention")
    return MultiHeadAttention(mha).ptr();
  if (name == "MultiHeadAttentionCombinedQKV")
    return MultiHeadAttentionCombinedQKV(mha).ptr();
  if (name == "GroupedQueryAttention") {
    return GroupedQueryAttention(GroupedQueryAttentionOptions(c.d_in, c.d_out, c.dropout,
                                                              c.num_heads, c.num_kv_groups)
                                     .qkv_bias(c.qkv_bias)
                                     .sliding_window_size(window)
                                     .rope(c.rope)
                                     .qk_norm(c.qk_norm))
        .ptr();
  }
  TORCH_CHECK(name == "MultiHeadLatentAttention", "[make_attention] unknown module '", name, "'");
  return MultiHeadLatentAttention(
             MultiHeadLatentAttentionOptions(c.d_in, c.d_out, c.dropout, c.num_heads)
                 .qkv_bias(c.qkv_bias)
                 .latent_dim(latent))
      .ptr();
}

/// A module of any attnkit class with a type-erased forward.
struct AnyAttention {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

template <typename Holder>
AnyAttention erase(Holder holder) {
  return {holder.ptr(), [holder](const torch::Tensor& x) mutable { return holder(x); }};
}

inline AnyAttention make_attention(const std::string& name, const ModuleConfig& c) {
  if (name == "SelfAttentionV1")
    return erase(SelfAttentionV1(c.d_in, c.d_out));
  if (name == "SelfAttentionV2")
    return erase(SelfAttentionV2(c.d_in, c.d_out, c.qkv_bias));
  if (name == "CausalAttention") {
    return erase(CausalAttention(c.d_in, c.d_out, c.context_length, c.dropout, c.qkv_bias));
  }
  if (name == "MultiHeadAttentionWrapper") {
    return erase(MultiHeadAttentionWrapper(c.d_in, c.d_out, c.context_length, c.dropout,
                                           c.num_heads, c.qkv_bias));
  }
  auto cached = make_cached_attention(name, c);
  return {cached->as_module(), [cached](const torch::Tensor& x) { return cached->forward(x); }};
}

/// x (b, n, d_in) fed in pieces of `splits` tokens through one cache -> (b, n, d_out).
inline torch::Tensor forward_in_pieces(CachedAttention& m, const torch::Tensor& x,
                                       const std::vector<int64_t>& splits, KVCache& cache) {
  std::vector<torch::Tensor> outputs;
  int64_t start = 0;
  for (const auto length : splits) {
    outputs.push_back(m->forward_with_cache(x.narrow(1, start, length), cache));
    start += length;
  }
  EXPECT_EQ(start, x.size(1)) << "the splits must cover x";
  return torch::cat(outputs, 1);
}

/// Feeds x (b, n, d_in) through one cache in each way of `splits` (resetting it between) and
/// expects the rows of the uncached forward, the cache's count of positions and its storage
/// size unchanged; `label` names the module in failures.
inline void expect_cached_pieces_match_forward(CachedAttention& m, const torch::Tensor& x,
                                               const std::vector<std::vector<int64_t>>& splits,
                                               KVCache& cache, const std::string& label) {
  const auto full = m->forward(x);
  const auto bytes = cache.nbytes();
  for (const auto& pieces : splits) {
    SCOPED_TRACE(c10::str(label, " ", x.scalar_type(), " pieces ", c10::IntArrayRef(pieces)));
    cache.reset();
    EXPECT_TRUE(tensors_close("cached", forward_in_pieces(m, x, pieces, cache), full,
                              agreement(x.scalar_type())));
    EXPECT_EQ(cache.size(), x.size(1));
    EXPECT_EQ(cache.nbytes(), bytes);
  }
}

/// A mask of a cached step over the positions [0, end) it reads.
using MaskAtPositions = std::function<Mask(int64_t end)>;

/// Masks over the positions of two sequences of 12, for cached steps that read them as in
/// training: packed documents (causal; the second row's ids rolled by 2), read from their
/// host form, over the positions a step reads and over the whole sequences, and as a block
/// mask of the whole sequences (blocks of 4); and a mask_mod, evaluated as tensors, that
/// leaves position 3's query no key but itself and, in a window of 2, a later query none at
/// all (zeros, as in training).
inline std::vector<std::pair<std::string, MaskAtPositions>> masks_over_two_sequences() {
  const auto one_row = torch::tensor({0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2}, torch::kInt64);
  const auto ids = torch::stack({one_row, one_row.roll(2)});  // (2, 12)
  const auto mask_mod = Mask::from_function([](const torch::Tensor&, const torch::Tensor& h,
                                               const torch::Tensor& q, const torch::Tensor& kv) {
    return (kv.remainder(3) != 1) & ((h == 0) | (kv != q - 1) | (q == 3));
  });
  const auto whole = Mask::documents(ids, true);
  const auto blocks = Mask::from_block_mask(
      create_block_mask(whole, 2, 1, 12, 12, BlockMaskOptions().block_size(4)));
  return {
      {"documents", [ids](int64_t end) { return Mask::documents(ids.narrow(1, 0, end), true); }},
      {"documents of the whole sequences", [whole](int64_t) { return whole; }},
      {"block mask of the whole sequences", [blocks](int64_t) { return blocks; }},
      {"mask_mod", [mask_mod](int64_t) { return mask_mod; }}};
}

}  // namespace attnkit::testing
