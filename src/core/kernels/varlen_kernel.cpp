// The variable-length route (kernels.h): attention whose mask falls apart into dense
// segments (key padding with a valid prefix, packed documents) packed as FlashAttention's
// varlen kernels take them, and unpacked: on CUDA one call of LibTorch's flash kernel per
// alignment (flash_varlen_attention), elsewhere one dense SDPA call per segment.

#include "core/kernels/varlen_kernel.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "core/kernels/sdpa_kernel.h"
#include "core/masks/mask_parts.h"

namespace attnkit::detail {

std::optional<VarlenLayout> varlen_layout(const Mask& mask, int64_t batch, int64_t n, int64_t m) {
  const auto parts = and_parts(mask);
  if (!parts)
    return std::nullopt;
  VarlenLayout layout;
  const MaskPart* padding = nullptr;
  const MaskPart* documents = nullptr;
  for (const auto& part : *parts) {
    switch (part.kind) {
      case MaskPart::Kind::kCausal:
        if (part.per_row || part.offset != 0 || part.window != 0 || layout.causal)
          return std::nullopt;
        layout.causal = true;
        break;
      case MaskPart::Kind::kKeyPadding:
        if (padding != nullptr)
          return std::nullopt;
        padding = &part;
        break;
      case MaskPart::Kind::kDocuments:
        if (documents != nullptr)
          return std::nullopt;
        documents = &part;
        break;
      case MaskPart::Kind::kOther:
        return std::nullopt;
    }
  }
  if ((padding == nullptr) == (documents == nullptr))
    return std::nullopt;
  // Masks that do not fit the problem are refused by Mask::check; here they only do not fall
  // apart.
  if (padding != nullptr) {
    if (static_cast<int64_t>(padding->valid_prefix.size()) != batch ||
        (padding->keys >= 0 && padding->keys != m)) {
      return std::nullopt;
    }
    for (int64_t r = 0; r < batch; ++r) {
      const int64_t valid = padding->valid_prefix[r];
      if (valid < 0 || valid > m)
        return std::nullopt;
      layout.segments.push_back({r, 0, n, 0, valid});
    }
    return layout;
  }
  if (documents->id_length != n || (documents->id_rows != 0 && documents->id_rows != batch) ||
      n != m) {
    return std::nullopt;
  }
  for (int64_t r = 0; r < batch; ++r) {
    const auto* ids = documents->ids + (documents->id_rows == 0 ? 0 : r * n);
    std::vector<int64_t> seen;  // each run's id: a document met again is not one run
    for (int64_t begin = 0; begin < n;) {
      int64_t end = begin + 1;
      while (end < n && ids[end] == ids[begin])
        ++end;
      if (std::find(seen.begin(), seen.end(), ids[begin]) != seen.end())
        return std::nullopt;
      seen.push_back(ids[begin]);
      layout.segments.push_back({r, begin, end, begin, end});
      begin = end;
    }
  }
  layout.documents = true;
  return layout;
}

namespace {

// (b, heads, tokens, d) -> (b * tokens, heads, d), a token per row (a view where x is the
// head view of a (b, tokens, heads * d) projection), then the rows `index` (undefined: all).
torch::Tensor packed_rows(const torch::Tensor& x, const torch::Tensor& index) {
  const auto rows = x.transpose(1, 2).reshape({-1, x.size(1), x.size(3)});
  return index.defined() ? rows.index_select(0, index) : rows;
}

// Whether `rows` is 0, 1, ..., total - 1: the segments take every token in order (documents
// that cover the batch, queries of key padding), so packing needs no gather.
bool every_row_in_order(const std::vector<int64_t>& rows, int64_t total) {
  if (static_cast<int64_t>(rows.size()) != total)
    return false;
  for (int64_t i = 0; i < total; ++i) {
    if (rows[static_cast<size_t>(i)] != i)
      return false;
  }
  return true;
}

// Rows [begin, end) of a packed (total, heads, d) buffer as one (1, heads, end - begin, d)
// sequence.
torch::Tensor as_sequence(const torch::Tensor& packed, int64_t begin, int64_t end) {
  return packed.slice(0, begin, end).transpose(0, 1).unsqueeze(0);
}

}  // namespace

PackedVarlen pack_varlen(const torch::Tensor& query, const torch::Tensor& key,
                         const torch::Tensor& value, const VarlenLayout& layout) {
  const int64_t n = query.size(2), m = key.size(2);
  PackedVarlen packed;
  packed.cu_q.push_back(0);
  packed.cu_k.push_back(0);
  std::vector<int64_t> query_rows, key_rows;
  for (const auto& s : layout.segments) {
    for (int64_t i = s.q_begin; i < s.q_end; ++i)
      query_rows.push_back(s.batch * n + i);
    for (int64_t j = s.k_begin; j < s.k_end; ++j)
      key_rows.push_back(s.batch * m + j);
    packed.cu_q.push_back(static_cast<int64_t>(query_rows.size()));
    packed.cu_k.push_back(static_cast<int64_t>(key_rows.size()));
  }
  // Row indices only where a gather is needed; with the offsets in one host-to-device copy
  // (each such copy waits for the GPU's queue), then views of its parts.
  const bool all_queries = every_row_in_order(query_rows, query.size(0) * n);
  const bool all_keys = every_row_in_order(key_rows, key.size(0) * m);
  std::vector<int64_t> host;
  for (const auto* part : {all_queries ? nullptr : &query_rows, all_keys ? nullptr : &key_rows,
                           &packed.cu_q, &packed.cu_k}) {
    if (part != nullptr)
      host.insert(host.end(), part->begin(), part->end());
  }
  const auto on_device = torch::tensor(host, torch::kInt64).to(query.device());
  int64_t begin = 0;
  const auto next = [&](const std::vector<int64_t>& part) {
    const auto length = static_cast<int64_t>(part.size());
    begin += length;
    return on_device.narrow(0, begin - length, length);
  };
  if (!all_queries)
    packed.query_index = next(query_rows);
  const auto key_index = all_keys ? torch::Tensor() : next(key_rows);  // undefined: all
  packed.cu_q_on_device = next(packed.cu_q);
  packed.cu_k_on_device = next(packed.cu_k);
  packed.query = packed_rows(query, packed.query_index);
  packed.key = packed_rows(key, key_index);
  packed.value = packed_rows(value, key_index);
  return packed;
}

torch::Tensor unpack_varlen(const torch::Tensor& packed, const torch::Tensor& query_index,
                            int64_t batch, int64_t n) {
  const int64_t heads = packed.size(1), d = packed.size(2);
  const auto rows =
      query_index.defined()
          ? torch::zeros({batch * n, heads, d}, packed.options()).index_copy(0, query_index, packed)
          : packed;
  // (b * n, h, d) -> (b, n, h, d) -> (b, h, n, d)
  return rows.reshape({batch, n, heads, d}).transpose(1, 2);
}

torch::Tensor sdpa_varlen_attention(const torch::Tensor& query, const torch::Tensor& key,
                                    const torch::Tensor& value, const VarlenLayout& layout,
                                    double dropout_p) {
  const auto packed = pack_varlen(query, key, value, layout);
  const int64_t heads = query.size(1), value_dim = value.size(3);
  std::vector<torch::Tensor> outputs;  // each (segment's queries, h, hd_v)
  for (size_t i = 0; i + 1 < packed.cu_q.size(); ++i) {
    const int64_t q0 = packed.cu_q[i], q1 = packed.cu_q[i + 1];
    const int64_t k0 = packed.cu_k[i], k1 = packed.cu_k[i + 1];
    if (q0 == q1)
      continue;
    if (k0 == k1) {  // no key to see
      outputs.push_back(torch::zeros({q1 - q0, heads, value_dim}, query.options()));
      continue;
    }
    const auto out =
        sdpa_attention(as_sequence(packed.query, q0, q1), as_sequence(packed.key, k0, k1),
                       as_sequence(packed.value, k0, k1),
                       {CausalSpan{layout.causal, /*query_offset=*/0, /*window=*/0}, dropout_p});
    outputs.push_back(out.squeeze(0).transpose(0, 1));  // (1, h, len, hd_v) -> (len, h, hd_v)
  }
  const auto all = outputs.empty() ? torch::zeros({0, heads, value_dim}, query.options())
                                   : torch::cat(outputs, 0);
  return unpack_varlen(all, packed.query_index, query.size(0), query.size(2));
}

std::vector<VarlenLayout> bottom_right_parts(const VarlenLayout& layout) {
  VarlenLayout causal_part{{}, true}, full_part{{}, false};
  for (const auto& s : layout.segments) {
    const int64_t q_len = s.q_end - s.q_begin, k_len = s.k_end - s.k_begin;
    if (q_len == 0 || k_len == 0)
      continue;
    if (!layout.causal) {
      full_part.segments.push_back(s);
      continue;
    }
    // Query q_begin + t sees keys up to k_begin + t: the square part aligns both ways.
    const int64_t square = std::min(q_len, k_len);
    causal_part.segments.push_back(
        {s.batch, s.q_begin, s.q_begin + square, s.k_begin, s.k_begin + square});
    if (q_len > k_len)
      full_part.segments.push_back({s.batch, s.q_begin + k_len, s.q_end, s.k_begin, s.k_end});
  }
  std::vector<VarlenLayout> parts;
  for (auto* part : {&causal_part, &full_part}) {
    if (!part->segments.empty())
      parts.push_back(std::move(*part));
  }
  return parts;
}

torch::Tensor run_bottom_right_parts(const torch::Tensor& query, const torch::Tensor& key,
                                     const torch::Tensor& value, const VarlenLayout& layout,
                                     const VarlenPartKernel& run_part) {
  std::vector<torch::Tensor> outputs, query_index;
  for (const auto& part : bottom_right_parts(layout)) {
    const auto packed = pack_varlen(query, key, value, part);
    outputs.push_back(run_part(packed, part.causal));
    query_index.push_back(packed.query_index);
  }
  if (outputs.empty()) {
    return torch::zeros({query.size(0), query.size(1), query.size(2), value.size(3)},
                        query.options());
  }
  // An undefined index (every query in order) comes only from a part that has all the queries.
  if (outputs.size() == 1)
    return unpack_varlen(outputs.front(), query_index.front(), query.size(0), query.size(2));
  return unpack_varlen(torch::cat(outputs, 0), torch::cat(query_index), query.size(0),
                       query.size(2));
}

torch::Tensor flash_varlen_attention(const torch::Tensor& query, const torch::Tensor& key,
                                     const torch::Tensor& value, const VarlenLayout& layout,
                                     double scale, double dropout_p) {
  const auto run_part = [&](const PackedVarlen& packed, bool causal) {
    const auto longest = [](const std::vector<int64_t>& cu) {
      int64_t most = 0;
      for (size_t i = 0; i + 1 < cu.size(); ++i)
        most = std::max(most, cu[i + 1] - cu[i]);
      return most;
    };
    FlashSegments segments;
    segments.cu_q = packed.cu_q_on_device.to(torch::kInt32);  // on the device: no copy
    segments.cu_k = packed.cu_k_on_device.to(torch::kInt32);
    segments.max_q = longest(packed.cu_q);
    segments.max_k = longest(packed.cu_k);
    return flash_attention(packed.query, packed.key, packed.value, segments,
                           {CausalSpan{causal, /*query_offset=*/0, /*window=*/0}, dropout_p},
                           scale);
  };
  return run_bottom_right_parts(query, key, value, layout, run_part);
}

// The variable-length SDPA route's spec.

namespace {

// Why the route declines `input`; `layout` gets the call's segments once it has them.
// Causal documents up to this mean length run faster by segment than on the fused tile
// kernel, which computes whole 128-token tiles around the diagonal (docs/backends.md).
constexpr int64_t kLongestCausalDocument = 256;

double mean_segment_queries(const VarlenLayout& layout) {
  int64_t queries = 0;
  for (const auto& segment : layout.segments)
    queries += segment.q_end - segment.q_begin;
  return layout.segments.empty() ? 0.0 : static_cast<double>(queries) / layout.segments.size();
}

std::string sdpa_varlen_declines(const KernelInput& input, std::optional<VarlenLayout>& layout) {
  const auto& call = input.call;
  if (!libtorch_has_sdpa())
    return "LibTorch 1.x has no SDPA to run variable-length segments on";
  if (call.options.score_mod())
    return "the variable-length route has no score functions (score_mod)";
  if (call.step != StepKind::kSequence)
    return "the variable-length route serves whole sequences";
  auto why = sdpa_routes_decline(input);
  if (!why.empty())
    return why;
  // One SDPA call per segment. Where kFused is only preferred (kAuto, the modules), the route
  // runs where it was measured ahead of the tile kernels: on the CPU, with no gradient to
  // keep, not causal (docs/benchmarks.md: MiniLM's packed sentences 1.2x faster end to end;
  // key padding level), or causal documents of at most kLongestCausalDocument tokens on
  // average (docs/backends.md: 1.35-3.6x the fused tile kernel's forward; level at 512).
  // Forward+backward it is slower; on CUDA it is unmeasured against the masked route.
  // Checked before the layout, whose host work the other calls are spared.
  const bool demanded =
      !call.backend_is_preference && call.options.backend() == AttentionBackend::kFused;
  const bool keeps_no_gradient =
      !torch::GradMode::is_enabled() ||
      !(call.query.requires_grad() || call.key.requires_grad() || call.value.requires_grad());
  if (!demanded && !(call.query.is_cpu() && keeps_no_gradient)) {
    return "the variable-length route runs where kFused is demanded, or on the CPU with no "
           "gradient to keep";
  }
  layout =
      varlen_layout(input.mask(), call.query.size(0), input.query_tokens(), input.key_tokens());
  if (!layout) {
    return c10::str(
        "the variable-length route takes key padding (valid keys first) or documents (each "
        "one run of tokens), alone or with causal(), not ",
        input.mask().to_string());
  }
  if (!demanded && layout->causal &&
      !(layout->documents && mean_segment_queries(*layout) <= kLongestCausalDocument)) {
    return c10::str(
        "the variable-length route runs causal segments only where kFused is demanded, or for "
        "documents of at most ",
        kLongestCausalDocument, " tokens on average");
  }
  return libtorch_cpu_nan_declines(input);  // last: it reads the query and key
}

}  // namespace

KernelSpec sdpa_varlen_spec() {
  return {
      "sdpa_varlen", AttentionBackend::kFused, /*runs_16bit_cuda_in_its_dtype=*/libtorch_has_sdpa(),
      [](const KernelInput& input) {
        std::optional<VarlenLayout> layout;
        auto why = sdpa_varlen_declines(input, layout);
        return KernelDecision{
            std::move(why), [layout = layout.value_or(VarlenLayout{})](const KernelInput& in) {
              const auto& call = in.call;
              return functional::AttentionOutput{
                  sdpa_varlen_attention(call.query, call.key, call.value, layout, in.dropout_p()),
                  {}};
            }};
      }};
}

}  // namespace attnkit::detail
