// The fused decode step: one query token per row against its cached keys, every head in one
// loop, reading the cache in place. Why: at toy sizes a decode step's cost is its operator
// count, and the general path spends a dozen ops per layer (masks, head splits, the math
// core's score, softmax and product, the merge) on arithmetic that takes a few microseconds.

#include "core/kernels/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __x86_64__
#include <cpuid.h>
#endif

#include "core/base/checks.h"
#include "core/base/parallel.h"
#include "core/base/row_softmax.h"
#include "core/kernels/decode_avx512.h"
#include "core/masks/mask_node.h"
#include "core/scores/row_score.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

namespace {

// The arithmetic type of a cache of `In`: float32 for 16-bit caches, read in place and widened
// element by element (a decode step reads each key and value once: converting the whole cache
// to float32 every step would cost more than the step).
template <typename In>
using Arithmetic = std::conditional_t<std::is_same_v<In, double>, double, float>;

#ifdef ATTNKIT_HAVE_AVX2_KERNEL
// Eight consecutive elements of a float, bfloat16 or float16 row as floats.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_eight(const float* x) {
  return _mm256_loadu_ps(x);
}
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_eight(
    const c10::BFloat16* x) {
  // A bfloat16 is a float's upper 16 bits.
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_eight(
    const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

// scores[0, 8) = q . keys[t * key_stride] for 8 key rows of width hd, the eight sums reduced
// together (one dot at a time paid a whole horizontal sum per key: most of the step at head
// widths of 16). q is float32 (a 16-bit query widened once per row).
template <typename In>
__attribute__((target("avx2,fma,f16c"))) void eight_dots_avx2(const float* q, const In* keys,
                                                              int64_t key_stride, int64_t hd,
                                                              float* scores) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t)
    acc[t] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + kLanes <= hd; d += kLanes) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t)
      acc[t] = _mm256_fmadd_ps(qv, load_eight(keys + t * key_stride + d), acc[t]);
  }
  if constexpr (std::is_same_v<In, float>) {
    if (d < hd) {
      const __m256i lanes = first_lanes(hd - d);
      const __m256 qv = _mm256_maskload_ps(q + d, lanes);
      for (int t = 0; t < 8; ++t)
        acc[t] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(keys + t * key_stride + d, lanes), acc[t]);
    }
    _mm256_storeu_ps(scores, horizontal_sums_of_eight(acc));
  } else {
    _mm256_storeu_ps(scores, horizontal_sums_of_eight(acc));
    for (int t = 0; t < 8; ++t) {  // the last partial block of 16-bit elements
      for (int64_t e = d; e < hd; ++e)
        scores[t] += q[e] * static_cast<float>(keys[t * key_stride + e]);
    }
  }
}

// acc[0, count) += weight * row[0, count) for a 16-bit row.
template <typename In>
__attribute__((target("avx2,fma,f16c"))) void add_weighted_row_avx2(float weight, const In* row,
                                                                    int64_t count, float* acc) {
  const __m256 w = _mm256_set1_ps(weight);
  int64_t d = 0;
  for (; d + kLanes <= count; d += kLanes)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(w, load_eight(row + d), _mm256_loadu_ps(acc + d)));
  for (; d < count; ++d)
    acc[d] += weight * static_cast<float>(row[d]);
}

// F16C's conversions, from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not
// know "f16c".
inline bool has_f16c() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 29) & 1) != 0;
  }();
  return has;
}
#endif

// Whether the AVX2 paths run for a cache of In: AVX2 + FMA, and for 16-bit caches F16C.
template <typename In>
bool avx2_for() {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<In, float>)
    return has_avx2_fma();
  if constexpr (std::is_same_v<In, c10::BFloat16> || std::is_same_v<In, c10::Half>)
    return has_avx2_fma() && has_f16c();
#endif
  return false;
}

// scores[j] = q . keys[j * key_stride] for j in [0, count), prefetching `ahead` as it reads
// the keys.
template <typename In, typename Acc = Arithmetic<In>>
void key_dots(const Acc* q, const In* keys, int64_t key_stride, int64_t hd, int64_t count,
              Acc* scores, const PrefetchAhead& ahead) {
  int64_t j = 0;
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<Acc, float>) {
    if (avx2_for<In>()) {
      for (; j + 8 <= count; j += 8) {
        ahead.with_rows(j, j + 8, count);
        eight_dots_avx2(q, keys + j * key_stride, key_stride, hd, scores + j);
      }
    }
  }
#endif
  for (; j < count; ++j) {
    ahead.with_rows(j, j + 1, count);
    const In* key = keys + j * key_stride;
    if constexpr (std::is_same_v<In, Acc>) {
      scores[j] = dot(q, key, hd);
    } else {
      Acc sum = 0;
      for (int64_t d = 0; d < hd; ++d)
        sum += q[d] * static_cast<Acc>(key[d]);
      scores[j] = sum;
    }
  }
}

// acc[0, count) += weight * row[0, count).
template <typename In, typename Acc>
void add_weighted_row(Acc weight, const In* row, int64_t count, Acc* acc) {
#ifdef ATTNKIT_HAVE_AVX2_KERNEL
  if constexpr (std::is_same_v<Acc, float> && !std::is_same_v<In, float>) {
    if (avx2_for<In>())
      return add_weighted_row_avx2(weight, row, count, acc);
  }
#endif
  for (int64_t d = 0; d < count; ++d)
    acc[d] += weight * static_cast<Acc>(row[d]);
}

// Sets scores p[j] of the keys `tile` covers that `mask` forbids to -inf, from the mask's
// host form where it has one, else from its tensors. Returns whether any key is allowed.
template <typename Acc>
bool apply_mask(const Mask& mask, const Tile& tile, bool* allowed, Acc* p) {
  if (!fill_tile(mask, tile, allowed)) {
    const auto bits = mask.tile_allowed(tile, torch::kCPU)
                          .to(torch::kBool)
                          .expand({1, 1, tile.keys})
                          .contiguous();
    std::copy(bits.data_ptr<bool>(), bits.data_ptr<bool>() + tile.keys, allowed);
  }
  bool any = false;
  for (int64_t j = 0; j < tile.keys; ++j) {
    if (allowed[j])
      any = true;
    else
      p[j] = -std::numeric_limits<Acc>::infinity();
  }
  return any;
}

// Which tensor a pass over a row's positions reads.
enum class Read { kKeys, kValues };

// One query per row and head against that row's keys [begin[r], end[r]), read where they lie:
// `runs(row, kv_head, begin, end, read, visit)` calls visit(data, first, count, ahead) for each
// run of positions [first, first + count) whose keys (values) lie one key_stride (value_stride)
// apart from `data` on: blocks of kKeyBlock positions of the contiguous cache's range, or of a
// paged cache's pages, with `ahead` the next block, to prefetch as the run is read.
// `m` bounds every row's end. Writes out (b, 1, h, hd_v), rounded once to In.
//
// A task is a row's key head with its group of query heads (grouped-query attention): each
// block of kKeyBlock keys is read from memory once for the whole group, then served from L1.
// One task per query head read every key once per head, and the group's later heads found
// the keys in cache only while they fitted there (not at 32k positions, nor for a paged
// cache's runs, which could evict each other). A float32 or bfloat16 block goes to
// decode_avx512.h's group paths where they fit.
constexpr int64_t kKeyBlock = 32;

template <typename In, typename Runs>
void decode_rows(const torch::Tensor& query, int64_t kv_heads, int64_t m, int64_t hd_v,
                 int64_t key_stride, int64_t value_stride, double scale,
                 const std::vector<int64_t>& key_begin, const std::vector<int64_t>& key_end,
                 double softcap, const std::vector<double>& sinks, const Runs& runs,
                 torch::Tensor& out, const ScoreVariant* score_variant = nullptr,
                 const Mask* mask = nullptr, int64_t queries_per_row = 1) {
  using Acc = Arithmetic<In>;
  const int64_t b = query.size(0), h = query.size(1), hd = query.size(3);
  const int64_t group_size = h / kv_heads;
  const auto* q = query.data_ptr<In>();
  auto* o = out.data_ptr<In>();  // (b, 1, h, hd_v) contiguous
  const auto qs = query.strides();
  // Enough keys per task that a thread's share is worth waking it for.
  const int64_t grain =
      std::max<int64_t>(1, 16384 / std::max<int64_t>(1, m * group_size * (hd + hd_v)));
  std::optional<RowScore<Acc>> score;
  if (score_variant != nullptr)
    score.emplace(*score_variant);
  constexpr bool kAvx512Dtype = std::is_same_v<In, float> || std::is_same_v<In, c10::BFloat16>;
  const bool avx512_group = kAvx512Dtype && decode_avx512_fits(query.scalar_type(), hd, hd_v);
  at::parallel_for(0, b * kv_heads, grain, [&](int64_t first_task, int64_t last_task) {
    // Per query head g of the group: its weights (m), its query (hd) and context (hd_v).
    auto work = score ? score->workspace(m) : ScoreProgram::Workspace{};
    std::unique_ptr<bool[]> allowed(mask != nullptr ? new bool[static_cast<size_t>(m)] : nullptr);
    std::vector<Acc> weights(static_cast<size_t>(group_size * m)),
        q_rows(static_cast<size_t>(group_size * hd)),
        context(static_cast<size_t>(group_size * hd_v));
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t row = task / kv_heads, kv_head = task % kv_heads;
      const int64_t first_head = kv_head * group_size;
      const int64_t begin = key_begin.empty() ? 0 : key_begin[row];
      const int64_t end = key_end.empty() ? m : key_end[row];
      for (int64_t g = 0; g < group_size; ++g) {
        const In* q_in = q + row * qs[0] + (first_head + g) * qs[1];
        for (int64_t d = 0; d < hd; ++d)
          q_rows[static_cast<size_t>(g * hd + d)] = static_cast<Acc>(q_in[d]);
      }
      // A row that sees no key gets zero weights, as in the math core: a zero context.
      std::fill(context.begin(), context.end(), Acc(0));
      if (end > begin) {
        runs(row, kv_head, begin, end, Read::kKeys,
             [&](const In* keys, int64_t first, int64_t count, const PrefetchAhead& ahead) {
               for (int64_t block = 0; block < count; block += kKeyBlock) {
                 const int64_t size = std::min(kKeyBlock, count - block);
                 if constexpr (kAvx512Dtype) {
                   if (avx512_group) {
                     group_key_dots_avx512(q + row * qs[0] + first_head * qs[1], qs[1], group_size,
                                           hd, keys + block * key_stride, key_stride, size,
                                           weights.data() + first + block, m, ahead);
                     continue;
                   }
                 }
                 for (int64_t g = 0; g < group_size; ++g) {  // the first head's pass prefetches
                   key_dots(q_rows.data() + g * hd, keys + block * key_stride, key_stride, hd, size,
                            weights.data() + g * m + first + block,
                            g == 0 ? ahead : PrefetchAhead{});
                 }
               }
             });
        for (int64_t g = 0; g < group_size; ++g) {
          Acc* p = weights.data() + g * m + begin;
          const int64_t n = end - begin;
          double row_scale = scale, row_softcap = softcap;
          if (score || mask != nullptr) {
            // The scores in place, scaled and capped or modified, then masked (-inf); then a
            // softmax of scale 1.
            for (int64_t j = 0; j < n; ++j)
              p[j] *= static_cast<Acc>(scale);
            if (softcap > 0.0) {
              for (int64_t j = 0; j < n; ++j)
                p[j] = static_cast<Acc>(softcap) * std::tanh(p[j] / static_cast<Acc>(softcap));
            }
            if (score)
              score->apply(p, n, row / queries_per_row, first_head + g, end - 1, begin, work);
            row_scale = 1.0;
            row_softcap = 0.0;
            if (mask != nullptr &&
                !apply_mask(*mask,
                            Tile{row / queries_per_row, first_head + g, 1, end - 1, 1, begin, n},
                            allowed.get(), p) &&
                sinks.empty()) {
              std::fill(p, p + n, Acc(0));  // it sees no key: zero weights, as the math core
              continue;
            }
          }
          if (!sinks.empty()) {  // the scores (capped), and the head's sink in the denominator
            const auto sink = static_cast<Acc>(sinks[first_head + g]);
            Acc top = sink;
            for (int64_t j = 0; j < n; ++j) {
              p[j] *= static_cast<Acc>(row_scale);
              if (row_softcap > 0.0)
                p[j] =
                    static_cast<Acc>(row_softcap) * std::tanh(p[j] / static_cast<Acc>(row_softcap));
              top = std::max(top, p[j]);
            }
            Acc total = std::exp(sink - top);
            for (int64_t j = 0; j < n; ++j) {
              p[j] = std::exp(p[j] - top);
              total += p[j];
            }
            for (int64_t j = 0; j < n; ++j)
              p[j] /= total;
          } else if (row_softcap > 0.0) {  // the scores capped, then a softmax of scale 1
            const auto cap = static_cast<Acc>(row_softcap);
            const auto scale_over_cap = static_cast<Acc>(row_scale / row_softcap);
            for (int64_t j = 0; j < n; ++j)
              p[j] = cap * std::tanh(p[j] * scale_over_cap);
            softmax_row(p, n, Acc(1), p);
          } else {
            softmax_row(p, n, static_cast<Acc>(row_scale), p);
          }
        }
        runs(row, kv_head, begin, end, Read::kValues,
             [&](const In* values, int64_t first, int64_t count, const PrefetchAhead& ahead) {
               for (int64_t block = 0; block < count; block += kKeyBlock) {
                 const int64_t size = std::min(kKeyBlock, count - block);
                 if constexpr (kAvx512Dtype) {
                   if (avx512_group) {
                     group_weighted_values_avx512(weights.data() + first + block, m, group_size,
                                                  values + block * value_stride, value_stride, size,
                                                  hd_v, context.data(), ahead);
                     continue;
                   }
                 }
                 for (int64_t g = 0; g < group_size; ++g) {
                   const Acc* weight = weights.data() + g * m + first + block;
                   for (int64_t j = 0; j < size; ++j) {
                     if (g == 0)  // the first head's pass prefetches
                       ahead.with_rows(j, j + 1, size);
                     add_weighted_row(weight[j], values + (block + j) * value_stride, hd_v,
                                      context.data() + g * hd_v);
                   }
                 }
               }
             });
      }
      for (int64_t g = 0; g < group_size; ++g) {  // rounded once to the cache's dtype
        In* context_out = o + (row * h + first_head + g) * hd_v;
        for (int64_t d = 0; d < hd_v; ++d)
          context_out[d] = static_cast<In>(context[static_cast<size_t>(g * hd_v + d)]);
      }
    }
  });
}

// Each head's sink (h) as doubles on the host, or none.

}  // namespace

std::vector<double> sink_values(const torch::Tensor& sinks, int64_t h, const char* fn) {
  TORCH_CHECK(!sinks.defined() || (sinks.dim() == 1 && sinks.size(0) == h), fn, " sinks must be (",
              h, "), one per query head, got ",
              sinks.defined() ? shape_string(sinks) : std::string());
  if (!sinks.defined())
    return {};
  const auto host = sinks.detach().to(torch::kCPU, torch::kDouble).contiguous();
  return {host.data_ptr<double>(), host.data_ptr<double>() + h};
}

bool decode_attention_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values) {
  const auto dtype = query.scalar_type();
  return query.device().is_cpu() && query.dim() == 4 && query.size(2) == 1 &&
         (dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kBFloat16 ||
          dtype == torch::kHalf) &&
         keys.scalar_type() == dtype && values.scalar_type() == dtype && keys.device().is_cpu() &&
         values.device().is_cpu() && query.stride(3) == 1 && keys.stride(3) == 1 &&
         values.stride(3) == 1 && keys.size(1) >= 1 && query.size(1) % keys.size(1) == 0 &&
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
              "[decode_attention] expected one CPU floating-point query per row in the keys' "
              "and values' dtype, last dimensions contiguous, heads a multiple of the key heads "
              "and no autograd; got "
              "query ",
              query.sizes(), " ", query.scalar_type(), " on ", query.device(), ", keys ",
              keys.sizes(), " ", keys.scalar_type(), ", values ", values.sizes(), " ",
              values.scalar_type());
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
  const auto sinks_of_heads = sink_values(sinks, h, "[decode_attention]");
  // (b, 1, h, hd_v) memory, returned as (b, h, 1, hd_v): merging the heads is then a view.
  auto out = torch::empty({b, 1, h, values.size(3)}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "decode_attention", [&] {
        const auto* k = keys.data_ptr<scalar_t>();
        const auto* v = values.data_ptr<scalar_t>();
        const auto ks = keys.strides(), vs = values.strides();
        // One run per block of kKeyBlock positions of the row's keys (values) in the cache's
        // storage, each prefetching the next (PrefetchAhead).
        const auto runs = [&](int64_t row, int64_t kv_head, int64_t begin, int64_t end, Read read,
                              const auto& visit) {
          const bool keys_read = read == Read::kKeys;
          const int64_t stride = keys_read ? ks[2] : vs[2];
          const scalar_t* data =
              keys_read ? k + row * ks[0] + kv_head * ks[1] : v + row * vs[0] + kv_head * vs[1];
          const int64_t row_bytes =
              (keys_read ? keys.size(3) : values.size(3)) * static_cast<int64_t>(sizeof(scalar_t));
          for (int64_t first = begin; first < end; first += kKeyBlock) {
            const int64_t count = std::min(kKeyBlock, end - first), next = first + count;
            PrefetchAhead ahead;
            if (next < end) {
              ahead = {reinterpret_cast<const char*>(data + next * stride),
                       std::min(kKeyBlock, end - next),
                       stride * static_cast<int64_t>(sizeof(scalar_t)), row_bytes};
            }
            visit(data + first * stride, first, count, ahead);
          }
        };
        decode_rows<scalar_t>(query, keys.size(1), m, values.size(3), ks[2], vs[2], scale,
                              key_begin, key_end, softcap, sinks_of_heads, runs, out);
      });
  return out.transpose(1, 2);
}

torch::Tensor paged_decode_attention(
    const torch::Tensor& query, const torch::Tensor& key_pages, const torch::Tensor& value_pages,
    const torch::Tensor& page_table, const std::vector<int64_t>& key_begin,
    const std::vector<int64_t>& key_end, double scale, double softcap, const torch::Tensor& sinks,
    const ScoreVariant* score, const Mask* mask, int64_t queries_per_row) {
  const int64_t b = query.size(0), h = query.size(1), page_size = key_pages.size(2);
  const int64_t pages_per_row = page_table.size(1);
  const int64_t m = std::max<int64_t>(1, *std::max_element(key_end.begin(), key_end.end()));
  const auto sinks_of_heads = sink_values(sinks, h, "[paged_decode_attention]");
  auto out = torch::empty({b, 1, h, value_pages.size(3)}, query.options());
  const int64_t* table = page_table.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
        const auto* k = key_pages.data_ptr<scalar_t>();
        const auto* v = value_pages.data_ptr<scalar_t>();
        const auto ks = key_pages.strides(), vs = value_pages.strides();
        // One run per block of kKeyBlock positions within a page: key j in page
        // table[row][j / page_size], slot j % page_size. Each block's reading prefetches the
        // next block (PrefetchAhead). Into L2 (locality 2): into L1 they evicted the block being
        // read, and into the outer caches only they came too late (AMD EPYC, bfloat16 at 32k
        // positions: 0.70x and 0.92x the time of those two).
        const auto runs = [&](int64_t row, int64_t kv_head, int64_t begin, int64_t end, Read read,
                              const auto& visit) {
          const auto* data = read == Read::kKeys ? k : v;
          const auto& strides = read == Read::kKeys ? ks : vs;
          const auto* row_pages = table + row * pages_per_row;
          const auto page_data = [&](int64_t page) {
            return data + row_pages[page] * strides[0] + kv_head * strides[1];
          };
          const int64_t row_stride = strides[2] * static_cast<int64_t>(sizeof(scalar_t));
          const int64_t row_bytes =
              (read == Read::kKeys ? key_pages.size(3) : value_pages.size(3)) *
              static_cast<int64_t>(sizeof(scalar_t));
          // Positions from `first` (slot `slot` of its page) to the end of its block, its
          // page or the row's keys. kKeyBlock is a power of two: no division per block.
          const auto block_count = [&](int64_t first, int64_t slot) {
            return std::min({end - first, page_size - slot, kKeyBlock - first % kKeyBlock});
          };
          int64_t page = begin / page_size, slot = begin - page * page_size;
          const scalar_t* at = page_data(page) + slot * strides[2];
          for (int64_t first = begin; first < end;) {
            const int64_t count = block_count(first, slot);
            const scalar_t* block = at;
            const int64_t next = first + count;
            PrefetchAhead ahead;
            if (next < end) {
              slot += count;
              if (slot == page_size) {
                slot = 0;
                at = page_data(++page);
              } else {
                at += count * strides[2];
              }
              ahead = {reinterpret_cast<const char*>(at), block_count(next, slot), row_stride,
                       row_bytes};
            }
            visit(block, first, count, ahead);
            first = next;
          }
        };
        decode_rows<scalar_t>(query, key_pages.size(1), m, value_pages.size(3), ks[2], vs[2], scale,
                              key_begin, key_end, softcap, sinks_of_heads, runs, out, score, mask,
                              queries_per_row);
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
    return "the decode kernel needs CPU inputs of one floating dtype with contiguous last "
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
  KernelSpec spec{"decode", AttentionBackend::kAuto, /*runs_16bit_cuda_in_its_dtype=*/false,
                  [](const KernelInput& input) {
                    return KernelDecision{decode_declines(input), run_decode};
                  },
                  /*takes_sinks=*/true};
  spec.reads_16bit_cpu_in_place = true;
  return spec;
}

}  // namespace attnkit::detail
