// The planner (planner.h): one table of kernels, each with what it serves and a predicate
// that names what it lacks, and the one place that runs them.

#include "core/planner.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/decode_attention.h"
#include "core/kernels.h"

namespace attnkit::detail {

namespace {

namespace F = attnkit::functional;

// The test hook's kernel, if any (KernelClaimsEverything).
std::optional<Kernel> g_claims_everything;

int64_t query_tokens(const AttentionCall& call) {
  return call.query.size(2);
}

double dropout_of(const AttentionCall& call) {
  return call.options.training() ? call.options.dropout_p() : 0.0;
}

bool has_default_scale(const AttentionCall& call) {
  const auto& scale = call.options.scale();
  return !scale.has_value() || *scale == default_scale(call.query.size(3));
}

// The call's mask as the fused kernels take it: none, or causal with an offset and a window.
struct CausalMask {
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0;  // 0: none
};

std::optional<CausalMask> as_causal(const Mask& mask) {
  CausalMask result;
  if (mask.is_none())
    return result;
  if (!mask.is_causal(&result.query_offset, &result.window))
    return std::nullopt;
  result.causal = true;
  return result;
}

// Which keys each query sees, as every kernel but the inference ones needs it: for a ragged
// step each row's causal mask over its own valid keys (and window) joins the call's mask.
Mask effective_mask(const AttentionCall& call) {
  if (call.step != StepKind::kRagged)
    return call.options.mask();
  auto rows = Mask::causal(call.query_offsets);
  if (call.window > 0)
    rows = rows.sliding_window(call.window);
  return rows & Mask::key_padding(call.key_ends) & call.options.mask();
}

// What every fused kernel (loop nest, packed loop nest, SDPA) lacks.
std::string fused_lacks(const AttentionCall& call) {
  if (call.options.score_mod())
    return "the fused backend has no score functions (score_mod)";
  const auto mask = effective_mask(call);
  if (!as_causal(mask)) {
    return c10::str("the fused backend takes only causal and sliding-window masks, not ",
                    mask.to_string());
  }
  if (!has_default_scale(call)) {
    return c10::str("the fused backend has only the default scale 1/sqrt(head_dim), not ",
                    *call.options.scale());
  }
  if (call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  return "";
}

std::string no_sdpa_lacks() {
  return libtorch_has_sdpa() ? "LibTorch 2.x runs the fused backend on its own SDPA" : "";
}

std::string decode_lacks(const AttentionCall& call) {
  if (call.step == StepKind::kSequence)
    return "the decode kernel serves cached steps only";
  if (query_tokens(call) != 1)
    return c10::str("the decode kernel takes one query per row, not ", query_tokens(call));
  if (call.options.score_mod())
    return "the decode kernel has no score functions (score_mod)";
  if (call.step == StepKind::kRagged ? !call.options.mask().is_none()
                                     : !as_causal(call.options.mask())) {
    return c10::str("the decode kernel takes only the cache's causal mask, not ",
                    call.options.mask().to_string());
  }
  if (dropout_of(call) > 0.0)
    return "the decode kernel has no dropout (inference)";
  if (call.with_weights)
    return "the decode kernel returns no weights";
  if (!decode_attention_fits(call.query, call.key, call.value)) {
    return "the decode kernel needs CPU float32 or float64 inputs with contiguous last "
           "dimensions and no autograd to record";
  }
  return "";
}

std::string ragged_loop_nest_lacks(const AttentionCall& call) {
  if (call.step != StepKind::kRagged)
    return "the ragged loop nest serves ragged steps only";
  if (query_tokens(call) == 1)
    return "a one-query ragged step is the decode kernel's";
  if (!call.options.mask().is_none() || call.options.score_mod() || !has_default_scale(call) ||
      call.with_weights) {
    return "the ragged loop nest takes no mask, score function, scale or weights";
  }
  if (!ragged_loop_nest_fits(call.query, call.key, call.value)) {
    return c10::str("the ragged loop nest needs CPU float32 or float64 inputs, n * m <= ",
                    F::kFusedAttentionMaxTile, " and no autograd to record");
  }
  return "";
}

// What the loop nest on split heads or on a packed projection lacks beyond fused_lacks.
std::string loop_nest_lacks(const AttentionCall& call) {
  auto why = fused_lacks(call);
  if (why.empty())
    why = no_sdpa_lacks();
  if (why.empty() &&
      !F::fused_attention_fits(query_tokens(call), call.key.size(2), call.query.options())) {
    why = c10::str("the loop nest needs CPU float32 or float64 inputs with n * m <= ",
                   F::kFusedAttentionMaxTile);
  }
  return why;
}

std::string packed_loop_nest_lacks(const AttentionCall& call) {
  if (!call.packed_qkv.defined())
    return "the packed loop nest needs the packed QKV projection";
  const auto mask = as_causal(call.options.mask());
  if (mask && mask->query_offset != 0)
    return "the packed loop nest's queries and keys are the same tokens (query offset 0)";
  return loop_nest_lacks(call);
}

std::string sdpa_lacks(const AttentionCall& call) {
  return fused_lacks(call);
}

bool is_16bit(const torch::Tensor& tensor) {
  return tensor.scalar_type() == torch::kBFloat16 || tensor.scalar_type() == torch::kHalf;
}

// What LibTorch's flash kernel runs of a call: the batched form with a causal window or at the
// offset m - n (its bottom-right alignment), or the call's segments. Plain causal and no mask
// are SDPA's, which runs the same kernel.
struct FlashPlan {
  int64_t window = 0;
  std::optional<VarlenLayout> layout;
};

std::optional<FlashPlan> flash_plan(const AttentionCall& call) {
  const auto mask = effective_mask(call);
  const int64_t n = query_tokens(call), m = call.key.size(2);
  if (const auto causal = as_causal(mask)) {
    if (!causal->causal || (causal->window == 0 && causal->query_offset == 0))
      return std::nullopt;
    if (n > m || causal->query_offset != m - n)
      return std::nullopt;
    return FlashPlan{causal->window, std::nullopt};
  }
  if (call.step != StepKind::kSequence)
    return std::nullopt;
  auto layout = varlen_layout(mask, call.query.size(0), n, m);
  if (!layout)
    return std::nullopt;
  return FlashPlan{0, std::move(layout)};
}

std::string flash_lacks(const AttentionCall& call) {
  const auto &q = call.query, &k = call.key, &v = call.value;
  if (!q.is_cuda())
    return "LibTorch's flash kernel runs on CUDA only";
  if (!is_16bit(q) || k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type())
    return "LibTorch's flash kernel takes bfloat16 or float16 inputs of one dtype";
  const int64_t hd = q.size(3);
  if (hd % 8 != 0 || hd > 256 || v.size(3) != hd) {
    return c10::str("LibTorch's flash kernel takes head sizes that are multiples of 8 up to 256, ",
                    "equal for values, not ", hd, " and ", v.size(3));
  }
  if (call.options.score_mod())
    return "LibTorch's flash kernel has no score functions (score_mod)";
  if (call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  if (!flash_plan(call)) {
    return c10::str(
        "the flash route takes sliding windows and causal masks at the offset m - n, and key "
        "padding or documents alone or with causal(), not ",
        effective_mask(call).to_string());
  }
  if (!flash_kernel_available(q.device())) {
    return "LibTorch's flash kernel is not in this LibTorch (a CUDA build, 2.6 or later) or "
           "not on this GPU (sm80 or later)";
  }
  return "";
}

// What the SDPA routes for other masks (sdpa_varlen, sdpa_masked) lack on any mask: "" or why.
std::string sdpa_routes_lack(const AttentionCall& call) {
  if (call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  if (!has_default_scale(call)) {
    return c10::str("the fused backend has only the default scale 1/sqrt(head_dim), not ",
                    *call.options.scale());
  }
  return "";
}

// Whether a route that the CPU runs slower than the chunked kernel may take `call`: only a
// demanded kFused there (docs/benchmarks.md), anything on other devices.
bool cpu_route_allowed(const AttentionCall& call) {
  return !call.query.is_cpu() ||
         (!call.backend_is_preference && call.options.backend() == AttentionBackend::kFused);
}

std::string sdpa_varlen_lacks(const AttentionCall& call) {
  if (!libtorch_has_sdpa())
    return "LibTorch 1.x has no SDPA to run variable-length segments on";
  if (call.options.score_mod())
    return "the variable-length route has no score functions (score_mod)";
  if (call.step != StepKind::kSequence)
    return "the variable-length route serves whole sequences";
  auto why = sdpa_routes_lack(call);
  if (!why.empty())
    return why;
  // One SDPA call per segment: on the CPU mostly slower than the chunked kernel (1.1-1.6x
  // forward+backward; docs/benchmarks.md), on CUDA unmeasured against the masked route.
  // Checked before the layout, whose host work kAuto is spared.
  if (call.backend_is_preference || call.options.backend() != AttentionBackend::kFused)
    return "the variable-length route runs only where kFused is demanded";
  const auto mask = effective_mask(call);
  if (!varlen_layout(mask, call.query.size(0), query_tokens(call), call.key.size(2))) {
    return c10::str(
        "the variable-length route takes key padding (valid keys first) or documents (each "
        "one run of tokens), alone or with causal(), not ",
        mask.to_string());
  }
  return "";
}

// The most bytes of the dense mask that the masked SDPA route builds: bools (batch or 1) x n x
// m, or with an additive score function floats (batch or 1) x heads x n x m.
constexpr int64_t kDenseMaskBudget = int64_t{128} << 20;

// The call's score function when it only adds a bias (alibi, relative_position_bias).
const AdditiveScore* additive_score(const AttentionCall& call) {
  const auto& score_mod = call.options.score_mod();
  return score_mod ? score_mod.target<AdditiveScore>() : nullptr;
}

std::string sdpa_masked_lacks(const AttentionCall& call) {
  const bool has_score_mod = static_cast<bool>(call.options.score_mod());
  if (has_score_mod && additive_score(call) == nullptr) {
    return "the fused backend has no score functions (score_mod) but additive biases on "
           "LibTorch 2.x (score_mods::alibi, score_mods::relative_position_bias)";
  }
  auto why = sdpa_routes_lack(call);
  if (!why.empty())
    return why;
  const auto mask = effective_mask(call);
  if (!libtorch_has_sdpa()) {
    if (has_score_mod) {
      return "the fused backend has no score functions (score_mod) on LibTorch 1.x (2.x takes "
             "additive biases through its SDPA)";
    }
    return c10::str(
        "the fused backend takes only causal and sliding-window masks on LibTorch 1.x (2.x "
        "takes any mask through its SDPA), not ",
        mask.to_string());
  }
  const int64_t rows = mask.is_none() ? 1 : call.query.size(0);
  const int64_t per_entry = has_score_mod ? call.query.size(1) * 4 : 1;
  const int64_t bytes = rows * per_entry * query_tokens(call) * call.key.size(2);
  if (bytes > kDenseMaskBudget) {
    return c10::str("the fused backend's dense form of ", mask.to_string(),
                    has_score_mod ? " and the score function's bias" : "", " would take ", bytes,
                    " bytes, more than its budget of ", kDenseMaskBudget);
  }
  // docs/benchmarks.md: the chunked kernel ran document and padding masks 1.1-5.5x faster
  // than LibTorch 2.6's CPU SDPA with the dense mask.
  if (!cpu_route_allowed(call)) {
    return "on the CPU the chunked kernel runs masks and score functions faster than SDPA "
           "with a dense mask; demand kFused for this route";
  }
  return "";
}

std::string chunked_lacks(const AttentionCall& call) {
  if (call.with_weights)
    return "the chunked backend returns no weights (the math backend builds them)";
  // One query per row scores one row per head: the math core costs no quadratic memory there
  // and has the least overhead, where tiles would be read row by row.
  if (call.step == StepKind::kRagged && query_tokens(call) == 1)
    return "a one-query ragged step runs best on the math core";
  return "";
}

std::string math_lacks(const AttentionCall&) {
  return "";
}

bool claims(const KernelSpec& spec, const AttentionCall& call) {
  return g_claims_everything == spec.kernel || spec.lacks(call).empty();
}

bool serves(const KernelSpec& spec, AttentionBackend requested) {
  return requested == AttentionBackend::kAuto || spec.backend == AttentionBackend::kAuto ||
         spec.backend == requested;
}

const KernelSpec* first_claiming(const AttentionCall& call, AttentionBackend requested) {
  for (const auto& spec : kernel_table()) {
    if (serves(spec, requested) && claims(spec, call))
      return &spec;
  }
  return nullptr;
}

// The math core on the call's 4-D inputs: key/value heads repeated for their query heads,
// the dense mask, index tensors for a score function.
F::AttentionOutput run_math(const AttentionCall& call, const Mask& mask) {
  const auto &q4 = call.query, &k4 = call.key, &v4 = call.value;
  const auto& options = call.options;
  const int64_t batch = q4.size(0), heads = q4.size(1), n = q4.size(2), m = k4.size(2);
  const int64_t group = heads / k4.size(1);
  MathMasking masking;
  if (!mask.is_none())
    masking.allowed = mask.dense(batch, heads, n, m, q4.device());
  if (options.score_mod()) {
    masking.score_mod = options.score_mod();
    const auto index = torch::dtype(torch::kInt64).device(q4.device());
    masking.index = {torch::arange(batch, index).view({-1, 1, 1, 1}),
                     torch::arange(heads, index).view({1, -1, 1, 1}),
                     torch::arange(n, index).view({1, 1, -1, 1}),
                     torch::arange(m, index).view({1, 1, 1, -1})};
  }
  const auto k = group == 1 ? k4 : k4.repeat_interleave(group, 1);
  const auto v = group == 1 ? v4 : v4.repeat_interleave(group, 1);
  return math_attention(q4, k, v, masking, options.scale(), options.dropout_p(),
                        options.training());
}

// Row r's keys [begin[r], end[r]) for the decode kernel's one query per row.
std::pair<std::vector<int64_t>, std::vector<int64_t>> decode_ranges(const AttentionCall& call) {
  const auto rows = static_cast<size_t>(call.query.size(0));
  const int64_t m = call.key.size(2);
  if (call.step == StepKind::kRagged) {
    const auto starts = call.query_offsets.to(torch::kCPU, torch::kInt64).contiguous();
    const auto ends = call.key_ends.to(torch::kCPU, torch::kInt64).contiguous();
    const auto* start = starts.data_ptr<int64_t>();
    const auto* valid_end = ends.data_ptr<int64_t>();
    std::vector<int64_t> begin(rows, 0), end(rows);
    for (size_t r = 0; r < rows; ++r) {
      end[r] = std::min(valid_end[r], start[r] + 1);
      if (call.window > 0)
        begin[r] = std::max<int64_t>(0, start[r] + 1 - call.window);
    }
    return {begin, end};
  }
  const auto mask = as_causal(call.options.mask());
  TORCH_CHECK(mask.has_value(), "[decode kernel] a cached step's mask must be causal, got ",
              call.options.mask().to_string());
  const int64_t end = mask->causal ? std::min(m, mask->query_offset + 1) : m;
  const int64_t begin = mask->window > 0 ? std::max<int64_t>(0, end - mask->window) : 0;
  return {std::vector<int64_t>(rows, begin), std::vector<int64_t>(rows, end)};
}

torch::Tensor run_kernel(Kernel kernel, const AttentionCall& call) {
  const auto &q = call.query, &k = call.key, &v = call.value;
  const double dropout_p = dropout_of(call);
  const auto fused_mask = [&] {
    const auto mask = as_causal(effective_mask(call));
    TORCH_CHECK(mask.has_value(), "[planner] the fused kernels take causal masks only, got ",
                effective_mask(call).to_string());
    return *mask;
  };
  switch (kernel) {
    case Kernel::kDecode: {
      const auto [begin, end] = decode_ranges(call);
      return decode_attention(q, k, v, call.options.scale().value_or(default_scale(q.size(3))),
                              begin, end);
    }
    case Kernel::kRaggedLoopNest:
      TORCH_CHECK(call.step == StepKind::kRagged,
                  "[planner] the ragged loop nest needs the "
                  "rows' query offsets and key ends");
      return ragged_loop_nest_attention(q, k, v, call.query_offsets, call.key_ends, call.window);
    case Kernel::kPackedLoopNest: {
      TORCH_CHECK(call.packed_qkv.defined(),
                  "[planner] the packed loop nest needs the packed "
                  "QKV projection");
      const auto mask = fused_mask();
      const auto merged = loop_nest_packed_attention(call.packed_qkv, q.size(1), mask.causal,
                                                     mask.window, dropout_p);
      // (b, n, h * hd) -> (b, n, h, hd) -> (b, h, n, hd): a view
      return merged.view({q.size(0), q.size(2), q.size(1), -1}).transpose(1, 2);
    }
    case Kernel::kLoopNest: {
      const auto mask = fused_mask();
      return loop_nest_attention(q, k, v, mask.causal, mask.query_offset, mask.window, dropout_p);
    }
    case Kernel::kFlash: {
      const auto plan = flash_plan(call);
      TORCH_CHECK(plan.has_value(), "[planner] the flash route cannot run ",
                  effective_mask(call).to_string());
      const double scale = call.options.scale().value_or(default_scale(q.size(3)));
      if (plan->layout)
        return flash_varlen_attention(q, k, v, *plan->layout, scale, dropout_p);
      return flash_attention(q, k, v, FlashSegments{}, /*causal=*/true, plan->window, scale,
                             dropout_p);
    }
    case Kernel::kSdpa: {
      const auto mask = fused_mask();
      return sdpa_attention(q, k, v, mask.causal, mask.query_offset, mask.window, dropout_p);
    }
    case Kernel::kSdpaVarlen: {
      const auto layout = varlen_layout(effective_mask(call), q.size(0), q.size(2), k.size(2));
      TORCH_CHECK(layout.has_value(), "[planner] the variable-length route needs segments, got ",
                  effective_mask(call).to_string());
      return sdpa_varlen_attention(q, k, v, *layout, dropout_p);
    }
    case Kernel::kSdpaMasked: {
      const int64_t b = q.size(0), h = q.size(1), n = q.size(2), m = k.size(2);
      const auto mask = effective_mask(call);
      const auto visible = mask.is_none() ? torch::Tensor() : mask.dense(b, h, n, m, q.device());
      torch::Tensor bias;  // (1 or b, 1 or h, n, m)
      if (const auto* additive = additive_score(call)) {
        const auto index = torch::dtype(torch::kInt64).device(q.device());
        bias = additive->bias(torch::zeros({}, q.options()),
                              torch::arange(b, index).view({-1, 1, 1, 1}),
                              torch::arange(h, index).view({1, -1, 1, 1}),
                              torch::arange(n, index).view({1, 1, -1, 1}),
                              torch::arange(m, index).view({1, 1, 1, -1}));
      }
      return sdpa_masked_attention(q, k, v, visible, bias, dropout_p);
    }
    case Kernel::kChunked: {
      auto options = call.options;
      return chunked_kernel(q, k, v, options.mask(effective_mask(call)));
    }
    case Kernel::kMath:
      break;
  }
  return run_math(call, effective_mask(call)).context;
}

}  // namespace

const std::vector<KernelSpec>& kernel_table() {
  static const std::vector<KernelSpec> table{
      {Kernel::kDecode, "decode", AttentionBackend::kAuto, decode_lacks},
      {Kernel::kRaggedLoopNest, "ragged_loop_nest", AttentionBackend::kAuto,
       ragged_loop_nest_lacks},
      {Kernel::kPackedLoopNest, "packed_loop_nest", AttentionBackend::kFused,
       packed_loop_nest_lacks},
      {Kernel::kLoopNest, "loop_nest", AttentionBackend::kFused, loop_nest_lacks},
      {Kernel::kFlash, "flash", AttentionBackend::kFused, flash_lacks},
      {Kernel::kSdpa, "sdpa", AttentionBackend::kFused, sdpa_lacks},
      {Kernel::kSdpaVarlen, "sdpa_varlen", AttentionBackend::kFused, sdpa_varlen_lacks},
      {Kernel::kSdpaMasked, "sdpa_masked", AttentionBackend::kFused, sdpa_masked_lacks},
      {Kernel::kChunked, "chunked", AttentionBackend::kChunked, chunked_lacks},
      {Kernel::kMath, "math", AttentionBackend::kMath, math_lacks},
  };
  return table;
}

std::string backend_lacks(AttentionBackend backend, const AttentionCall& call) {
  if (backend == AttentionBackend::kAuto || first_claiming(call, backend) != nullptr)
    return "";
  // The family's most general kernel is its last.
  const KernelSpec* general = nullptr;
  for (const auto& spec : kernel_table()) {
    if (spec.backend == backend)
      general = &spec;
  }
  TORCH_INTERNAL_ASSERT(general != nullptr, "no kernel serves backend ", backend_name(backend));
  return general->lacks(call);
}

// The innermost functional::KernelRecord of this thread, if any.
thread_local F::KernelRecord* t_innermost_record = nullptr;

struct KernelRecordAccess {
  static void append(const AttentionCall& call, const KernelSpec& spec) {
    if (t_innermost_record != nullptr) {
      t_innermost_record->runs_.push_back(
          {spec.name, call.query.scalar_type(), call.query.device()});
    }
  }
  static void open(F::KernelRecord* record) {
    record->outer_ = t_innermost_record;
    t_innermost_record = record;
  }
  static void close(F::KernelRecord* record) { t_innermost_record = record->outer_; }
};

namespace {

const KernelSpec& plan_in_its_dtype(const AttentionCall& call) {
  const auto requested = call.options.backend();
  if (const auto* spec = first_claiming(call, requested))
    return *spec;
  TORCH_CHECK(call.backend_is_preference, "[attention] backend ", backend_name(requested),
              " cannot run this: ", backend_lacks(requested, call),
              "; use AttentionBackend::kAuto, kChunked or kMath");
  const auto* spec = first_claiming(call, AttentionBackend::kAuto);
  TORCH_INTERNAL_ASSERT(spec != nullptr, "the math kernel claims every call");
  return *spec;
}

// Whether `kernel` runs on LibTorch's own CUDA kernels (on 1.13 `sdpa` is a stand-in: the
// math core off the CPU).
bool runs_on_libtorch_cuda_kernels(Kernel kernel) {
  return libtorch_has_sdpa() && (kernel == Kernel::kFlash || kernel == Kernel::kSdpa ||
                                 kernel == Kernel::kSdpaVarlen || kernel == Kernel::kSdpaMasked);
}

// Whether a call is computed in float32 and its result rounded once to its 16-bit dtype:
// every 16-bit call but those that LibTorch's CUDA kernels run (SDPA on any mask, the flash
// kernel), which keep their statistics and accumulators in float32 themselves. attnkit's
// kernels and LibTorch's CPU ops would keep the scores, the softmax statistics, the
// accumulators and the gradients in the 16-bit dtype (and 1.13 has no float16 matrix product
// on the CPU at all).
bool runs_in_float32(const AttentionCall& call) {
  if (!is_16bit(call.query))
    return false;
  if (!call.query.is_cuda())
    return true;
  const auto* spec = first_claiming(call, call.options.backend());
  return spec == nullptr || !runs_on_libtorch_cuda_kernels(spec->kernel);
}

// The call on copies of its inputs in `dtype` (each a no-op where it has it already);
// autograd casts the gradients back to the inputs' dtypes.
AttentionCall in_dtype(const AttentionCall& call, torch::ScalarType dtype) {
  auto cast = call;
  cast.query = call.query.to(dtype);
  cast.key = call.key.to(dtype);
  cast.value = call.value.to(dtype);
  // The packed loop nest would read the projection in its own dtype; the cast views serve.
  if (call.query.scalar_type() != dtype)
    cast.packed_qkv = torch::Tensor();
  return cast;
}

// The call as it runs: under LibTorch's autocast, on its inputs in the autocast dtype.
// (Read before a NoAutocast: inside one, LibTorch 1.13 reports autocast as off.)
std::optional<AttentionCall> autocast_call(const AttentionCall& call) {
  const auto dtype = attention_dtype(call.query);
  if (dtype == call.query.scalar_type() && attention_dtype(call.key) == call.key.scalar_type() &&
      attention_dtype(call.value) == call.value.scalar_type()) {
    return std::nullopt;
  }
  return in_dtype(call, dtype);
}

F::AttentionOutput run_planned(const AttentionCall& call) {
  const auto& spec = plan_in_its_dtype(call);
  KernelRecordAccess::append(call, spec);
  if (spec.kernel == Kernel::kMath)
    return run_math(call, effective_mask(call));
  return {run_kernel(spec.kernel, call), {}};
}

F::AttentionOutput run_in_its_precision(const AttentionCall& call) {
  if (!runs_in_float32(call))
    return run_planned(call);
  const auto out = run_planned(in_dtype(call, torch::kFloat));
  const auto dtype = call.query.scalar_type();
  return {out.context.to(dtype), out.weights.defined() ? out.weights.to(dtype) : out.weights};
}

}  // namespace

torch::ScalarType attention_dtype(const torch::Tensor& tensor) {
  const auto own = tensor.scalar_type();
  if (own == torch::kDouble || !tensor.is_floating_point())
    return own;
  const auto autocast = autocast_state(tensor.device().type());
  return autocast.enabled ? autocast.dtype : own;
}

const KernelSpec& plan_attention(const AttentionCall& given) {
  const auto autocast = autocast_call(given);
  const auto& call = autocast ? *autocast : given;
  return plan_in_its_dtype(runs_in_float32(call) ? in_dtype(call, torch::kFloat) : call);
}

F::AttentionOutput run_attention(const AttentionCall& given) {
  const auto autocast = autocast_call(given);
  NoAutocast no_autocast;
  return run_in_its_precision(autocast ? *autocast : given);
}

}  // namespace attnkit::detail

namespace attnkit::functional {

KernelRecord::KernelRecord() : outer_(nullptr) {
  detail::KernelRecordAccess::open(this);
}

KernelRecord::~KernelRecord() {
  detail::KernelRecordAccess::close(this);
}

}  // namespace attnkit::functional

namespace attnkit::detail {

KernelClaimsEverything::KernelClaimsEverything(Kernel kernel) {
  g_claims_everything = kernel;
}

KernelClaimsEverything::~KernelClaimsEverything() {
  g_claims_everything.reset();
}

}  // namespace attnkit::detail
