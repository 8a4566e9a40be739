// The fused decode step: one query token per row against its cached keys, every head in one
// loop, reading the cache in place. Why: at toy sizes a decode step's cost is its operator
// count, and the general path spends a dozen ops per layer (masks, head splits, the math
// core's score, softmax and product, the merge) on arithmetic that takes a few microseconds.

#include "core/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/checks.h"
#include "core/kernels.h"
#include "core/parallel.h"
#include "core/row_softmax.h"
#include "core/score_variants.h"

namespace attnkit::detail {

namespace {

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// scores[0, 8) = q . keys[t * key_stride] for 8 key rows of width hd, the eight sums reduced
// together (one dot at a time paid a whole horizontal sum per key: most of the step at head
// widths of 16).
__attribute__((target("avx2,fma"))) void eight_dots_avx2(const float* q, const float* keys,
                                                         int64_t key_stride, int64_t hd,
                                                         float* scores) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t)
    acc[t] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + kLanes <= hd; d += kLanes) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t)
      acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + t * key_stride + d), acc[t]);
  }
  if (d < hd) {
    const __m256i lanes = first_lanes(hd - d);
    const __m256 qv = _mm256_maskload_ps(q + d, lanes);
    for (int t = 0; t < 8; ++t)
      acc[t] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(keys + t * key_stride + d, lanes), acc[t]);
  }
  _mm256_storeu_ps(scores, horizontal_sums_of_eight(acc));
}
#endif

// scores[j] = q . keys[j * key_stride] for j in [begin, end).
template <typename scalar_t>
void key_dots(const scalar_t* q, const scalar_t* keys, int64_t key_stride, int64_t hd,
              int64_t begin, int64_t end, scalar_t* scores) {
  int64_t j = begin;
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (has_avx2_fma()) {
      for (; j + 8 <= end; j += 8)
        eight_dots_avx2(q, keys + j * key_stride, key_stride, hd, scores + j);
    }
  }
#endif
  for (; j < end; ++j)
    scores[j] = dot(q, keys + j * key_stride, hd);
}

template <typename scalar_t>
void decode_rows(const torch::Tensor& query, const torch::Tensor& keys, const torch::Tensor& values,
                 double scale, const std::vector<int64_t>& key_begin,
                 const std::vector<int64_t>& key_end, double softcap,
                 const std::vector<double>& sinks, torch::Tensor& out) {
  const int64_t b = query.size(0), h = query.size(1), hd = query.size(3);
  const int64_t kv_heads = keys.size(1), m = keys.size(2), hd_v = values.size(3);
  const int64_t group_size = h / kv_heads;
  const auto* q = query.data_ptr<scalar_t>();
  const auto* k = keys.data_ptr<scalar_t>();
  const auto* v = values.data_ptr<scalar_t>();
  auto* o = out.data_ptr<scalar_t>();  // (b, 1, h, hd_v) contiguous
  const auto qs = query.strides(), ks = keys.strides(), vs = values.strides();
  // Enough keys per task that a thread's share is worth waking it for.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, m * (hd + hd_v)));
  at::parallel_for(0, b * h, grain, [&](int64_t first, int64_t last) {
    std::vector<scalar_t> weights(static_cast<size_t>(m));
    for (int64_t task = first; task < last; ++task) {
      const int64_t row = task / h, head = task % h, kv_head = head / group_size;
      const int64_t begin = key_begin.empty() ? 0 : key_begin[row];
      const int64_t end = key_end.empty() ? m : key_end[row];
      const scalar_t* q_row = q + row * qs[0] + head * qs[1];
      const scalar_t* k_head = k + row * ks[0] + kv_head * ks[1];
      const scalar_t* v_head = v + row * vs[0] + kv_head * vs[1];
      scalar_t* context = o + (row * h + head) * hd_v;
      // A row that sees no key gets zero weights, as in the math core: a zero context.
      std::fill(context, context + hd_v, scalar_t(0));
      if (end <= begin)
        continue;
      scalar_t* p = weights.data() + begin;
      key_dots(q_row, k_head, ks[2], hd, begin, end, weights.data());
      if (!sinks.empty()) {  // the scores (capped), and the head's sink in the denominator
        const auto sink = static_cast<scalar_t>(sinks[head]);
        scalar_t top = sink;
        for (int64_t j = 0; j < end - begin; ++j) {
          p[j] *= static_cast<scalar_t>(scale);
          if (softcap > 0.0)
            p[j] =
                static_cast<scalar_t>(softcap) * std::tanh(p[j] / static_cast<scalar_t>(softcap));
          top = std::max(top, p[j]);
        }
        scalar_t total = std::exp(sink - top);
        for (int64_t j = 0; j < end - begin; ++j) {
          p[j] = std::exp(p[j] - top);
          total += p[j];
        }
        for (int64_t j = 0; j < end - begin; ++j)
          p[j] /= total;
      } else if (softcap > 0.0) {  // the scores capped, then a softmax of scale 1
        const auto cap = static_cast<scalar_t>(softcap);
        const auto scale_over_cap = static_cast<scalar_t>(scale / softcap);
        for (int64_t j = 0; j < end - begin; ++j)
          p[j] = cap * std::tanh(p[j] * scale_over_cap);
        softmax_row(p, end - begin, scalar_t(1), p);
      } else {
        softmax_row(p, end - begin, static_cast<scalar_t>(scale), p);
      }
      for (int64_t j = begin; j < end; ++j) {
        const scalar_t* value = v_head + j * vs[2];
        const scalar_t weight = weights[j];
        for (int64_t d = 0; d < hd_v; ++d)
          context[d] += weight * value[d];
      }
    }
  });
}

}  // namespace

bool decode_attention_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values) {
  const auto dtype = query.scalar_type();
  return query.device().is_cpu() && query.dim() == 4 && query.size(2) == 1 &&
         (dtype == torch::kFloat || dtype == torch::kDouble) && keys.scalar_type() == dtype &&
         values.scalar_type() == dtype && keys.device().is_cpu() && values.device().is_cpu() &&
         query.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 &&
         keys.size(1) >= 1 && query.size(1) % keys.size(1) == 0 &&
         !(torch::GradMode::is_enabled() &&
           (query.requires_grad() || keys.requires_grad() || values.requires_grad()));
}

torch::Tensor decode_attention(const torch::Tensor& query, const torch::Tensor& keys,
                               const torch::Tensor& values, double scale,
                               const std::vector<int64_t>& key_begin,
                               const std::vector<int64_t>& key_end, double softcap,
                               const torch::Tensor& sinks) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap),
              "[decode_attention] softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(decode_attention_fits(query, keys, values),
              "[decode_attention] expected one CPU float or double query per row, last "
              "dimensions contiguous, heads a multiple of the key heads and no autograd; got "
              "query ",
              query.sizes(), " ", query.scalar_type(), " on ", query.device(), ", keys ",
              keys.sizes());
  const int64_t b = query.size(0), h = query.size(1), m = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && values.size(0) == b && values.size(1) == keys.size(1) &&
                  values.size(2) == m && keys.size(3) == query.size(3),
              "[decode_attention] keys and values must be (", b, ", kv_heads, m, ", query.size(3),
              ") and (", b, ", kv_heads, m, hd_v), got ", keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(key_begin.size() == key_end.size() &&
                  (key_begin.empty() || static_cast<int64_t>(key_begin.size()) == b),
              "[decode_attention] key_begin and key_end must both be empty or have ", b,
              " entries, got ", key_begin.size(), " and ", key_end.size());
  for (size_t r = 0; r < key_begin.size(); ++r) {
    TORCH_CHECK(0 <= key_begin[r] && key_end[r] <= m, "[decode_attention] row ", r, ": keys [",
                key_begin[r], ", ", key_end[r], ") must lie in [0, ", m, "]");
  }
  TORCH_CHECK(!sinks.defined() || (sinks.dim() == 1 && sinks.size(0) == h),
              "[decode_attention] sinks must be (", h, "), one per query head, got ",
              sinks.defined() ? shape_string(sinks) : std::string());
  std::vector<double> sink_values;
  if (sinks.defined()) {
    const auto host = sinks.detach().to(torch::kCPU, torch::kDouble).contiguous();
    sink_values.assign(host.data_ptr<double>(), host.data_ptr<double>() + h);
  }
  // (b, 1, h, hd_v) memory, returned as (b, h, 1, hd_v): merging the heads is then a view.
  auto out = torch::empty({b, 1, h, values.size(3)}, query.options());
  AT_DISPATCH_FLOATING_TYPES(query.scalar_type(), "decode_attention", [&] {
    decode_rows<scalar_t>(query, keys, values, scale, key_begin, key_end, softcap, sink_values,
                          out);
  });
  return out.transpose(1, 2);
}

// The decode kernel's spec.

namespace {

std::string decode_declines(const KernelInput& input) {
  const auto& call = input.call;
  if (call.step == StepKind::kSequence)
    return "the decode kernel serves cached steps only";
  if (input.query_tokens() != 1)
    return c10::str("the decode kernel takes one query per row, not ", input.query_tokens());
  if (call.options.score_mod() && !call.options.score_mod().target<SoftcapScore>())
    return "the decode kernel has no score functions but a softcap (score_mod)";
  // A ragged step's own causal masks are its rows' ranges; a cached step's is the call's.
  if (call.step == StepKind::kRagged ? !call.options.mask().is_none() : !input.causal_span()) {
    return c10::str("the decode kernel takes only the cache's causal mask, not ",
                    call.options.mask().to_string());
  }
  if (input.dropout_p() > 0.0)
    return "the decode kernel has no dropout (inference)";
  if (call.with_weights)
    return "the decode kernel returns no weights";
  if (!decode_attention_fits(call.query, call.key, call.value)) {
    return "the decode kernel needs CPU float32 or float64 inputs with contiguous last "
           "dimensions and no autograd to record";
  }
  return "";
}

// Row r's keys [begin[r], end[r]) for the decode kernel's one query per row.
std::pair<std::vector<int64_t>, std::vector<int64_t>> decode_ranges(const KernelInput& input) {
  const auto& call = input.call;
  const auto rows = static_cast<size_t>(call.query.size(0));
  const int64_t m = input.key_tokens();
  if (call.step == StepKind::kRagged) {
    const auto starts = call.ragged.query_offsets.to(torch::kCPU, torch::kInt64).contiguous();
    const auto ends = call.ragged.key_ends.to(torch::kCPU, torch::kInt64).contiguous();
    const auto* start = starts.data_ptr<int64_t>();
    const auto* valid_end = ends.data_ptr<int64_t>();
    std::vector<int64_t> begin(rows, 0), end(rows);
    for (size_t r = 0; r < rows; ++r) {
      end[r] = std::min(valid_end[r], start[r] + 1);
      if (call.ragged.window > 0)
        begin[r] = std::max<int64_t>(0, start[r] + 1 - call.ragged.window);
    }
    return {begin, end};
  }
  const auto& span = input.causal_span();
  TORCH_CHECK(span.has_value(), "[decode kernel] a cached step's mask must be causal, got ",
              input.mask().to_string());
  const int64_t end = span->causal ? std::min(m, span->query_offset + 1) : m;
  const int64_t begin = span->window > 0 ? std::max<int64_t>(0, end - span->window) : 0;
  return {std::vector<int64_t>(rows, begin), std::vector<int64_t>(rows, end)};
}

functional::AttentionOutput run_decode(const KernelInput& input) {
  const auto& call = input.call;
  const auto [begin, end] = decode_ranges(input);
  const auto* softcap = call.options.score_mod().target<SoftcapScore>();
  return {decode_attention(call.query, call.key, call.value, input.scale(), begin, end,
                           softcap ? softcap->cap : 0.0, call.options.sinks()),
          {}};
}

}  // namespace

KernelSpec decode_spec() {
  return {"decode", AttentionBackend::kAuto, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            return KernelDecision{decode_declines(input), run_decode};
          },
          /*takes_sinks=*/true};
}

}  // namespace attnkit::detail
