#pragma once

// attnkit-bench's problem: its settings, the mask and score function they name, and the
// FLOPs it counts and the --precision report (bench_problem.cpp, bench_precision.cpp).

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attnkit.h"

namespace attnkit::bench {

struct BenchConfig {
  int64_t batch = 8;
  int64_t tokens = 1024;
  int64_t d_model = 768;
  int64_t heads = 12;
  bool causal = true;
  int64_t window = 0;  // sliding window (0: none)
  std::string device = "cpu";
  std::string dtype = "float32";
  int64_t threads = 0;
  int64_t repeats = 5;
  int64_t warmup = 1;
  // Block sizes of the chunked backend (MultiHeadAttentionOptions' defaults).
  int64_t chunk_size = attnkit::MultiHeadAttentionOptions(1, 1, 1, 0.0, 1).query_block_size();
  int64_t key_chunk_size = attnkit::MultiHeadAttentionOptions(1, 1, 1, 0.0, 1).key_block_size();
  std::vector<std::string> only;
  std::string json;
  // --mask / --score: an attnkit::Mask and score function for the core implementations.
  std::string mask = "module";
  std::string score = "none";
  double masked_keys_per_query = -1.0;  // from the mask's dense form; < 0: --causal/--window
  // --layers / --block-mask: a stack of core attention calls per step, and who judges the mask.
  int64_t layers = 1;
  std::string block_mask = "per-call";
  // --precision: errors against float64 instead of times.
  bool precision = false;
};

// --mask KIND: "module" (--causal and --window), "documents:K" (each row K documents of
// n / K tokens; causal with --causal), "padded" (key padding, lengths uniform in
// [min(128, n), n], seed 0; causal with --causal), "causal-mod" (causal as a mask_mod);
// "-dense" after any of them gives the same mask as a dense bool tensor (Mask::from_tensor).
struct MaskKind {
  std::string kind;  // without "-dense"
  bool dense = false;
  int64_t documents = 0;  // K of documents:K
};

// Parses and checks --mask without building anything (main calls it before any work).
MaskKind parse_mask(const BenchConfig& c);

// The mask of --mask on `device`.
attnkit::Mask make_mask(const BenchConfig& c, const torch::Device& device);

// --score: none, alibi (the paper's slopes) or softcap (30, Gemma 2's attention cap).
attnkit::ScoreMod make_score(const BenchConfig& c);

// The attention core alone (no projections): softmax(q k^T / sqrt(hd)) v on (b, h, n, hd).
bool is_core_only(const std::string& name);

// FLOPs of one forward and of forward+backward (see --help and docs/benchmarks.md).
struct Flops {
  double forward;
  double forward_backward;
};

// The FLOPs a problem needs: the core's only over the keys each query sees.
Flops model_flops(const BenchConfig& c, const std::string& name);

// The FLOPs implementation `name` executes: the math-style paths compute the full score matrix
// even when causal.
Flops executed_flops(const BenchConfig& c, const std::string& name,
                     const torch::TensorOptions& options);

// For --mask and --score at --dtype: each backend's largest error of the output and of the
// q, k, v gradients against float64 on the same (rounded) inputs, and as a multiple of the
// float32 floor (float32 arithmetic on those inputs, each result rounded once to --dtype).
void report_precision(const BenchConfig& c, const torch::TensorOptions& options);

}  // namespace attnkit::bench
