// attnkit::BlockMask: a Mask judged once per tile for one problem shape. The structure of the
// mask settles most tiles without evaluating them (Mask::structural_kind); the others, per
// query block, are evaluated over the span of key blocks they cover, in cache-sized pieces,
// the query blocks in parallel on the CPU, and their verdicts cross to the host in one
// transfer at the end. The lists are then
// built on the host (a few bytes per tile) and moved to the mask's device.

#include "attnkit/block_mask.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "core/base/checks.h"
#include "core/base/parallel.h"

namespace attnkit {

using detail::shape_string;

namespace {

const char* const kCreateFn = "[create_block_mask]";

// Tiles of one query block whose kind only their entries tell, for every batch entry: which
// (batch, key block) pairs, over key blocks [first, first + blocks).
struct PendingStripe {
  int64_t q_block;
  int64_t first;
  int64_t blocks;
  std::vector<char> wanted;  // (B, blocks), row-major
};

// Mask entries evaluated at once per (batch, head) slice: a piece of a stripe stays in the
// L2 cache of the development machine (2 MiB per core) while it is reduced.
constexpr int64_t kPieceEntries = int64_t{1} << 18;

// The verdicts (B, H, blocks) of key blocks [first, first + blocks) for queries [q0, q0 + bq),
// as stripe_verdicts gives them.
torch::Tensor piece_verdicts(const Mask& mask, int64_t B, int64_t H, int64_t q0, int64_t bq,
                             int64_t qb, int64_t first, int64_t blocks, int64_t kv_block,
                             int64_t kv_len, const torch::Device& device) {
  const auto index = torch::dtype(torch::kInt64).device(device);
  const int64_t k0 = first * kv_block, span = std::min(kv_len, (first + blocks) * kv_block) - k0;
  auto allowed = mask.allowed(torch::arange(B, index).view({-1, 1, 1, 1}),
                              torch::arange(H, index).view({1, -1, 1, 1}),
                              torch::arange(q0, q0 + bq, index).view({1, 1, -1, 1}),
                              torch::arange(k0, k0 + span, index).view({1, 1, 1, -1}));
  while (allowed.dim() < 4)
    allowed = allowed.unsqueeze(0);
  // (B or 1, H or 1, bq, span), padded with masked keys to whole blocks.
  allowed = allowed.expand({allowed.size(0), allowed.size(1), bq, span});
  const int64_t padded = blocks * kv_block;
  if (padded > span) {
    allowed = torch::cat(
        {allowed,
         torch::zeros({allowed.size(0), allowed.size(1), bq, padded - span}, allowed.options())},
        3);
  }
  // (b, h, bq, blocks * kv_block) -> (b, h, bq, blocks, kv_block) -> (b, h, blocks): bool
  // reductions (any, all), no count in a wider type.
  const auto tiles =
      allowed.reshape({allowed.size(0), allowed.size(1), bq, blocks, kv_block}).transpose(2, 3);
  const auto any = tiles.any(-1).any(-1);
  auto all = tiles.all(-1).all(-1);
  if (bq < qb)
    all = torch::zeros_like(all);  // a short query block: padded with masked rows
  return (any.to(torch::kInt8) + all.to(torch::kInt8)).expand({B, H, blocks});
}

// What each (batch, head, key block) tile of one stripe holds: queries [q0, q0 + bq)
// against key blocks [first, first + blocks), int8 (B, H, blocks) flattened: 0 no allowed
// entry, 1 some, 2 all of its q_block x kv_block (a short block, padded with masked entries,
// never has all). Evaluated in pieces of about kPieceEntries entries per slice.
torch::Tensor stripe_verdicts(const Mask& mask, int64_t B, int64_t H, int64_t q0, int64_t bq,
                              int64_t qb, int64_t first, int64_t blocks, int64_t kv_block,
                              int64_t kv_len, const torch::Device& device) {
  const int64_t piece = std::max<int64_t>(1, kPieceEntries / (bq * kv_block));
  std::vector<torch::Tensor> pieces;
  for (int64_t j = first; j < first + blocks; j += piece) {
    pieces.push_back(piece_verdicts(mask, B, H, q0, bq, qb, j, std::min(piece, first + blocks - j),
                                    kv_block, kv_len, device));
  }
  return (pieces.size() == 1 ? pieces[0] : torch::cat(pieces, 2)).reshape({-1});
}

// FlexAttention's ordered form of one kind: per row the count, and the indices of the row's
// blocks of that kind ascending, then the other blocks ascending.
std::pair<torch::Tensor, torch::Tensor> ordered_lists(const std::vector<TileKind>& kinds,
                                                      TileKind kind, int64_t rows,
                                                      int64_t columns) {
  auto counts = torch::empty({rows}, torch::kInt32);
  auto indices = torch::empty({rows, columns}, torch::kInt32);
  auto* count = counts.data_ptr<int32_t>();
  auto* index = indices.data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const TileKind* row = kinds.data() + r * columns;
    int32_t* out = index + r * columns;
    int32_t taken = 0;
    for (int64_t j = 0; j < columns; ++j) {
      if (row[j] == kind)
        out[taken++] = static_cast<int32_t>(j);
    }
    count[r] = taken;
    for (int64_t j = 0; j < columns; ++j) {
      if (row[j] != kind)
        out[taken++] = static_cast<int32_t>(j);
    }
  }
  return {counts, indices};
}

}  // namespace

BlockMask create_block_mask(const Mask& mask, int64_t B, int64_t H, int64_t Q_LEN, int64_t KV_LEN,
                            const BlockMaskOptions& options) {
  TORCH_CHECK(B >= 1 && H >= 1, kCreateFn, " B and H must be >= 1 (1 broadcasts), got B ", B,
              " and H ", H);
  TORCH_CHECK(Q_LEN >= 1 && KV_LEN >= 1, kCreateFn, " Q_LEN and KV_LEN must be >= 1, got Q_LEN ",
              Q_LEN, " and KV_LEN ", KV_LEN);
  const int64_t qb = options.q_block_size(), kb = options.kv_block_size();
  TORCH_CHECK(qb >= 1 && kb >= 1, kCreateFn, " block_size must be >= 1, got (", qb, ", ", kb, ")");
  // "cuda" names the current GPU: its index, as the tensors on it report their device.
  const auto device = detail::indexed_device(options.device());
  mask.check(kCreateFn, B, H, Q_LEN, KV_LEN, device);

  BlockMask result(mask, B, H, Q_LEN, KV_LEN, qb, kb, device);
  const int64_t nq = result.num_q_blocks(), nk = result.num_kv_blocks();

  std::vector<TileKind> kinds(static_cast<size_t>(B * H * nq * nk), TileKind::kEmpty);
  const auto slot = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    return static_cast<size_t>(((b * H + h) * nq + i) * nk + j);
  };
  std::vector<PendingStripe> pending;
  std::vector<char> undecided(static_cast<size_t>(B * nk));
  std::vector<char> column_undecided(static_cast<size_t>(nk));  // for some batch entry
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t q0 = i * qb, bq = std::min(qb, Q_LEN - q0);
    std::fill(undecided.begin(), undecided.end(), 0);
    std::fill(column_undecided.begin(), column_undecided.end(), 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t k0 = j * kb, bk = std::min(kb, KV_LEN - k0);
        const auto known = mask.structural_kind(Tile{b, 0, H, q0, bq, k0, bk});
        if (!known.has_value() || *known == TileKind::kPartial) {
          undecided[static_cast<size_t>(b * nk + j)] = 1;
          column_undecided[static_cast<size_t>(j)] = 1;
          continue;
        }
        // A short tile is padded with masked entries: never full.
        const bool whole = bq == qb && bk == kb;
        const TileKind kind = *known == TileKind::kFull && !whole ? TileKind::kPartial : *known;
        for (int64_t h = 0; h < H; ++h)
          kinds[slot(b, h, i, j)] = kind;
      }
    }
    // One stripe per run of undecided key blocks: the blocks between two runs (a window's
    // full ones, between its two edges) are not evaluated.
    for (int64_t lo = 0; lo < nk;) {
      if (!column_undecided[static_cast<size_t>(lo)]) {
        ++lo;
        continue;
      }
      int64_t end = lo;
      while (end < nk && column_undecided[static_cast<size_t>(end)])
        ++end;
      PendingStripe stripe{i, lo, end - lo, std::vector<char>(static_cast<size_t>(B * (end - lo)))};
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = lo; j < end; ++j)
          stripe.wanted[static_cast<size_t>(b * stripe.blocks + j - lo)] =
              undecided[static_cast<size_t>(b * nk + j)];
      }
      pending.push_back(std::move(stripe));
      lo = end;
    }
  }
  if (!pending.empty()) {
    // The stripes are independent: evaluated on the CPU's workers (a mask_mod may thus be
    // called from several threads at once), serially on a GPU.
    std::vector<torch::Tensor> verdicts(pending.size());
    detail::run_tasks(static_cast<int64_t>(pending.size()), device, [&](int64_t t) {
      const auto& stripe = pending[static_cast<size_t>(t)];
      const int64_t q0 = stripe.q_block * qb;
      verdicts[static_cast<size_t>(t)] =
          stripe_verdicts(mask, B, H, q0, std::min(qb, Q_LEN - q0), qb, stripe.first, stripe.blocks,
                          kb, KV_LEN, device);
    });
    const auto host = torch::cat(verdicts).to(torch::kCPU).contiguous();  // the one transfer
    const int8_t* verdict = host.data_ptr<int8_t>();
    for (const auto& stripe : pending) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t jj = 0; jj < stripe.blocks; ++jj, ++verdict) {
            if (stripe.wanted[static_cast<size_t>(b * stripe.blocks + jj)])
              kinds[slot(b, h, stripe.q_block, stripe.first + jj)] =
                  static_cast<TileKind>(*verdict);  // 0, 1, 2: TileKind's own values
          }
        }
      }
    }
  }

  result.set_kinds(std::move(kinds));
  return result;
}

namespace {

const char* const kFromListsFn = "[BlockMask::from_kv_blocks]";

// Marks the tiles one pair of lists names as `kind`, checking counts and indices.
void mark_listed(std::vector<TileKind>& kinds, const torch::Tensor& counts,
                 const torch::Tensor& indices, TileKind kind, const char* counts_name,
                 const char* indices_name, int64_t nk) {
  const auto host_counts = counts.to(torch::kCPU, torch::kInt64).contiguous();
  const auto host_indices = indices.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t rows = host_counts.numel(), width = host_indices.size(3);
  const auto* count = host_counts.data_ptr<int64_t>();
  const auto* index = host_indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(count[r] >= 0 && count[r] <= nk, kFromListsFn, " ", counts_name, " must be in [0, ",
                nk, "] (the key blocks), got ", count[r], " at row ", r);
    for (int64_t i = 0; i < count[r]; ++i) {
      const int64_t j = index[r * width + i];
      TORCH_CHECK(j >= 0 && j < nk, kFromListsFn, " ", indices_name, " must be in [0, ", nk,
                  "), got ", j, " at row ", r);
      auto& slot = kinds[static_cast<size_t>(r * nk + j)];
      TORCH_CHECK(slot == TileKind::kEmpty, kFromListsFn, " key block ", j, " of row ", r,
                  " is listed twice (", indices_name, ")");
      slot = kind;
    }
  }
}

}  // namespace

BlockMask BlockMask::from_kv_blocks(const torch::Tensor& kv_num_blocks,
                                    const torch::Tensor& kv_indices,
                                    const torch::Tensor& full_kv_num_blocks,
                                    const torch::Tensor& full_kv_indices, int64_t q_len,
                                    int64_t kv_len, int64_t q_block_size, int64_t kv_block_size,
                                    const Mask& mask) {
  TORCH_CHECK(q_len >= 1 && kv_len >= 1, kFromListsFn, " q_len and kv_len must be >= 1, got q_len ",
              q_len, " and kv_len ", kv_len);
  TORCH_CHECK(q_block_size >= 1 && kv_block_size >= 1, kFromListsFn,
              " block sizes must be >= 1, got (", q_block_size, ", ", kv_block_size, ")");
  TORCH_CHECK(kv_num_blocks.defined() && kv_indices.defined(), kFromListsFn,
              " kv_num_blocks and kv_indices are required");
  TORCH_CHECK(full_kv_num_blocks.defined() == full_kv_indices.defined(), kFromListsFn,
              " full_kv_num_blocks and full_kv_indices come together (both or neither)");
  const int64_t nq = (q_len + q_block_size - 1) / q_block_size;
  const int64_t nk = (kv_len + kv_block_size - 1) / kv_block_size;
  TORCH_CHECK(kv_num_blocks.dim() == 3 && kv_num_blocks.size(2) == nq, kFromListsFn,
              " kv_num_blocks must be (B, H, ", nq, ") for q_len ", q_len, " in blocks of ",
              q_block_size, ", got ", shape_string(kv_num_blocks));
  const int64_t B = kv_num_blocks.size(0), H = kv_num_blocks.size(1);
  TORCH_CHECK(B >= 1 && H >= 1, kFromListsFn, " kv_num_blocks must have B and H >= 1, got ",
              shape_string(kv_num_blocks));
  const auto device = kv_num_blocks.device();
  const auto check_list = [&](const torch::Tensor& t, const char* name, bool is_indices) {
    TORCH_CHECK(t.scalar_type() == torch::kInt32 || t.scalar_type() == torch::kInt64, kFromListsFn,
                " ", name, " must be int32 or int64, got ", t.scalar_type());
    TORCH_CHECK(t.device() == device, kFromListsFn, " ", name, " is on ", t.device(),
                ", kv_num_blocks on ", device, ": the lists share one device");
    const bool fits = is_indices ? t.dim() == 4 && t.size(0) == B && t.size(1) == H &&
                                       t.size(2) == nq && t.size(3) >= nk
                                 : t.sizes() == kv_num_blocks.sizes();
    TORCH_CHECK(fits, kFromListsFn, " ", name, " must be ",
                is_indices ? c10::str("(", B, ", ", H, ", ", nq, ", >= ", nk, ")")
                           : shape_string(kv_num_blocks),
                " for kv_len ", kv_len, " in blocks of ", kv_block_size, ", got ", shape_string(t));
  };
  check_list(kv_num_blocks, "kv_num_blocks", false);
  check_list(kv_indices, "kv_indices", true);
  std::vector<TileKind> kinds(static_cast<size_t>(B * H * nq * nk), TileKind::kEmpty);
  mark_listed(kinds, kv_num_blocks, kv_indices, TileKind::kPartial, "kv_num_blocks", "kv_indices",
              nk);
  if (full_kv_num_blocks.defined()) {
    check_list(full_kv_num_blocks, "full_kv_num_blocks", false);
    check_list(full_kv_indices, "full_kv_indices", true);
    mark_listed(kinds, full_kv_num_blocks, full_kv_indices, TileKind::kFull, "full_kv_num_blocks",
                "full_kv_indices", nk);
  }
  mask.check(kFromListsFn, B, H, q_len, kv_len, device);

  // The lists again in FlexAttention's ordered form, at exactly num_kv_blocks columns.
  BlockMask result(mask, B, H, q_len, kv_len, q_block_size, kv_block_size, device);
  result.set_kinds(std::move(kinds));
  return result;
}

BlockMask::BlockMask(Mask mask, int64_t batch, int64_t heads, int64_t q_len, int64_t kv_len,
                     int64_t q_block_size, int64_t kv_block_size, const torch::Device& device)
    : mask_(std::move(mask)),
      batch_(batch),
      heads_(heads),
      q_len_(q_len),
      kv_len_(kv_len),
      q_block_size_(q_block_size),
      kv_block_size_(kv_block_size),
      device_(device) {}

void BlockMask::set_kinds(std::vector<TileKind> kinds) {
  const int64_t nq = num_q_blocks(), nk = num_kv_blocks();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(kinds.size()) == batch_ * heads_ * nq * nk,
                        "[BlockMask::set_kinds] expected one kind per tile, ",
                        batch_ * heads_ * nq * nk, ", got ", kinds.size());
  const int64_t rows = batch_ * heads_ * nq;
  auto partial = ordered_lists(kinds, TileKind::kPartial, rows, nk);
  auto full = ordered_lists(kinds, TileKind::kFull, rows, nk);
  kv_num_blocks_ = partial.first.view({batch_, heads_, nq}).to(device_);
  kv_indices_ = partial.second.view({batch_, heads_, nq, nk}).to(device_);
  full_kv_num_blocks_ = full.first.view({batch_, heads_, nq}).to(device_);
  full_kv_indices_ = full.second.view({batch_, heads_, nq, nk}).to(device_);
  kinds_ = std::make_shared<const std::vector<TileKind>>(std::move(kinds));
}

TileKind BlockMask::kind(int64_t batch, int64_t head, int64_t q_block, int64_t kv_block) const {
  const int64_t b = batch_ == 1 ? 0 : batch, h = heads_ == 1 ? 0 : head;
  return (*kinds_)[static_cast<size_t>(
      ((b * heads_ + h) * num_q_blocks() + q_block) * num_kv_blocks() + kv_block)];
}

double BlockMask::sparsity() const {
  TORCH_CHECK(defined(),
              "[BlockMask::sparsity] an empty BlockMask; make one with create_block_mask");
  const auto visited = std::count_if(kinds_->begin(), kinds_->end(),
                                     [](TileKind k) { return k != TileKind::kEmpty; });
  return 100.0 * (1.0 - static_cast<double>(visited) / static_cast<double>(kinds_->size()));
}

torch::Tensor BlockMask::to_dense() const {
  TORCH_CHECK(defined(),
              "[BlockMask::to_dense] an empty BlockMask; make one with create_block_mask");
  auto dense = torch::empty({batch_, heads_, num_q_blocks(), num_kv_blocks()}, torch::kBool);
  auto* out = dense.data_ptr<bool>();
  for (size_t i = 0; i < kinds_->size(); ++i)
    out[i] = (*kinds_)[i] != TileKind::kEmpty;
  return dense.to(device_);
}

std::string BlockMask::to_string() const {
  if (!defined())
    return "BlockMask(empty)";
  std::ostringstream out;
  out << "BlockMask(shape=(" << batch_ << ", " << heads_ << ", " << q_len_ << ", " << kv_len_
      << "), block_size=(" << q_block_size_ << ", " << kv_block_size_
      << "), sparsity=" << std::fixed << std::setprecision(2) << sparsity()
      << "%, mask=" << mask_.to_string() << ", device=" << device_ << ")";
  // A picture of batch 0, head 0 when it fits a screen.
  if (num_q_blocks() <= 32 && num_kv_blocks() <= 64) {
    for (int64_t i = 0; i < num_q_blocks(); ++i) {
      out << "\n  ";
      for (int64_t j = 0; j < num_kv_blocks(); ++j) {
        const auto k = kind(0, 0, i, j);
        out << (k == TileKind::kFull ? '#' : k == TileKind::kPartial ? '~' : '.');
      }
    }
  }
  return out.str();
}

void BlockMask::check(const char* fn, int64_t batch, int64_t heads, int64_t num_queries,
                      int64_t num_keys, const torch::Device& device) const {
  TORCH_CHECK(defined(), fn, " block_mask is an empty BlockMask; make one with create_block_mask");
  const bool fits = (batch_ == 1 || batch_ == batch) && (heads_ == 1 || heads_ == heads) &&
                    q_len_ == num_queries && kv_len_ == num_keys && device_ == device;
  TORCH_CHECK(fits, fn, " block_mask was made for (B, H, Q_LEN, KV_LEN) = (", batch_, ", ", heads_,
              ", ", q_len_, ", ", kv_len_, ") on ", device_,
              ", but the attention is (batch, heads, num_queries, num_keys) = (", batch, ", ",
              heads, ", ", num_queries, ", ", num_keys, ") on ", device,
              " (B and H of 1 serve any); make one for this shape with create_block_mask");
}

}  // namespace attnkit
