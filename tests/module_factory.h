#pragma once

// Builds any attnkit module from its class name and constructor arguments: the C++
// counterpart of scripts/reference_attention.py's build(), for golden and interop tests.

#include <functional>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "attnkit/attnkit.h"

namespace attnkit::testing {

struct ModuleConfig {
  int64_t d_in = 1;
  int64_t d_out = 1;
  int64_t context_length = 1;
  double dropout = 0.0;
  int64_t num_heads = 1;
  bool qkv_bias = false;
  bool causal = true;

  /// The same arguments as JSON, for scripts/check_python_interop.py --config.
  std::string json() const {
    return c10::str("{\"d_in\": ", d_in, ", \"d_out\": ", d_out,
                    ", \"context_length\": ", context_length, ", \"dropout\": ", dropout,
                    ", \"num_heads\": ", num_heads, ", \"qkv_bias\": ", qkv_bias ? "true" : "false",
                    ", \"causal\": ", causal ? "true" : "false", "}");
  }
};

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
  const auto mha =
      MultiHeadAttentionOptions(c.d_in, c.d_out, c.context_length, c.dropout, c.num_heads)
          .qkv_bias(c.qkv_bias)
          .causal(c.causal);
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
  if (name == "MultiHeadAttention")
    return erase(MultiHeadAttention(mha));
  if (name == "MultiHeadAttentionCombinedQKV")
    return erase(MultiHeadAttentionCombinedQKV(mha));
  TORCH_CHECK(false, "[make_attention] unknown module '", name, "'");
}

}  // namespace attnkit::testing
