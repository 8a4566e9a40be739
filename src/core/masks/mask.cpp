// attnkit::Mask: a tree of mask kinds (mask_kinds.h) combined by & and |: its factories, its
// structure as the kernels read it (and_parts), and its questions asked of the tree.

#include "attnkit/mask.h"

#include "attnkit/block_mask.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "core/base/checks.h"
#include "core/masks/mask_kinds.h"
#include "core/masks/mask_node.h"
#include "core/masks/mask_parts.h"

namespace attnkit {

namespace detail {

namespace {

// The parts of `node` joined by `&` (itself when it is not an `&`); false on a `|`.
bool collect_and_parts(const MaskNode* node, std::vector<const MaskNode*>& parts) {
  const auto* combined = dynamic_cast<const CombinedNode*>(node);
  if (combined == nullptr) {
    parts.push_back(node);
    return true;
  }
  return combined->is_and && collect_and_parts(combined->left.get(), parts) &&
         collect_and_parts(combined->right.get(), parts);
}

MaskPart part_of(const MaskNode* node) {
  MaskPart part;
  if (const auto* causal = dynamic_cast<const CausalNode*>(node)) {
    part.kind = MaskPart::Kind::kCausal;
    part.offset = causal->offset;
    part.window = causal->window;
    part.per_row = causal->per_row();
  } else if (const auto* padding = dynamic_cast<const KeyPaddingNode*>(node)) {
    part.kind = MaskPart::Kind::kKeyPadding;
    if (padding->lengths.defined()) {
      part.valid_prefix = padding->lengths_cpu;
    } else {
      const int64_t rows = padding->padding.size(0), m = padding->padding.size(1);
      part.keys = m;
      for (int64_t r = 0; r < rows; ++r) {
        // counts[j]: valid keys among the first j; a prefix when the first `valid` are valid.
        const auto* counts = padding->counts_cpu.data() + r * (m + 1);
        const int64_t valid = counts[m];
        part.valid_prefix.push_back(counts[valid] == valid ? valid : -1);
      }
    }
  } else if (const auto* documents = dynamic_cast<const DocumentsNode*>(node)) {
    part.kind = MaskPart::Kind::kDocuments;
    part.ids = documents->host.data();
    part.id_rows = documents->ids.dim() == 1 ? 0 : documents->ids.size(0);
    part.id_length = documents->ids.size(-1);
  }
  return part;
}

}  // namespace

std::optional<std::vector<MaskPart>> and_parts(const Mask& mask) {
  std::vector<const MaskNode*> nodes;
  if (mask.is_none() || !collect_and_parts(MaskAccess::node(mask), nodes))
    return std::nullopt;
  std::vector<MaskPart> parts;
  for (const auto* node : nodes)
    parts.push_back(part_of(node));
  return parts;
}

bool fill_tile(const Mask& mask, const Tile& tile, bool* out) {
  if (mask.is_none()) {
    std::fill(out, out + tile.queries * tile.keys, true);
    return true;
  }
  return tile.heads == 1 && MaskAccess::node(mask)->fill_tile(tile, out);
}

}  // namespace detail

using detail::shape_string;

Mask::Mask() = default;

Mask Mask::causal(int64_t query_offset) {
  TORCH_CHECK(query_offset >= 0, "[Mask::causal] query_offset must be >= 0 (the key position of ",
              "query 0), got ", query_offset);
  return Mask(std::make_shared<detail::CausalNode>(query_offset, 0));
}

Mask Mask::causal(const torch::Tensor& query_offsets) {
  TORCH_CHECK(query_offsets.defined() && query_offsets.dim() == 1 &&
                  query_offsets.scalar_type() == torch::kInt64,
              "[Mask::causal] query_offsets must be a (b) int64 tensor, got ",
              query_offsets.defined()
                  ? c10::str(shape_string(query_offsets), " ", query_offsets.scalar_type())
                  : std::string("an undefined tensor"));
  auto node = std::make_shared<detail::CausalNode>(0, 0);
  node->offsets = query_offsets;
  const auto host = query_offsets.to(torch::kCPU).contiguous();
  node->offsets_cpu.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  for (size_t i = 0; i < node->offsets_cpu.size(); ++i) {
    TORCH_CHECK(node->offsets_cpu[i] >= 0, "[Mask::causal] query_offsets[", i,
                "] must be >= 0, got ", node->offsets_cpu[i]);
  }
  return Mask(std::move(node));
}

Mask Mask::sliding_window(int64_t window_size) const {
  TORCH_CHECK(window_size >= 1, "[Mask::sliding_window] window_size must be >= 1, got ",
              window_size);
  if (const auto* causal = dynamic_cast<const detail::CausalNode*>(node_.get())) {
    return Mask(std::make_shared<detail::CausalNode>(*causal, window_size));
  }
  const auto* combined = dynamic_cast<const detail::CombinedNode*>(node_.get());
  const auto* right = combined == nullptr
                          ? nullptr
                          : dynamic_cast<const detail::CausalNode*>(combined->right.get());
  TORCH_CHECK(combined != nullptr && combined->is_and && right != nullptr,
              "[Mask::sliding_window] a sliding window restricts a causal mask: call it on "
              "Mask::causal(...) or Mask::documents(ids, true), not on ",
              to_string());
  return Mask(std::make_shared<detail::CombinedNode>(
      combined->left, std::make_shared<detail::CausalNode>(*right, window_size), true));
}

Mask Mask::region(int64_t query_start, int64_t key_start, int64_t num_queries,
                  int64_t num_keys) const {
  TORCH_CHECK(
      query_start >= 0 && query_start < num_queries && key_start >= 0 && key_start < num_keys,
      "[Mask::region] query_start must be in [0, num_queries) and key_start in [0, "
      "num_keys), got query_start ",
      query_start, " of ", num_queries, " and key_start ", key_start, " of ", num_keys);
  if (is_none())
    return *this;
  // A causal mask's region is a causal mask, which every causal kernel takes.
  const auto* causal = dynamic_cast<const detail::CausalNode*>(node_.get());
  if (causal != nullptr && !causal->per_row() && causal->offset + query_start - key_start >= 0) {
    return Mask(std::make_shared<detail::CausalNode>(causal->offset + query_start - key_start,
                                                     causal->window));
  }
  return Mask(std::make_shared<detail::RegionNode>(node_, std::vector<int64_t>{query_start},
                                                   std::vector<int64_t>{key_start}, num_queries,
                                                   num_keys));
}

namespace detail {

std::pair<int64_t, int64_t> positions_problem(const Mask& mask, int64_t positions) {
  const auto* node = MaskAccess::node(mask);
  const auto extent = node != nullptr ? node->extent() : MaskExtent{};
  return {std::max(positions, extent.queries), std::max(positions, extent.keys)};
}

Mask mask_at_positions(const Mask& mask, std::vector<int64_t> query_starts,
                       std::vector<int64_t> key_starts, int64_t num_positions, bool ragged) {
  if (mask.is_none())
    return mask;
  const auto [queries, keys] = positions_problem(mask, num_positions);
  return MaskAccess::make(
      std::make_shared<RegionNode>(MaskAccess::node_pointer(mask), std::move(query_starts),
                                   std::move(key_starts), queries, keys, ragged));
}

}  // namespace detail

Mask Mask::key_padding(const torch::Tensor& padding_or_lengths) {
  const auto& t = padding_or_lengths;
  TORCH_CHECK(t.defined(), "[Mask::key_padding] expected a (b, m) bool tensor (true = padding) ",
              "or (b) int64 lengths, got an undefined tensor");
  auto node = std::make_shared<detail::KeyPaddingNode>();
  if (t.scalar_type() == torch::kBool) {
    TORCH_CHECK(t.dim() == 2, "[Mask::key_padding] a bool padding mask must be 2-D (b, m), ",
                "true = padding; got shape ", shape_string(t));
    node->padding = t;
    node->form = "padding";
    // Prefix sums of valid keys per row, (B, m + 1), for the tiles' verdicts.
    const auto valid = t.logical_not().to(torch::kCPU, torch::kInt64);
    const auto counts =
        torch::cat({torch::zeros({t.size(0), 1}, torch::kInt64), valid.cumsum(1)}, 1).contiguous();
    node->counts_cpu.assign(counts.data_ptr<int64_t>(),
                            counts.data_ptr<int64_t>() + counts.numel());
  } else {
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.dim() == 1,
                "[Mask::key_padding] lengths must be a 1-D int64 tensor (b), got ", t.dim(), "-D ",
                t.scalar_type(), " with shape ", shape_string(t),
                " (a padding mask must be bool (b, m), true = padding)");
    const auto host = t.to(torch::kCPU).contiguous();
    node->lengths_cpu.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
    for (size_t i = 0; i < node->lengths_cpu.size(); ++i) {
      TORCH_CHECK(node->lengths_cpu[i] >= 0, "[Mask::key_padding] lengths must be >= 0, got ",
                  node->lengths_cpu[i], " at batch entry ", i);
    }
    node->lengths = t;
    node->form = "lengths";
  }
  return Mask(std::move(node));
}

Mask Mask::documents(const torch::Tensor& document_ids, bool causal) {
  const auto& ids = document_ids;
  TORCH_CHECK(
      ids.defined() && ids.scalar_type() == torch::kInt64 && (ids.dim() == 1 || ids.dim() == 2),
      "[Mask::documents] document_ids must be an int64 tensor (n) or (b, n), got ",
      ids.defined()
          ? c10::str(ids.dim(), "-D ", ids.scalar_type(), " with shape ", shape_string(ids))
          : std::string("an undefined tensor"));
  TORCH_CHECK(ids.size(-1) >= 1, "[Mask::documents] document_ids must hold at least one token");
  auto node = std::make_shared<detail::DocumentsNode>();
  node->ids = ids;
  const auto host = ids.to(torch::kCPU).contiguous();
  node->host.assign(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  Mask mask(std::move(node));
  return causal ? mask & Mask::causal() : mask;
}

Mask Mask::from_tensor(const torch::Tensor& allowed) {
  TORCH_CHECK(allowed.defined() && allowed.scalar_type() == torch::kBool,
              "[Mask::from_tensor] allowed must be a bool tensor (true = may attend), got ",
              allowed.defined() ? c10::toString(allowed.scalar_type()) : "an undefined tensor");
  TORCH_CHECK(allowed.dim() >= 2 && allowed.dim() <= 4,
              "[Mask::from_tensor] allowed must be 2-D to 4-D, broadcastable to (b, h, n, m), "
              "got shape ",
              shape_string(allowed));
  auto node = std::make_shared<detail::TensorNode>();
  auto t4 = allowed;
  while (t4.dim() < 4)
    t4 = t4.unsqueeze(0);
  node->allowed4 = t4;
  return Mask(std::move(node));
}

Mask Mask::from_function(MaskMod mask_mod) {
  TORCH_CHECK(static_cast<bool>(mask_mod), "[Mask::from_function] mask_mod is empty");
  auto node = std::make_shared<detail::FunctionNode>();
  node->mask_mod = std::move(mask_mod);
  return Mask(std::move(node));
}

Mask Mask::from_block_mask(const BlockMask& block_mask) {
  TORCH_CHECK(block_mask.defined(),
              "[Mask::from_block_mask] an empty BlockMask; make one with create_block_mask");
  return Mask(std::make_shared<detail::BlockMaskNode>(block_mask));
}

const BlockMask* Mask::block_mask() const {
  const auto* node = dynamic_cast<const detail::BlockMaskNode*>(node_.get());
  return node == nullptr ? nullptr : &node->blocks;
}

Mask Mask::operator&(const Mask& other) const {
  if (is_none())
    return other;
  if (other.is_none())
    return *this;
  return Mask(std::make_shared<detail::CombinedNode>(node_, other.node_, true));
}

Mask Mask::operator|(const Mask& other) const {
  if (is_none() || other.is_none())
    return Mask();
  return Mask(std::make_shared<detail::CombinedNode>(node_, other.node_, false));
}

bool Mask::is_causal(int64_t* query_offset, int64_t* window_size) const {
  const auto* causal = dynamic_cast<const detail::CausalNode*>(node_.get());
  if (causal == nullptr || causal->per_row())  // one offset for every row only
    return false;
  if (query_offset != nullptr)
    *query_offset = causal->offset;
  if (window_size != nullptr)
    *window_size = causal->window;
  return true;
}

std::string Mask::to_string() const {
  return is_none() ? "none" : node_->to_string();
}

void Mask::check(const char* fn, int64_t batch, int64_t heads, int64_t num_queries,
                 int64_t num_keys, const torch::Device& device) const {
  if (!is_none())
    node_->check(fn, batch, heads, num_queries, num_keys, device);
}

torch::Tensor Mask::allowed(const torch::Tensor& b, const torch::Tensor& h,
                            const torch::Tensor& q_idx, const torch::Tensor& kv_idx) const {
  if (is_none()) {
    return torch::ones({1, 1, 1, 1}, torch::dtype(torch::kBool).device(q_idx.device()));
  }
  return node_->allowed({b, h, q_idx, kv_idx});
}

torch::Tensor Mask::dense(int64_t batch, int64_t heads, int64_t num_queries, int64_t num_keys,
                          const torch::Device& device) const {
  const auto index = torch::dtype(torch::kInt64).device(device);
  const auto full = allowed(torch::arange(batch, index).view({-1, 1, 1, 1}),
                            torch::arange(heads, index).view({1, -1, 1, 1}),
                            torch::arange(num_queries, index).view({1, 1, -1, 1}),
                            torch::arange(num_keys, index).view({1, 1, 1, -1}));
  // Keep broadcast dimensions of batch and heads; spell out queries and keys.
  auto shape = full.sizes().vec();
  while (shape.size() < 4)
    shape.insert(shape.begin(), 1);
  return full.reshape(shape).expand({shape[0], shape[1], num_queries, num_keys});
}

c10::optional<TileKind> Mask::structural_kind(const Tile& tile) const {
  return is_none() ? c10::optional<TileKind>(TileKind::kFull) : node_->kind(tile);
}

torch::Tensor Mask::tile_allowed(const Tile& tile, const torch::Device& device) const {
  if (is_none())
    return torch::ones({1, 1, 1}, torch::dtype(torch::kBool).device(device));
  auto allowed = node_->tile_allowed(tile, device);
  while (allowed.dim() < 4)
    allowed = allowed.unsqueeze(0);
  return allowed.select(0, 0);  // (heads or 1, queries or 1, keys or 1): one batch entry
}

TileMask Mask::tile(const Tile& tile, const torch::Device& device) const {
  const auto known = structural_kind(tile);
  if (known.has_value() && *known != TileKind::kPartial)
    return {*known, {}};
  const auto allowed = tile_allowed(tile, device);
  if (!known.has_value()) {
    // A mask without structure (a tensor, a mask_mod) is judged by its entries.
    if (!allowed.any().item<bool>())
      return {TileKind::kEmpty, {}};
    if (allowed.all().item<bool>())
      return {TileKind::kFull, {}};
  }
  return {TileKind::kPartial, allowed};
}

}  // namespace attnkit
