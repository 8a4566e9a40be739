// FlexAttention's block lists as the operators take them (flex_operators.cpp): the lists, and
// the partial tiles' bits, packed (P, q_block_size, kv_block_size) in the lists' order or one
// tile per slot of kv_indices (B, H, nq, nk, q_block_size, kv_block_size), as attnkit's Mask.

#include "ops/block_lists.h"

#include <vector>

#include "attnkit/block_mask.h"
#include "core/base/checks.h"
#include "core/masks/mask_parts.h"

namespace attnkit::ops {

using detail::shape_string;
using torch::Tensor;

namespace {

// (B, H, nq, nk) int64 on the host: each tile's position in the packed partial tiles, -1
// for a full tile, -2 for an empty one; and how many partial tiles the lists name.
std::pair<Tensor, int64_t> tile_slots(const BlockMask& blocks) {
  auto slots =
      torch::full({blocks.batch(), blocks.heads(), blocks.num_q_blocks(), blocks.num_kv_blocks()},
                  -2, torch::kInt64);
  auto* slot = slots.data_ptr<int64_t>();
  const auto counts = blocks.kv_num_blocks().to(torch::kCPU, torch::kInt64).contiguous();
  const auto indices = blocks.kv_indices().to(torch::kCPU, torch::kInt64).contiguous();
  const auto full_counts = blocks.full_kv_num_blocks().to(torch::kCPU, torch::kInt64).contiguous();
  const auto full_indices = blocks.full_kv_indices().to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t rows = counts.numel(), nk = blocks.num_kv_blocks();
  int64_t next = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < counts.data_ptr<int64_t>()[r]; ++i)
      slot[r * nk + indices.data_ptr<int64_t>()[r * nk + i]] = next++;
    for (int64_t i = 0; i < full_counts.data_ptr<int64_t>()[r]; ++i)
      slot[r * nk + full_indices.data_ptr<int64_t>()[r * nk + i]] = -1;
  }
  return {slots, next};
}

// partial_tiles packed as tile_slots numbers them, (P, qb, kb): as given, or from the layout
// with a tile per slot of kv_indices, (B, H, nq, nk, qb, kb), whose unused slots are dropped.
// Python gives the latter inside torch.compile, where picking the partial tiles out would be
// a shape that depends on the data (docs/python.md).
Tensor packed_partial_tiles(const BlockMask& lists, const Tensor& bits) {
  const auto& counts = lists.kv_num_blocks();
  const std::vector<int64_t> per_slot{counts.size(0),       counts.size(1),
                                      lists.num_q_blocks(), lists.num_kv_blocks(),
                                      lists.q_block_size(), lists.kv_block_size()};
  if (bits.sizes() != per_slot)
    return bits;  // packed already, checked by the caller
  const auto used = torch::arange(per_slot[3], counts.options().dtype(torch::kInt64))
                        .lt(counts.to(torch::kInt64).unsqueeze(-1));  // (B, H, nq, nk)
  // (B, H, nq, nk, qb, kb) -> (B * H * nq * nk, qb, kb), the used slots row by row
  return bits.reshape({-1, per_slot[4], per_slot[5]}).index({used.flatten().to(bits.device())});
}

// Whether the lists and the partial tiles' bits say what Mask::causal() says (query i sees
// the keys j <= i) for every batch entry and head: then the planner may run the call on a
// kernel that takes causal masks whole (LibTorch's CPU flash kernel) instead of reading tiles.
// The tiles' kinds are compared first (on the host), so another mask costs little.
bool says_causal(const BlockMask& lists, const Tensor& slots, const Tensor& bits, int64_t n,
                 int64_t m) {
  const int64_t qb = lists.q_block_size(), kb = lists.kv_block_size();
  const int64_t nq = lists.num_q_blocks(), nk = lists.num_kv_blocks();
  const auto* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> partial_slots, partial_q, partial_kv;
  for (int64_t row = 0; row < slots.size(0) * slots.size(1); ++row) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t q_last = std::min(n, (i + 1) * qb) - 1,
                      kv_last = std::min(m, (j + 1) * kb) - 1;
        const int64_t given = slot[(row * nq + i) * nk + j];
        if (given >= 0) {
          partial_slots.push_back(given);
          partial_q.push_back(i * qb);
          partial_kv.push_back(j * kb);
        } else if (given == -1 ? i * qb < kv_last : q_last >= j * kb) {
          return false;  // full where causal's is not, or empty where it is not
        }
      }
    }
  }
  if (partial_slots.empty())
    return true;
  // The partial tiles' bits against causal's: (P, qb, kb), in bounds only.
  const auto index = torch::TensorOptions().dtype(torch::kInt64).device(bits.device());
  const auto q =
      torch::tensor(partial_q, index).view({-1, 1, 1}) + torch::arange(qb, index).view({1, -1, 1});
  const auto kv =
      torch::tensor(partial_kv, index).view({-1, 1, 1}) + torch::arange(kb, index).view({1, 1, -1});
  const auto given = bits.index_select(0, torch::tensor(partial_slots, index));
  const auto out_of_bounds = q.ge(n).logical_or(kv.ge(m));
  return given.eq(q.ge(kv)).logical_or(out_of_bounds).all().item<bool>();
}

}  // namespace

// The mask of the arguments' block lists and partial tiles on inputs q (B, H, n, hd) and k:
// none without lists, causal where they say it, else the lists themselves.
Mask block_lists_mask(const Tensor& q, const Tensor& k, const c10::optional<Tensor>& kv_num_blocks,
                      const c10::optional<Tensor>& kv_indices,
                      const c10::optional<Tensor>& full_kv_num_blocks,
                      const c10::optional<Tensor>& full_kv_indices,
                      const c10::optional<Tensor>& partial_tiles, int64_t q_block_size,
                      int64_t kv_block_size) {
  if (!kv_num_blocks.has_value())
    return Mask();
  TORCH_CHECK(kv_indices.has_value() && partial_tiles.has_value(), kOp,
              " a block mask needs kv_num_blocks, kv_indices and partial_tiles");
  const auto full_num = full_kv_num_blocks.value_or(Tensor());
  const auto full_idx = full_kv_indices.value_or(Tensor());
  // First the lists alone (checked), then the partial tiles' mask over them.
  auto lists = BlockMask::from_kv_blocks(*kv_num_blocks, *kv_indices, full_num, full_idx, q.size(2),
                                         k.size(2), q_block_size, kv_block_size, Mask());
  lists.check(kOp, q.size(0), q.size(1), q.size(2), k.size(2), q.device());
  const auto [slots, partial_count] = tile_slots(lists);
  const auto bits = packed_partial_tiles(lists, *partial_tiles);
  const std::vector<int64_t> expected{partial_count, q_block_size, kv_block_size};
  TORCH_CHECK(bits.scalar_type() == torch::kBool && bits.sizes() == expected, kOp,
              " partial_tiles must be bool (", partial_count, ", ", q_block_size, ", ",
              kv_block_size, ") (one tile per partial block the lists name), or (",
              lists.kv_num_blocks().size(0), ", ", lists.kv_num_blocks().size(1), ", ",
              lists.num_q_blocks(), ", ", lists.num_kv_blocks(), ", ", q_block_size, ", ",
              kv_block_size, ") (one per slot of kv_indices), got ", partial_tiles->scalar_type(),
              " ", shape_string(*partial_tiles));
  TORCH_CHECK(bits.device() == q.device(), kOp, " partial_tiles is on ", bits.device(),
              ", the query on ", q.device());
  if (says_causal(lists, slots, bits, q.size(2), k.size(2)))
    return Mask::causal();
  const auto mask = detail::packed_tiles_mask(slots, bits, q_block_size, kv_block_size);
  return Mask::from_block_mask(BlockMask::from_kv_blocks(*kv_num_blocks, *kv_indices, full_num,
                                                         full_idx, q.size(2), k.size(2),
                                                         q_block_size, kv_block_size, mask));
}

}  // namespace attnkit::ops
