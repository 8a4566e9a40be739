// The loop-nest kernel's entry points (the kernel itself: loop_nest_kernel.cpp): autograd
// functions over split heads and over a packed QKV projection, the ragged inference step,
// and the public fused_attention / fused_packed_attention.

#include "core/kernels/loop_nest_attention.h"

#include <cmath>
#include <string>
#include <vector>

#include "core/base/attention_layout.h"
#include "core/base/autocast.h"
#include "core/base/checks.h"
#include "core/kernels/loop_nest_kernel.h"
#include "core/kernels/sdpa_kernel.h"

namespace attnkit::detail {

namespace {

using loop_nest::empty_heads_interleaved;
using loop_nest::run_backward;
using loop_nest::run_forward;
using loop_nest::sum_over_groups;
using loop_nest::unit_stride_slices;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LoopNestFunction : public torch::autograd::Function<LoopNestFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool causal, int64_t query_offset,
                               int64_t window, double dropout_p) {
    const auto q4 = unit_stride_slices(q), k4 = unit_stride_slices(k), v4 = unit_stride_slices(v);
    auto out4 =
        empty_heads_interleaved(q4.size(0), q4.size(1), q4.size(2), v4.size(3), q.options());
    const auto [weights, keep] =
        run_forward(q4, k4, v4, out4, causal, query_offset, window, dropout_p);
    ctx->save_for_backward({q, k, v, weights, keep});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["query_offset"] = query_offset;
    ctx->saved_data["window"] = window;
    return shaped_like(out4, q);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto q4 = unit_stride_slices(saved[0]), k4 = unit_stride_slices(saved[1]),
               v4 = unit_stride_slices(saved[2]);
    const int64_t outer = q4.size(0), heads = q4.size(1);
    auto grad_q4 = empty_heads_interleaved(outer, heads, q4.size(2), q4.size(3), q4.options());
    auto grad_k4 = empty_heads_interleaved(outer, heads, k4.size(2), k4.size(3), k4.options());
    auto grad_v4 = empty_heads_interleaved(outer, heads, v4.size(2), v4.size(3), v4.options());
    run_backward(q4, k4, v4, unit_stride_slices(grads[0]), saved[3], saved[4],
                 ctx->saved_data["causal"].toBool(), ctx->saved_data["query_offset"].toInt(),
                 ctx->saved_data["window"].toInt(), grad_q4, grad_k4, grad_v4);
    const int64_t kv_heads = k4.size(1);
    variable_list grads_in{shaped_like(grad_q4, saved[0]),
                           shaped_like(sum_over_groups(grad_k4, kv_heads), saved[1]),
                           shaped_like(sum_over_groups(grad_v4, kv_heads), saved[2])};
    grads_in.resize(7);  // none for the four non-tensor arguments
    return grads_in;
  }
};

// The (b, h, n, hd) views of part `index` (0 queries, 1 keys, 2 values) of a packed
// (b, n, 3 * h * hd) tensor: no copy.
torch::Tensor packed_part(const torch::Tensor& packed, int64_t index, int64_t heads) {
  const int64_t b = packed.size(0), n = packed.size(1), width = packed.size(2) / 3;
  // (b, n, width) -> (b, n, h, hd) -> (b, h, n, hd)
  return packed.narrow(2, index * width, width).view({b, n, heads, width / heads}).transpose(1, 2);
}

// Attention on packed projections: one input, so backward writes the three gradients into
// one (b, n, 3 * d) tensor instead of autograd concatenating three.
struct PackedLoopNestFunction : public torch::autograd::Function<PackedLoopNestFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& qkv, int64_t heads,
                               bool causal, int64_t window, double dropout_p) {
    const int64_t b = qkv.size(0), n = qkv.size(1), width = qkv.size(2) / 3;
    auto out4 = empty_heads_interleaved(b, heads, n, width / heads, qkv.options());
    const auto [weights, keep] = run_forward(packed_part(qkv, 0, heads), packed_part(qkv, 1, heads),
                                             packed_part(qkv, 2, heads), out4, causal,
                                             /*query_offset=*/0, window, dropout_p);
    ctx->save_for_backward({qkv, weights, keep});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["window"] = window;
    // (b, h, n, hd) laid out as (b, n, h, hd) -> (b, n, h * hd): a view
    return out4.transpose(1, 2).view({b, n, width});
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    const auto& qkv = saved[0];
    const int64_t heads = ctx->saved_data["heads"].toInt();
    auto grad_qkv = torch::empty_like(qkv, torch::MemoryFormat::Contiguous);
    auto grad_q4 = packed_part(grad_qkv, 0, heads), grad_k4 = packed_part(grad_qkv, 1, heads),
         grad_v4 = packed_part(grad_qkv, 2, heads);
    const auto& grad_out = grads[0];  // (b, n, h * hd)
    // (b, n, h * hd) -> (b, n, h, hd) -> (b, h, n, hd)
    const auto grad_out4 = unit_stride_slices(
        grad_out.reshape({grad_out.size(0), grad_out.size(1), heads, -1}).transpose(1, 2));
    run_backward(packed_part(qkv, 0, heads), packed_part(qkv, 1, heads), packed_part(qkv, 2, heads),
                 grad_out4, saved[1], saved[2], ctx->saved_data["causal"].toBool(),
                 /*query_offset=*/0, ctx->saved_data["window"].toInt(), grad_q4, grad_k4, grad_v4);
    return {grad_qkv, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor loop_nest_attention(const torch::Tensor& query, const torch::Tensor& key,
                                  const torch::Tensor& value, const FusedArguments& arguments) {
  const auto& mask = arguments.mask;
  return LoopNestFunction::apply(query, key, value, mask.causal, mask.query_offset, mask.window,
                                 arguments.dropout_p);
}

torch::Tensor loop_nest_packed_attention(const torch::Tensor& qkv, int64_t num_heads,
                                         const FusedArguments& arguments) {
  return PackedLoopNestFunction::apply(qkv, num_heads, arguments.mask.causal, arguments.mask.window,
                                       arguments.dropout_p);
}

bool loop_nest_fits(int64_t num_queries, int64_t num_keys, const torch::TensorOptions& options) {
  const auto dtype = options.dtype();
  return options.device().is_cpu() && (dtype == torch::kFloat || dtype == torch::kDouble) &&
         num_queries * num_keys <= kLoopNestMaxTile;
}

bool ragged_loop_nest_fits(const torch::Tensor& query, const torch::Tensor& keys,
                           const torch::Tensor& values) {
  const auto dtype = query.scalar_type();
  const bool records_history =
      torch::GradMode::is_enabled() &&
      (query.requires_grad() || keys.requires_grad() || values.requires_grad());
  return query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && !records_history &&
         keys.scalar_type() == dtype && values.scalar_type() == dtype && keys.device().is_cpu() &&
         values.device().is_cpu() && query.size(1) % keys.size(1) == 0 &&
         loop_nest_fits(query.size(2), keys.size(2), query.options());
}

torch::Tensor ragged_loop_nest_attention(const torch::Tensor& query, const torch::Tensor& keys,
                                         const torch::Tensor& values, const RaggedRows& rows) {
  TORCH_CHECK(ragged_loop_nest_fits(query, keys, values),
              "[ragged_loop_nest_attention] expected CPU float or double (b, h, n, hd) queries "
              "and (b, g, m, hd) keys and values of one dtype, n * m <= ",
              kLoopNestMaxTile, " and no autograd; got query ", shape_string(query), " ",
              query.scalar_type(), " on ", query.device(), ", keys ", shape_string(keys));
  const auto offsets = rows.query_offsets.to(torch::kCPU, torch::kInt64).contiguous();
  const auto ends = rows.key_ends.to(torch::kCPU, torch::kInt64).contiguous();
  const loop_nest::RowBounds bounds{offsets.data_ptr<int64_t>(), ends.data_ptr<int64_t>()};
  const auto q4 = unit_stride_slices(query), k4 = unit_stride_slices(keys),
             v4 = unit_stride_slices(values);
  auto out4 =
      empty_heads_interleaved(q4.size(0), q4.size(1), q4.size(2), v4.size(3), query.options());
  run_forward(q4, k4, v4, out4, /*causal=*/true, /*query_offset=*/0, rows.window,
              /*dropout_p=*/0.0, &bounds);
  return out4;
}

// The loop-nest kernels' specs.

namespace {

std::string ragged_loop_nest_declines(const KernelInput& input) {
  const auto& call = input.call;
  if (call.step != StepKind::kRagged)
    return "the ragged loop nest serves ragged steps only";
  if (input.query_tokens() == 1)
    return "a one-query ragged step is the decode kernel's";
  if (!call.options.mask().is_none() || call.options.score_mod() || !input.has_default_scale() ||
      call.with_weights) {
    return "the ragged loop nest takes no mask, score function, scale or weights";
  }
  if (!ragged_loop_nest_fits(call.query, call.key, call.value)) {
    return c10::str("the ragged loop nest needs CPU float32 or float64 inputs, n * m <= ",
                    kLoopNestMaxTile, " and no autograd to record");
  }
  return "";
}

// What the loop nest on split heads or on a packed projection lacks beyond what every fused
// kernel lacks, then what it leaves to faster kernels unless the call names it.
std::string loop_nest_declines(const KernelInput& input) {
  auto why = fused_kernels_decline(input);
  if (!why.empty())
    return why;
  const auto& query = input.call.query;
  if (!query.is_cpu() ||
      !(query.scalar_type() == torch::kFloat || query.scalar_type() == torch::kDouble))
    return "the loop nest needs CPU float32 or float64 inputs";
  if (!input.call.options.kernel().empty())
    return "";
  if (libtorch_has_sdpa())
    return "LibTorch 2.x runs the fused backend on its own SDPA";
  if (!loop_nest_fits(input.query_tokens(), input.key_tokens(), query.options()))
    return c10::str("the loop nest is the fused backend only for n * m <= ", kLoopNestMaxTile);
  return "";
}

std::string packed_loop_nest_declines(const KernelInput& input) {
  if (!input.call.packed_qkv.defined())
    return "the packed loop nest needs the packed QKV projection";
  const auto& span = input.causal_span();
  if (span && span->query_offset != 0)
    return "the packed loop nest's queries and keys are the same tokens (query offset 0)";
  return loop_nest_declines(input);
}

// The arguments of a fused kernel: the call's causal span (none where it has none: what a
// mutant runs) and its dropout.
FusedArguments fused_arguments(const KernelInput& input) {
  return {input.causal_span().value_or(CausalSpan{}), input.dropout_p()};
}

}  // namespace

KernelSpec ragged_loop_nest_spec() {
  return {"ragged_loop_nest", AttentionBackend::kAuto, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            return KernelDecision{
                ragged_loop_nest_declines(input), [](const KernelInput& in) {
                  const auto& call = in.call;
                  TORCH_CHECK(call.step == StepKind::kRagged,
                              "[ragged_loop_nest] needs the rows' query offsets and key ends");
                  return functional::AttentionOutput{
                      ragged_loop_nest_attention(call.query, call.key, call.value, call.ragged),
                      {}};
                }};
          }};
}

KernelSpec packed_loop_nest_spec() {
  return {"packed_loop_nest", AttentionBackend::kFused, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            auto why = packed_loop_nest_declines(input);
            return KernelDecision{
                std::move(why), [arguments = fused_arguments(input)](const KernelInput& in) {
                  const auto& q = in.call.query;
                  TORCH_CHECK(in.call.packed_qkv.defined(),
                              "[packed_loop_nest] needs the packed QKV projection");
                  const auto merged =
                      loop_nest_packed_attention(in.call.packed_qkv, q.size(1), arguments);
                  // (b, n, h * hd) -> (b, n, h, hd) -> (b, h, n, hd): a view
                  return functional::AttentionOutput{
                      merged.view({q.size(0), q.size(2), q.size(1), -1}).transpose(1, 2), {}};
                }};
          }};
}

KernelSpec loop_nest_spec() {
  return {"loop_nest", AttentionBackend::kFused, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            auto why = loop_nest_declines(input);
            return KernelDecision{
                std::move(why), [arguments = fused_arguments(input)](const KernelInput& in) {
                  const auto& call = in.call;
                  return functional::AttentionOutput{
                      loop_nest_attention(call.query, call.key, call.value, arguments), {}};
                }};
          }};
}

}  // namespace attnkit::detail
