#pragma once

/// Context parallelism: one sequence's queries, keys and values split over R ranks, each
/// rank computing its queries' attention over the whole sequence's keys, which it receives
/// from the others shard by shard. Output and gradients equal the single-process call, for
/// any mask and any named score function or ScoreGraph (docs/distributed.md).
///
/// The library knows nothing of process groups: a `ShardExchange` moves the tensors.
/// attnkit-train's c10d group (Gloo on the CPU) is one (src/train/distributed.h).

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "attnkit/attention.h"

namespace attnkit {

/// How a sequence's tokens are spread over the ranks.
enum class ShardLayout {
  /// Rank r holds tokens [r n / R, (r + 1) n / R). Under a sliding window shorter than a
  /// shard a rank needs its own and its predecessor's keys alone, and exchanges no others.
  kContiguous,
  /// The sequence in 2 R chunks; rank r holds chunks r and 2 R - 1 - r (a head and a tail),
  /// so that under a causal or document mask every rank computes about the same number of
  /// tiles (zigzag). The default.
  kZigzag,
};

/// A contiguous run of a sequence that one rank holds.
struct SequenceChunk {
  /// Its first token's position in the whole sequence.
  int64_t start = 0;
  int64_t length = 0;
  /// Its first token's position in the rank's shard.
  int64_t local_start = 0;
};

/// The split of a sequence of `length` tokens over `ranks` ranks by `layout`. length must
/// divide into ranks (kContiguous) or 2 ranks (kZigzag) equal chunks.
/// Example: `SequenceShards shards(4096, 2, ShardLayout::kZigzag);
///           auto q_mine = shards.shard(q, rank, 2);`
class SequenceShards {
 public:
  SequenceShards(int64_t length, int ranks, ShardLayout layout = ShardLayout::kZigzag);

  int64_t length() const { return length_; }
  int ranks() const { return ranks_; }
  ShardLayout layout() const { return layout_; }
  /// Tokens per rank: length / ranks.
  int64_t shard_length() const { return length_ / ranks_; }
  /// Rank `rank`'s chunks, in the order its shard holds them.
  std::vector<SequenceChunk> chunks(int rank) const;
  /// The positions in the whole sequence of rank `rank`'s tokens, int64 (shard_length): the
  /// positions its rotary embeddings take.
  torch::Tensor positions(int rank) const;
  /// Rank `rank`'s tokens of a whole sequence along dimension `dim`.
  torch::Tensor shard(const torch::Tensor& whole, int rank, int64_t dim) const;
  /// The whole sequence along `dim` from every rank's shard, in rank order.
  torch::Tensor unshard(const std::vector<torch::Tensor>& shards, int64_t dim) const;

 private:
  int64_t length_;
  int ranks_;
  ShardLayout layout_;
};

/// What a context-parallel call needs from the ranks' process group: point-to-point
/// transfers that it starts and waits for later, so that computing hides them.
class ShardExchange {
 public:
  virtual ~ShardExchange() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Starts sending `send` to rank `to` and receiving into `receive` (tensors shaped and
  /// typed as rank `from` sends them) from rank `from`, and returns a function that waits for
  /// both. Every rank starts its transfers in the same order. A rank that is lost makes the
  /// wait throw, naming it.
  virtual std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int to,
                                                   std::vector<torch::Tensor>& receive,
                                                   int from) = 0;
};

/// Options of `context_parallel_attention`.
/// Example: `ContextParallelOptions().layout(ShardLayout::kContiguous)`.
struct ContextParallelOptions {
  /// How the sequence lies over the ranks (each rank's shard is `SequenceShards::shard`).
  TORCH_ARG(ShardLayout, layout) = ShardLayout::kZigzag;
  /// The most bytes of keys (and as many of values) in a piece: queries and other ranks' keys
  /// go in pieces of this many tokens, so that the buffers in flight and the copies each call
  /// makes stay small beside a shard, and a piece that no query of any rank sees is not sent.
  /// 4 MiB is 2,048 tokens of 8 float32 heads of 64: as fast as 8 MiB at n 32,768 on 2 ranks,
  /// with less memory (docs/distributed.md).
  TORCH_ARG(int64_t, piece_bytes) = 4 << 20;
};

namespace functional {

/// `attention` over a whole sequence split over the ranks of `exchange` as `parallel.layout`
/// says: query (b, h, s, hd), key (b, g, s, hd) and value (b, g, s, hd_v) are this rank's
/// shards (`SequenceShards::shard`, s = n / R), and the result is this rank's queries' output
/// (b, h, s, hd_v), with autograd: its backward sends each piece of keys' and values'
/// gradients home. `options.mask` (or `options.block_mask`) is the whole sequence's (n x n);
/// each rank applies its region to each pair of pieces and skips the pairs it leaves empty,
/// and no rank receives keys that none of its queries sees. Every rank passes the same
/// options, and `exchange` must outlive the backward, which sends gradients through it. The
/// CPU's split kernels compute each pair (attention_forward); 16-bit shards travel in 16 bits
/// and are computed and merged in float32, rounded once at the end. A score function reads q_idx
/// and kv_idx as positions in the whole sequence; the gradients of its tensors (a relative-position
/// table) are this rank's queries' share, which sum over the ranks like any parameter's.
/// Refused, before any exchange: dropout, sinks, C++ function score functions (the split
/// kernels run the named ones and ScoreGraphs), and a shard that does not divide into the
/// layout's chunks.
/// Example: `context_parallel_attention(q, k, v, group,
///              AttentionOptions().mask(Mask::causal()))`.
torch::Tensor context_parallel_attention(const torch::Tensor& query, const torch::Tensor& key,
                                         const torch::Tensor& value, ShardExchange& exchange,
                                         const AttentionOptions& options = {},
                                         const ContextParallelOptions& parallel = {});

}  // namespace functional

/// Runs the multi-head modules context-parallel on this thread while it lives, as
/// PyTorch's `context_parallel` does for SDPA: the self-attention forward of
/// MultiHeadAttention, MultiHeadAttentionCombinedQKV, GroupedQueryAttention and
/// MultiHeadLatentAttention takes x (b, s, d) as this rank's shard (SequenceShards::shard) of
/// a sequence of `sequence_length` tokens, rotates each token at its position in the whole
/// sequence (RoPE), reads the mask it is given (and its own causal mask and window) as the
/// whole sequence's, and attends through context_parallel_attention over `exchange`.
/// Refused inside a scope, by name: attention weights, cross-attention, KV-cache calls, and
/// what context_parallel_attention refuses (dropout in training, sinks, C++ function score
/// functions). The backward needs `exchange`, not the scope. Every rank runs the same
/// modules in the same order.
/// Example: `{ ContextParallelScope cp(group, 4096); loss = lm(tokens_mine).mean(); }
///           loss.backward();`
class ContextParallelScope {
 public:
  ContextParallelScope(ShardExchange& exchange, int64_t sequence_length,
                       const ContextParallelOptions& options = {});
  /// Restores the scope it found (none, or an outer one).
  ~ContextParallelScope();
  ContextParallelScope(const ContextParallelScope&) = delete;
  ContextParallelScope& operator=(const ContextParallelScope&) = delete;

  /// The innermost scope on this thread, or null.
  static const ContextParallelScope* current();

  ShardExchange& exchange() const { return exchange_; }
  const ContextParallelOptions& options() const { return options_; }
  /// The sequence's split: this rank's chunks and positions.
  const SequenceShards& shards() const { return shards_; }
  /// This rank's tokens' positions in the whole sequence, int64 (s) on `device`.
  torch::Tensor positions(const torch::Device& device) const;

 private:
  ShardExchange& exchange_;
  ContextParallelOptions options_;
  SequenceShards shards_;
  const ContextParallelScope* outer_;
};

}  // namespace attnkit
