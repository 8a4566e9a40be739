// Attention sinks on the kernels with a separate forward and backward (kernels.h: sinks_spec).
//
// A sink is a key whose score is sinks[h] and whose value is zero. From a split call without
// it, (out, lse), the call with it follows exactly: lse_s = log(exp(lse) + exp(sink)) and
// out_s = out * exp(lse - lse_s). Backward is the split kernel's own, given out_s and lse_s:
// it recomputes the weights as exp(s - lse_s), which are the weights with the sink, and its
// row term D = rowsum(grad * out_s) is theirs too. The sink's gradient is the zero value's:
// -sum over rows of exp(sink - lse_s) * D. So training with sinks keeps the tiled kernels'
// memory, linear in n, where the math core would build every (n, m) score.

#include "core/kernels/sink_attention.h"

#include <limits>

#include "core/base/lse_merge.h"
#include "core/plan/planner.h"
#include "core/scores/row_variants.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The call without its sinks, as a split call, for the autograd function to keep.
struct SinklessCall : torch::CustomClassHolder {
  AttentionCall call;
};

c10::intrusive_ptr<SinklessCall> sinkless(const AttentionCall& call) {
  auto inner = c10::make_intrusive<SinklessCall>();
  inner->call = call;
  inner->call.options.sinks({});
  inner->call.split = true;
  inner->call.with_weights = false;
  return inner;
}

struct SinkAttention : public torch::autograd::Function<SinkAttention> {
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<SinklessCall> inner,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& sinks,
                               at::TensorList parameters) {
    auto call = inner->call;
    call.query = q;
    call.key = k;
    call.value = v;
    const auto result = run_split_forward(call);
    const auto lse = as_log_weight(result.lse);  // (b, h, n)
    const auto sink = sinks.to(lse.scalar_type()).view({1, -1, 1});
    // The keys' attention merged with the sink's, which adds weight and no value: the keys keep
    // their share of each row, (b, h, n, 1).
    const auto merge = lse_merge(lse, sink.expand_as(lse));
    const auto out = result.out * merge.kept.to(result.out.scalar_type());
    variable_list to_save{q, k, v, sinks, out, merge.total};
    to_save.insert(to_save.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(to_save);
    ctx->saved_data["call"] = c10::IValue::make_capsule(inner);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto capsule = ctx->saved_data["call"].toCapsule();
    auto call = static_cast<const SinklessCall*>(capsule.get())->call;
    call.query = saved[0];
    call.key = saved[1];
    call.value = saved[2];
    const auto& sinks = saved[3];
    const auto& out = saved[4];
    const auto& lse = saved[5];
    const std::vector<torch::Tensor> parameters(saved.begin() + 6, saved.end());
    const auto& grad = grads[0];
    auto computed = run_split_backward(call, {out, lse, grad, parameters});
    // The sink's weight in each row times the row term D, summed over batch and rows: (h).
    const auto rows = (grad.to(lse.scalar_type()) * out.to(lse.scalar_type())).sum(-1);
    const auto sink_weight = (sinks.to(lse.scalar_type()).view({1, -1, 1}) - lse).exp();
    const auto grad_sinks =
        -(sink_weight * rows).sum(std::vector<int64_t>{0, 2}).to(sinks.scalar_type());
    variable_list grads_in{torch::Tensor(), computed[0], computed[1], computed[2], grad_sinks};
    grads_in.insert(grads_in.end(), computed.begin() + 3, computed.end());
    return grads_in;
  }
};

std::string sinks_declines(const KernelInput& input) {
  const auto& call = input.call;
  if (!call.options.sinks().defined())
    return "the sinks kernel serves calls with attention sinks";
  if (call.split)
    return "the sinks kernel is not itself a split call's kernel";
  if (call.step != StepKind::kSequence)
    return "the sinks kernel serves whole sequences (cached steps: the decode kernel, the math "
           "core)";
  if (input.dropout_p() > 0.0)
    return "the sinks kernel has no dropout (a split call's backward cannot redraw it)";
  if (call.with_weights)
    return "the sinks kernel returns no weights";
  const auto why = split_call_lacks(sinkless(call)->call);
  return why.empty() ? "" : "the sinks kernel runs on a split kernel, and " + why;
}

functional::AttentionOutput run_sinks(const KernelInput& input) {
  const auto& call = input.call;
  std::vector<torch::Tensor> parameters;
  if (const auto variant = score_variant_of(call.options.score_mod())) {
    for (const auto& t : variant->tensors()) {
      if (t.is_floating_point() && t.requires_grad() && torch::GradMode::is_enabled())
        parameters.push_back(t);
    }
  }
  return {SinkAttention::apply(sinkless(call), call.query, call.key, call.value,
                               call.options.sinks(), at::TensorList(parameters)),
          {}};
}

}  // namespace

KernelSpec sinks_spec() {
  // The chunked family's: it runs the fused tile kernel's split path.
  return {"sinks", AttentionBackend::kChunked, /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            return KernelDecision{sinks_declines(input), run_sinks};
          },
          /*takes_sinks=*/true};
}

}  // namespace attnkit::detail
