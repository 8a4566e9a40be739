#pragma once

/// `attnkit::BlockMask`: FlexAttention's block mask in C++. A `Mask` judged once for a
/// problem's shape: per (batch, head, query block), the key blocks that need the mask
/// (partial) and those every query sees (full). Forward and backward read the same lists,
/// every layer of a model can reuse one, and the mask itself is evaluated only on partial
/// tiles (docs/masks.md, "Block masks").

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/mask.h"

namespace attnkit {

/// Options of `create_block_mask`: the block sizes (FlexAttention's `BLOCK_SIZE`, default 128
/// for queries and keys) and the device the block lists live on (that of the attention).
/// Example: `BlockMaskOptions().block_size(64).device(torch::kCUDA)`.
class BlockMaskOptions {
 public:
  BlockMaskOptions() = default;
  /// One size for query and key blocks (FlexAttention's `BLOCK_SIZE=n`).
  BlockMaskOptions& block_size(int64_t size) {
    q_block_size_ = kv_block_size_ = size;
    return *this;
  }
  /// A query and a key block size (FlexAttention's `BLOCK_SIZE=(q, kv)`).
  BlockMaskOptions& block_size(int64_t q_block_size, int64_t kv_block_size) {
    q_block_size_ = q_block_size;
    kv_block_size_ = kv_block_size;
    return *this;
  }
  BlockMaskOptions& device(const torch::Device& device) {
    device_ = device;
    return *this;
  }
  int64_t q_block_size() const { return q_block_size_; }
  int64_t kv_block_size() const { return kv_block_size_; }
  const torch::Device& device() const { return device_; }

 private:
  int64_t q_block_size_ = 128;
  int64_t kv_block_size_ = 128;
  torch::Device device_ = torch::kCPU;
};

/// A mask judged block by block for one shape (B, H, Q_LEN, KV_LEN), as FlexAttention's
/// `BlockMask`. B or H of 1 serve any batch or head count (FlexAttention's `None`). A tile is
/// full when every one of its q_block x kv_block entries may attend; the last, short block of
/// a length that is not a multiple of the block size counts as padded with masked entries, so
/// it is partial or empty, never full (as FlexAttention's).
/// Example: `auto bm = create_block_mask(Mask::causal(), 1, 1, 4096, 4096);`
class BlockMask {
 public:
  /// An empty block mask (`defined()` false); make one with `create_block_mask`.
  BlockMask() = default;

  bool defined() const { return kinds_ != nullptr; }
  /// Partial key blocks per (B, H, query block), int32 (B, H, num_q_blocks).
  const torch::Tensor& kv_num_blocks() const { return kv_num_blocks_; }
  /// Their indices, ascending, then the other blocks' (FlexAttention's order), int32
  /// (B, H, num_q_blocks, num_kv_blocks): the first kv_num_blocks of each row count.
  const torch::Tensor& kv_indices() const { return kv_indices_; }
  /// Full key blocks per (B, H, query block), int32 (B, H, num_q_blocks).
  const torch::Tensor& full_kv_num_blocks() const { return full_kv_num_blocks_; }
  /// Their indices, as `kv_indices`.
  const torch::Tensor& full_kv_indices() const { return full_kv_indices_; }
  /// Percent of tiles skipped (neither partial nor full), as FlexAttention's `sparsity()`.
  double sparsity() const;
  /// The block-level matrix, bool (B, H, num_q_blocks, num_kv_blocks): true where a tile is
  /// partial or full.
  torch::Tensor to_dense() const;
  /// A readable summary: shape, block sizes, sparsity, the mask, and for small masks a
  /// picture of the tiles ('#' full, '~' partial, '.' empty) of batch 0, head 0.
  std::string to_string() const;
  /// The mask it was made from (evaluated on partial tiles).
  const Mask& mask() const { return mask_; }

  int64_t batch() const { return batch_; }
  int64_t heads() const { return heads_; }
  int64_t q_len() const { return q_len_; }
  int64_t kv_len() const { return kv_len_; }
  int64_t q_block_size() const { return q_block_size_; }
  int64_t kv_block_size() const { return kv_block_size_; }
  int64_t num_q_blocks() const { return (q_len_ + q_block_size_ - 1) / q_block_size_; }
  int64_t num_kv_blocks() const { return (kv_len_ + kv_block_size_ - 1) / kv_block_size_; }
  const torch::Device& device() const { return device_; }

  /// The verdict on tile (q_block, kv_block) of batch entry `batch` and head `head` (either
  /// broadcast when this mask has 1 of them), read from a host copy of the lists made once
  /// when the mask was built: no device synchronisation.
  TileKind kind(int64_t batch, int64_t head, int64_t q_block, int64_t kv_block) const;

  /// FlexAttention's `BlockMask.from_kv_blocks`: a block mask from block lists that another
  /// library made (PyTorch's `create_block_mask`; the attnkit operators, docs/python.md), for
  /// queries of length q_len and keys of length kv_len in blocks of q_block_size and
  /// kv_block_size. kv_num_blocks (B, H, num_q_blocks) and kv_indices (B, H, num_q_blocks,
  /// num_kv_blocks or more), int32 or int64, list the partial tiles; the full lists, of the same
  /// shapes, may be undefined (no full tile). `mask` is evaluated on the partial tiles only.
  /// Every count, index and shape is checked (a c10::Error names the list and the values); the
  /// lists are read on the host once.
  /// Example: `BlockMask::from_kv_blocks(num, idx, {}, {}, 256, 256, 128, 128, Mask::causal())`.
  static BlockMask from_kv_blocks(const torch::Tensor& kv_num_blocks,
                                  const torch::Tensor& kv_indices,
                                  const torch::Tensor& full_kv_num_blocks,
                                  const torch::Tensor& full_kv_indices, int64_t q_len,
                                  int64_t kv_len, int64_t q_block_size, int64_t kv_block_size,
                                  const Mask& mask);

  /// Fails with a c10::Error naming `fn` and both shapes unless this block mask serves a
  /// problem of `batch` sequences, `heads` query heads, n queries and m keys on `device`.
  void check(const char* fn, int64_t batch, int64_t heads, int64_t num_queries, int64_t num_keys,
             const torch::Device& device) const;

 private:
  friend BlockMask create_block_mask(const Mask&, int64_t, int64_t, int64_t, int64_t,
                                     const BlockMaskOptions&);
  BlockMask(Mask mask, int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len,
            int64_t q_block_size, int64_t kv_block_size, const torch::Device& device);
  // Takes the verdicts (B, H, num_q_blocks, num_kv_blocks), row-major, and makes the lists.
  void set_kinds(std::vector<TileKind> kinds);
  Mask mask_;
  int64_t batch_ = 0, heads_ = 0, q_len_ = 0, kv_len_ = 0;
  int64_t q_block_size_ = 0, kv_block_size_ = 0;
  torch::Device device_ = torch::kCPU;
  torch::Tensor kv_num_blocks_, kv_indices_, full_kv_num_blocks_, full_kv_indices_;
  // TileKind per (B, H, num_q_blocks, num_kv_blocks), row-major, on the host; shared by copies.
  std::shared_ptr<const std::vector<TileKind>> kinds_;
};

/// FlexAttention's `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)` for any `Mask`
/// (structured kinds, tensors, mask_mods and their `&` / `|` combinations). Structured masks
/// (causal, windows, padding, documents) judge most tiles without evaluating them; the rest
/// are evaluated once here, on `options.device()`, with one transfer of their verdicts to
/// the host. B and H may be 1 (broadcast) when the mask does not depend on the batch or the head.
/// Example: `create_block_mask(Mask::documents(ids, true), 1, 1, n, n,
///                             BlockMaskOptions().block_size(64))`.
BlockMask create_block_mask(const Mask& mask, int64_t B, int64_t H, int64_t Q_LEN, int64_t KV_LEN,
                            const BlockMaskOptions& options = {});

}  // namespace attnkit
