// The LibTorch-SDPA kernel: LibTorch's own scaled_dot_product_attention behind the fused
// backend, and, as its stand-in on LibTorch 1.13 (which has none), attnkit's chunked kernel
// on the CPU and the math core elsewhere. The LibTorch-version splits of the kernels live in
// this file (the planner's specs ask libtorch_has_sdpa()); the others are autocast's switches
// (base/autocast.cpp) and brgemm's (base/matrix_units.cpp).
//
// From 2.5 on, LibTorch's CPU flash kernel is run with the BLAS pinned to one thread where
// it would oversubscribe the cores (docs/threads.md). From 2.6 on, a CUDA build's private
// FlashAttention-2 op (at::_flash_attention_forward, with its autograd formula) serves
// variable-length segments and sliding windows (flash_kernel_available, flash_attention).

#include "core/kernels/sdpa_kernel.h"

#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include <torch/version.h>

#include "attnkit/attention_types.h"
#include "attnkit/score_mods.h"
#include "core/base/autocast.h"
#include "core/base/checks.h"
#include "core/base/parallel.h"
#include "core/kernels/chunked.h"
#include "core/kernels/math_kernel.h"
#include "core/kernels/varlen_kernel.h"
#include "core/scores/score_variants.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#include <ATen/SDPBackend.h>
#endif
// The flash op's window arguments came in 2.6.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define ATTNKIT_HAS_FLASH_OP 1
#endif

namespace attnkit::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
// LibTorch's CPU flash kernel runs its (batch, head, query block) tasks in a parallel loop
// and calls the BLAS inside them, where OpenBLAS, keeping one thread per core of its own,
// oversubscribes the cores: at 2 threads its forward+backward ran slower than at 1
// (docs/threads.md). This runs the kernel with the BLAS single-threaded, forward and
// backward, as attnkit's own kernels run theirs. Backward goes through the kernel's own
// autograd graph, built in forward on detached inputs and kept in the node.
struct SingleThreadedBlasSdpa : public torch::autograd::Function<SingleThreadedBlasSdpa> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& query,
                               const torch::Tensor& key, const torch::Tensor& value,
                               const c10::optional<at::Tensor>& visible, bool is_causal,
                               bool enable_gqa) {
    const SingleThreadedBlas single_threaded_blas;
    const torch::AutoGradMode grad_mode(true);
    std::vector<torch::Tensor> graph{torch::Tensor(), query.detach(), key.detach(), value.detach()};
    for (size_t i = 1; i < graph.size(); ++i)
      graph[i].requires_grad_(std::array{query, key, value}[i - 1].requires_grad());
    graph[0] = at::scaled_dot_product_attention(graph[1], graph[2], graph[3], visible,
                                                /*dropout_p=*/0.0, is_causal,
                                                /*scale=*/c10::nullopt, enable_gqa);
    auto output = graph[0].detach();
    ctx->saved_data["graph"] = graph;  // output, query, key, value
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto graph = ctx->saved_data["graph"].toTensorVector();
    std::vector<torch::Tensor> inputs;
    for (size_t i = 1; i < graph.size(); ++i) {
      if (graph[i].requires_grad())
        inputs.push_back(graph[i]);
    }
    variable_list result(6);  // one per forward argument
    if (!grads[0].defined() || inputs.empty())
      return result;
    const SingleThreadedBlas single_threaded_blas;
    // Kept for a second backward through the outer graph (retain_graph); freed with the node.
    const auto input_grads = torch::autograd::grad({graph[0]}, inputs, {grads[0]},
                                                   /*retain_graph=*/true);
    for (size_t i = 1, next = 0; i < graph.size(); ++i) {
      if (graph[i].requires_grad())
        result[i - 1] = input_grads[next++];
    }
    return result;
  }
};

// Whether LibTorch would run its CPU flash kernel on more than one thread, where the BLAS
// needs pinning (dropout, which the flash kernel lacks, sends it to the math path).
bool sdpa_runs_parallel_flash(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const c10::optional<at::Tensor>& visible,
                              double dropout_p, bool is_causal, bool enable_gqa) {
  if (!query.device().is_cpu() || worker_count(2, query.device()) < 2)
    return false;
  const auto backend = at::_fused_sdp_choice(query, key, value, visible, dropout_p, is_causal,
                                             /*scale=*/c10::nullopt, enable_gqa);
  return backend == static_cast<int64_t>(at::SDPBackend::flash_attention);
}
#endif

#if TORCH_VERSION_MAJOR >= 2
// LibTorch's SDPA on (b, h, n, hd) queries and (b, g, m, hd) keys and values, g dividing h,
// with the BLAS pinned where LibTorch's CPU flash kernel would oversubscribe the cores.
torch::Tensor run_sdpa(const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, const c10::optional<at::Tensor>& visible,
                       double dropout_p, bool is_causal) {
  const int64_t group_size = query.size(1) / key.size(1);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  const bool enable_gqa = group_size > 1;
  if (sdpa_runs_parallel_flash(query, key, value, visible, dropout_p, is_causal, enable_gqa)) {
    const bool any_grad = query.requires_grad() || key.requires_grad() || value.requires_grad();
    if (torch::GradMode::is_enabled() && any_grad)
      return SingleThreadedBlasSdpa::apply(query, key, value, visible, is_causal, enable_gqa);
    const SingleThreadedBlas single_threaded_blas;
    return at::scaled_dot_product_attention(query, key, value, visible, dropout_p, is_causal,
                                            /*scale=*/c10::nullopt, enable_gqa);
  }
  return at::scaled_dot_product_attention(query, key, value, visible, dropout_p, is_causal,
                                          /*scale=*/c10::nullopt, enable_gqa);
#else
  // No grouped-query support before 2.5: the key/value heads repeated for their groups.
  return at::scaled_dot_product_attention(query, key.repeat_interleave(group_size, -3),
                                          value.repeat_interleave(group_size, -3), visible,
                                          dropout_p, is_causal);
#endif
}
#endif

}  // namespace

bool libtorch_has_sdpa() {
  return TORCH_VERSION_MAJOR >= 2;
}

bool flash_kernel_available(const torch::Device& device) {
#ifdef ATTNKIT_HAS_FLASH_OP
  if (!device.is_cuda() || !torch::cuda::is_available())
    return false;
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, bool> known;  // per GPU: its architecture decides
  const std::lock_guard<std::mutex> lock(mutex);
  const auto index = indexed_device(device).index();
  const auto found = known.find(index);
  if (found != known.end())
    return found->second;
  // One probe of 8 tokens: LibTorch refuses where it was built without flash or the GPU
  // lacks it (before sm80).
  bool works = true;
  try {
    const torch::NoGradGuard no_grad;
    const auto on = torch::TensorOptions().device(torch::Device(torch::kCUDA, index));
    const auto tokens = torch::zeros({8, 1, 8}, on.dtype(torch::kBFloat16));
    const auto cu = torch::tensor({0, 8}, torch::kInt32).to(on.device());
    at::_flash_attention_forward(tokens, tokens, tokens, cu, cu, 8, 8, 0.0,
                                 /*is_causal=*/false, /*return_debug_mask=*/false);
  } catch (const c10::Error&) {
    works = false;
  }
  known[index] = works;
  return works;
#else
  (void)device;
  return false;
#endif
}

torch::Tensor flash_attention(const torch::Tensor& query, const torch::Tensor& key,
                              const torch::Tensor& value, const FlashSegments& segments,
                              const FusedArguments& arguments, double scale) {
#ifdef ATTNKIT_HAS_FLASH_OP
  const bool causal = arguments.mask.causal;
  const int64_t window = arguments.mask.window;
  const double dropout_p = arguments.dropout_p;
  // Both sides of a window: the keys before each query (bottom-right aligned) and none after;
  // -1 is FlashAttention's "no limit".
  const c10::optional<int64_t> left(window > 0 ? window - 1 : -1);
  const c10::optional<int64_t> right(window > 0 ? 0 : -1);
  if (segments.cu_q.defined()) {
    return std::get<0>(at::_flash_attention_forward(
        query, key, value, segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, dropout_p,
        causal, /*return_debug_mask=*/false, scale, left, right));
  }
  // (b, h, n, hd) -> (b, n, h, hd): the batched form's layout, last dimension contiguous
  const auto batched = [](const torch::Tensor& x) { return x.transpose(1, 2); };
  const auto out = std::get<0>(at::_flash_attention_forward(
      batched(query), batched(key), batched(value), c10::nullopt, c10::nullopt, query.size(2),
      key.size(2), dropout_p, causal, /*return_debug_mask=*/false, scale, left, right));
  return out.transpose(1, 2);  // (b, n, h, hd) -> (b, h, n, hd)
#else
  (void)query, (void)key, (void)value, (void)segments, (void)arguments, (void)scale;
  TORCH_CHECK(false, "[flash_attention] needs a CUDA LibTorch 2.6 or later");
#endif
}

torch::Tensor sdpa_attention(const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value, const FusedArguments& arguments) {
  const bool causal = arguments.mask.causal;
  const int64_t query_offset = arguments.mask.query_offset;
  const int64_t window_size = arguments.mask.window;
  const double dropout_p = arguments.dropout_p;
#if TORCH_VERSION_MAJOR >= 2
  // Flash / memory-efficient kernels on CUDA, a flash kernel on CPU (from 2.1). LibTorch's
  // is_causal aligns the mask top-left whatever n and m are, and knows no window, so it
  // serves query_offset 0 without a window; a one-token decode step (query 0 sees every key)
  // needs no mask, and anything else an explicit one.
  const int64_t num_queries = query.size(-2), num_keys = key.size(-2);
  const c10::optional<int64_t> window =
      window_size > 0 ? c10::optional<int64_t>(window_size) : c10::nullopt;
  // Whether the window hides a key from some query: the last query's distance to key 0.
  const bool window_masks = window.has_value() && query_offset + num_queries - 1 >= *window;
  bool is_causal = false;
  c10::optional<at::Tensor> visible;  // true = attend
  if (causal) {
    if (query_offset == 0 && !window_masks) {
      is_causal = true;
    } else if (query_offset < num_keys - 1 || window_masks) {
      visible = functional::causal_mask(num_queries, num_keys, query.device(), query_offset, window)
                    .logical_not();
    }
  }
  return run_sdpa(query, key, value, visible, dropout_p, is_causal);
#else
  // LibTorch 1.13 has no fused attention kernel: attnkit's chunked kernel on the CPU (faster
  // than the math core, memory linear in n, parallel over heads and blocks), the math core
  // elsewhere.
  const int64_t group_size = query.size(1) / key.size(1);
  Mask mask;
  if (causal) {
    mask = Mask::causal(query_offset);
    if (window_size > 0)
      mask = mask.sliding_window(window_size);
  }
  if (query.device().is_cpu()) {
    return chunked_kernel(
        query, key, value,
        functional::AttentionOptions().mask(mask).dropout_p(dropout_p).training(dropout_p > 0.0));
  }
  MathMasking masking;
  if (causal) {
    masking.allowed = functional::causal_mask(
                          query.size(2), key.size(2), query.device(), query_offset,
                          window_size > 0 ? c10::optional<int64_t>(window_size) : c10::nullopt)
                          .logical_not();
  }
  return math_attention(query, key.repeat_interleave(group_size, 1),
                        value.repeat_interleave(group_size, 1), masking, c10::nullopt, dropout_p,
                        dropout_p > 0.0)
      .context;
#endif
}

torch::Tensor sdpa_masked_attention(const torch::Tensor& query, const torch::Tensor& key,
                                    const torch::Tensor& value, const torch::Tensor& visible,
                                    const torch::Tensor& bias, double dropout_p) {
  // A query that sees no key gets zeros, as everywhere in attnkit, where SDPA would give NaN:
  // such a row sees every key, and its output is zeroed (so are its gradients).
  torch::Tensor sees_some, attend;
  if (visible.defined()) {
    sees_some = visible.any(-1, /*keepdim=*/true);  // (b or 1, h or 1, n, 1)
    attend = visible.logical_or(sees_some.logical_not());
  }
  // SDPA takes one mask: the bias where a key may be seen, -inf where not.
  torch::Tensor mask = attend;
  if (bias.defined()) {
    const auto wide = bias.to(query.scalar_type());
    mask = attend.defined()
               ? wide.masked_fill(attend.logical_not(), -std::numeric_limits<double>::infinity())
               : wide;
  }
#if TORCH_VERSION_MAJOR >= 2
  auto context =
      run_sdpa(query, key, value, mask.defined() ? c10::optional<at::Tensor>(mask) : c10::nullopt,
               dropout_p, /*is_causal=*/false);
#else
  // No SDPA: the math core with the same mask and bias (the planner never picks this kernel
  // here).
  const int64_t group_size = query.size(1) / key.size(1);
  MathMasking masking;
  masking.allowed = attend;
  masking.bias = bias;
  auto context = math_attention(query, key.repeat_interleave(group_size, 1),
                                value.repeat_interleave(group_size, 1), masking, c10::nullopt,
                                dropout_p, dropout_p > 0.0)
                     .context;
#endif
  return sees_some.defined() ? context * sees_some.to(context.scalar_type()) : context;
}

// The specs of the kernels on LibTorch's SDPA and flash ops.

namespace {

// What LibTorch's flash kernel runs of a call: the batched form with a causal window or at the
// offset m - n (its bottom-right alignment), or the call's segments. Plain causal and no mask
// are SDPA's, which runs the same kernel.
struct FlashPlan {
  int64_t window = 0;
  std::optional<VarlenLayout> layout;
};

std::optional<FlashPlan> flash_plan(const KernelInput& input) {
  const int64_t n = input.query_tokens(), m = input.key_tokens();
  if (const auto& span = input.causal_span()) {
    if (!span->causal || (span->window == 0 && span->query_offset == 0))
      return std::nullopt;
    if (n > m || span->query_offset != m - n)
      return std::nullopt;
    return FlashPlan{span->window, std::nullopt};
  }
  if (input.call.step != StepKind::kSequence)
    return std::nullopt;
  auto layout = varlen_layout(input.mask(), input.call.query.size(0), n, m);
  if (!layout)
    return std::nullopt;
  return FlashPlan{0, std::move(layout)};
}

// Why the flash route declines `input`; `plan` gets its plan once it has one.
std::string flash_declines(const KernelInput& input, std::optional<FlashPlan>& plan) {
  const auto& call = input.call;
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
  plan = flash_plan(input);
  if (!plan) {
    return c10::str(
        "the flash route takes sliding windows and causal masks at the offset m - n, and key "
        "padding or documents alone or with causal(), not ",
        input.mask().to_string());
  }
  if (!flash_kernel_available(q.device())) {
    return "LibTorch's flash kernel is not in this LibTorch (a CUDA build, 2.6 or later) or "
           "not on this GPU (sm80 or later)";
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

std::string sdpa_masked_declines(const KernelInput& input) {
  const auto& call = input.call;
  const bool has_score_mod = static_cast<bool>(call.options.score_mod());
  if (has_score_mod && additive_score(call) == nullptr) {
    return "the fused backend has no score functions (score_mod) but additive biases on "
           "LibTorch 2.x (score_mods::alibi, score_mods::relative_position_bias)";
  }
  auto why = sdpa_routes_decline(input);
  if (!why.empty())
    return why;
  const auto& mask = input.mask();
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
  const int64_t bytes = rows * per_entry * input.query_tokens() * input.key_tokens();
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
  return libtorch_cpu_nan_declines(input);  // last: it reads the query and key
}

functional::AttentionOutput run_sdpa_masked(const KernelInput& input) {
  const auto& call = input.call;
  const auto &q = call.query, &k = call.key, &v = call.value;
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), m = k.size(2);
  const auto& mask = input.mask();
  const auto visible = mask.is_none() ? torch::Tensor() : mask.dense(b, h, n, m, q.device());
  torch::Tensor bias;  // (1 or b, 1 or h, n, m)
  if (const auto* additive = additive_score(call)) {
    const auto index = torch::dtype(torch::kInt64).device(q.device());
    bias = additive->bias(
        torch::zeros({}, q.options()), torch::arange(b, index).view({-1, 1, 1, 1}),
        torch::arange(h, index).view({1, -1, 1, 1}), torch::arange(n, index).view({1, 1, -1, 1}),
        torch::arange(m, index).view({1, 1, 1, -1}));
  }
  return {sdpa_masked_attention(q, k, v, visible, bias, input.dropout_p()), {}};
}

// Why LibTorch's CPU flash kernel cannot run a split call (the operators'), "" when it can:
// from 2.5 on, on the CPU, without a mask or causal from query 0, any scale, no score
// function and no dropout.
std::string cpu_flash_split_declines(const KernelInput& input) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  const auto& call = input.call;
  if (!call.query.is_cpu())
    return "a split call runs on LibTorch's flash kernel on the CPU only";
  if (call.with_weights)
    return "the fused backend returns no weights (the math backend builds them)";
  if (call.options.score_mod())
    return "the fused backend has no score functions (score_mod)";
  const auto& span = input.causal_span();
  if (!span || span->window > 0 || span->query_offset != 0) {
    return c10::str(
        "a split call runs on LibTorch's flash kernel without a mask or causal "
        "from query 0 only, not ",
        input.mask().to_string());
  }
  if (input.dropout_p() > 0.0)
    return "LibTorch's CPU flash kernel has no dropout of its own seed";
  if (call.value.size(3) != call.query.size(3)) {
    return c10::str("LibTorch's CPU flash kernel takes values of the query's head size, not ",
                    call.query.size(3), " and ", call.value.size(3));
  }
  if (call.query.numel() == 0 || call.key.numel() == 0)
    return "an empty call has nothing to tile";
  return "";
#else
  (void)input;
  return "a split call runs on LibTorch's CPU flash kernel from LibTorch 2.5 on";
#endif
}

// LibTorch's CPU flash kernel as a split forward and backward: its log-sum-exp is the natural
// log of each row's sum of exp(scaled scores), as the chunked kernel's, and its causal mask is
// aligned top-left. It has no grouped-query heads: the key/value heads are repeated for their
// groups and their gradients summed back. The BLAS is pinned to one thread (run_sdpa).
SplitKernel cpu_flash_split(bool causal) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  const auto repeated = [](const torch::Tensor& kv, int64_t group_size) {
    return group_size == 1 ? kv : kv.repeat_interleave(group_size, 1);
  };
  return {[causal, repeated](const KernelInput& in) {
            const auto& call = in.call;
            const int64_t group_size = call.query.size(1) / call.key.size(1);
            const SingleThreadedBlas single_threaded_blas;
            auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
                call.query, repeated(call.key, group_size), repeated(call.value, group_size),
                /*dropout_p=*/0.0, causal, /*attn_mask=*/c10::nullopt, in.scale());
            return SplitOutputs{out, lse, {}};
          },
          [causal, repeated](const KernelInput& in, const SplitSaved& saved) {
            const auto& call = in.call;
            const int64_t b = call.key.size(0), g = call.key.size(1);
            const int64_t group_size = call.query.size(1) / g;
            const SingleThreadedBlas single_threaded_blas;
            auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                saved.grad_out, call.query, repeated(call.key, group_size),
                repeated(call.value, group_size), saved.out, saved.lse, /*dropout_p=*/0.0, causal,
                /*attn_mask=*/c10::nullopt, in.scale());
            // (b, g * group_size, m, d) -> (b, g, group_size, m, d), summed over the group
            const auto summed = [&](const torch::Tensor& grad) {
              return group_size == 1
                         ? grad
                         : grad.view({b, g, group_size, grad.size(2), grad.size(3)}).sum(2);
            };
            return std::vector<torch::Tensor>{dq, summed(dk), summed(dv)};
          }};
#else
  (void)causal;
  return {};
#endif
}

}  // namespace

KernelSpec flash_spec() {
  return {"flash", AttentionBackend::kFused, /*runs_16bit_cuda_in_its_dtype=*/true,
          [](const KernelInput& input) {
            std::optional<FlashPlan> plan;
            auto why = flash_declines(input, plan);
            return KernelDecision{
                std::move(why), [plan = plan.value_or(FlashPlan{})](const KernelInput& in) {
                  const auto& call = in.call;
                  const FusedArguments arguments{
                      CausalSpan{/*causal=*/true, /*query_offset=*/0, plan.window}, in.dropout_p()};
                  if (plan.layout) {
                    return functional::AttentionOutput{
                        flash_varlen_attention(call.query, call.key, call.value, *plan.layout,
                                               in.scale(), in.dropout_p()),
                        {}};
                  }
                  return functional::AttentionOutput{
                      flash_attention(call.query, call.key, call.value, FlashSegments{}, arguments,
                                      in.scale()),
                      {}};
                }};
          }};
}

KernelSpec sdpa_spec() {
  return {"sdpa",
          AttentionBackend::kFused,
          /*runs_16bit_cuda_in_its_dtype=*/libtorch_has_sdpa(),
          [](const KernelInput& input) {
            const auto span = input.causal_span().value_or(CausalSpan{});
            // A split call (the operators) runs on LibTorch's CPU flash kernel, which takes
            // any scale; a whole call on its SDPA.
            auto why =
                input.call.split ? cpu_flash_split_declines(input) : fused_kernels_decline(input);
            if (why.empty())
              why = libtorch_cpu_nan_declines(input);
            auto split =
                input.call.split && why.empty() ? cpu_flash_split(span.causal) : SplitKernel{};
            return KernelDecision{
                std::move(why),
                [span](const KernelInput& in) {
                  const auto& call = in.call;
                  return functional::AttentionOutput{
                      sdpa_attention(call.query, call.key, call.value, {span, in.dropout_p()}), {}};
                },
                std::move(split)};
          },
          /*takes_sinks=*/false,
          /*runs_16bit_cpu_in_its_dtype=*/false,
          /*yields_16bit_cpu_to_matrix_units=*/true};
}

KernelSpec sdpa_masked_spec() {
  return {"sdpa_masked", AttentionBackend::kFused,
          /*runs_16bit_cuda_in_its_dtype=*/libtorch_has_sdpa(), [](const KernelInput& input) {
            return KernelDecision{sdpa_masked_declines(input), run_sdpa_masked};
          }};
}

}  // namespace attnkit::detail
