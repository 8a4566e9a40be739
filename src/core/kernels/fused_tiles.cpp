// The fused CPU tile kernel: the chunked kernel's walk over a block mask's tiles (tile_walk.h)
// with everything between its matrix products done in the tile's rows. Per query block and
// key tile: S = (scale Q) K^T by one GEMM, then, row by row while the row is in L1, the score
// function (a ScoreVariant, row_variants.h: softcap, ALiBi, a relative-position table), the mask
// bits (a partial tile only), the online softmax (running maximum and sum, the output rows
// corrected), and then P V by one GEMM into the output block (P times the tile's dropout
// factors, with dropout). Backward recomputes P from the log-sum-exp in the same rows, and its
// five products per tile are GEMMs on the tile.
//
// Why: the chunked kernel spends about 16 LibTorch operations per tile, each a pass over the
// whole tile (a few MiB, beyond L1 and often L2); here the tile's rows are read once after
// each GEMM, and the only LibTorch calls in the tile loop are the GEMMs themselves
// (at::mm_out / addmm_ on the inputs in place, which reach the BLAS) and, for a partial tile
// of a mask that has no host form (a tensor, a mask_mod), its entries (Mask::tile_allowed);
// the named kinds and Python's packed tiles write theirs directly (MaskNode::fill_tile).
//
// Layout: float32 or float64, or bfloat16/float16 on the CPU's matrix units (matrix_units.h;
// elsewhere a 16-bit call arrives as float32: the planner computes it so; AVX2 row loops for
// float32 rows where the CPU has them, portable loops otherwise), inputs as
// (outer, heads, n, f) slices with unit-stride rows, read in place. Grouped-query attention
// reads each key/value head for its query heads without copies. Forward's tasks are (outer,
// head, query block), the last blocks first; backward's are (outer, key/value head, key
// range), each owning its range's key and value gradients (one range where the pairs are
// enough for the workers; key_ranges.h), with the table's gradient summed in task order
// (every outer slice in one task where a bias over (heads, n, n) is written in place).

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attention_types.h"
#include "core/base/attention_layout.h"
#include "core/base/autocast.h"
#include "core/base/matrix_units.h"
#include "core/kernels/fused_tiles.h"
#include "core/kernels/loop_nest_kernel.h"
#include "core/scores/score_mods.h"

namespace attnkit::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// (..., n, f) -> (outer, heads, n, f) with unit-stride rows (a view when it can be).
torch::Tensor slices_of(const torch::Tensor& t) {
  return loop_nest::unit_stride_slices(t);
}

// The backward of a call whose score function's tensors `parameters` want gradients (each
// one of ScoreVariant::tensors(), or a tensor the function does not read): the gradients of
// q4, k4, v4, then of each parameter (zeros for one the function does not read).
std::vector<torch::Tensor> backward_with_parameters(
    const FusedTileProblem& problem, const torch::Tensor& q4, const torch::Tensor& k4,
    const torch::Tensor& v4, const torch::Tensor& out4, const torch::Tensor& lse,
    const torch::Tensor& grad_out4, const std::vector<torch::Tensor>& parameters) {
  const auto tensors = problem.variant.tensors();
  std::vector<bool> wanted(tensors.size(), false);
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (const auto& parameter : parameters)
      wanted[t] = wanted[t] || parameter.is_same(tensors[t]);
  }
  const auto grads = tiles_backward(problem, q4, k4, v4, out4, lse, grad_out4, wanted);
  std::vector<torch::Tensor> result{grads.query, grads.key, grads.value};
  for (const auto& parameter : parameters) {
    torch::Tensor grad;
    for (size_t t = 0; t < tensors.size() && !grad.defined(); ++t) {
      if (parameter.is_same(tensors[t]))
        grad = grads.tensors[t].to(parameter.options());
    }
    result.push_back(grad.defined() ? grad : torch::zeros_like(parameter));
  }
  return result;
}

struct FusedTileAttention : public torch::autograd::Function<FusedTileAttention> {
  static torch::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<FusedTileProblem> problem,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, at::TensorList parameters) {
    const auto result = tiles_forward(*problem, slices_of(q), slices_of(k), slices_of(v));
    // Backward's D reads the output before its rounding (16-bit).
    SavedTiles{problem,
               q,
               k,
               v,
               result.out_float.defined() ? result.out_float : result.out,
               result.lse,
               parameters.vec()}
        .save(ctx);
    return shaped_like(result.out, q);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = SavedTiles::load(ctx);
    const auto& q = saved.query;
    const auto& k = saved.key;
    const auto& v = saved.value;
    auto computed = backward_with_parameters(saved.problem_as<FusedTileProblem>(), slices_of(q),
                                             slices_of(k), slices_of(v), saved.out, saved.lse,
                                             slices_of(grads[0]), saved.parameters);
    variable_list grads_in{torch::Tensor(), shaped_like(computed[0], q),
                           shaped_like(computed[1], k), shaped_like(computed[2], v)};
    grads_in.insert(grads_in.end(), computed.begin() + 3, computed.end());
    return grads_in;
  }
};

// What the kernel lacks for `input`: "" or why.
std::string tiles_decline(const KernelInput& input, const std::optional<ScoreVariant>& variant,
                          const std::string& why_not_variant) {
  const auto& call = input.call;
  if (!call.query.device().is_cpu())
    return "the fused tile kernel runs on the CPU";
  const auto dtype = call.query.scalar_type();
  if (is_16bit(call.query)) {
    const auto lacks = cpu_16bit_matmul_lacks(dtype);
    if (!lacks.empty())
      return c10::str("the fused tile kernel multiplies ", dtype,
                      " on the CPU's matrix units only: ", lacks);
    // The units multiply pairs along the inner dimension: head sizes, and the starts of key
    // tiles and key ranges, even.
    const auto& options = call.options;
    const int64_t tokens = std::max(input.query_tokens(), input.key_tokens());
    int64_t query_block = block_for(options.query_block_size(), tokens), kv_block = query_block;
    if (const auto* given = input.mask().block_mask()) {
      query_block = given->q_block_size();
      kv_block = given->kv_block_size();
    }
    const int64_t head_size = call.query.size(-1), value_size = call.value.size(-1);
    const int64_t key_block = block_for(options.key_block_size(), tokens);
    if (head_size % 2 != 0 || value_size % 2 != 0 || key_block % 2 != 0 || query_block % 2 != 0 ||
        kv_block % 2 != 0)
      return c10::str(
          "the fused tile kernel's 16-bit products take even head sizes and blocks, not head "
          "sizes ",
          head_size, " and ", value_size, " with blocks of ", query_block, " queries, ", kv_block,
          " keys and key tiles of ", key_block);
  } else if (dtype != torch::kFloat && dtype != torch::kDouble) {
    return c10::str("the fused tile kernel computes in float32, float64, or 16-bit, not ", dtype);
  }
  if (call.with_weights)
    return "the fused tile kernel returns no weights (the math backend builds them)";
  if (!variant.has_value())
    return c10::str(
        "the fused tile kernel evaluates named score functions and ScoreGraphs "
        "only, not ",
        why_not_variant, " (the chunked kernel evaluates any score function)");
  if (const auto lacks = variant->lacks(call.query.size(1)); !lacks.empty())
    return lacks;
  if (variant->program() != nullptr) {
    // A graph LibTorch refuses on one score (a result of another dtype than the score's, an
    // index out of range) stays with the chunked kernel, which raises LibTorch's error. The
    // score as the kernel holds it: float32 for 16-bit inputs (a float32 bias then adds).
    try {
      const auto zero = torch::zeros({1, 1, 1, 1}, torch::kInt64);
      const auto score_dtype = compute_dtype(call.query);
      apply_score_mod(call.options.score_mod(), torch::zeros({1, 1, 1, 1}, score_dtype),
                      {zero, zero, zero, zero});
    } catch (const c10::Error& error) {
      return c10::str(
          "the fused tile kernel leaves a score graph that fails on one score to "
          "the chunked kernel: ",
          error.what_without_backtrace());
    }
  }
  if (call.step == StepKind::kRagged && input.query_tokens() == 1)
    return "a one-query ragged step runs best on the math core";
  return "";
}

c10::intrusive_ptr<FusedTileProblem> problem_of(const KernelInput& input,
                                                const std::optional<ScoreVariant>& variant) {
  const auto& call = input.call;
  const auto& options = call.options;
  auto problem = c10::make_intrusive<FusedTileProblem>();
  problem->mask = input.mask();
  const int64_t tokens = std::max(input.query_tokens(), input.key_tokens());
  const int64_t query_block = block_for(options.query_block_size(), tokens);
  problem->blocks =
      tile_block_mask(problem->mask, call.query, call.key.size(-2), query_block, torch::kCPU);
  problem->variant = variant.value_or(ScoreVariant{});
  problem->scale = input.scale();
  problem->query_block = query_block;
  problem->key_block = block_for(options.key_block_size(), tokens);
  problem->dropout.p = input.dropout_p();
  if (is_16bit(call.query)) {
    problem->unrounded_weights = call.split ? call.backward_follows : wants_gradient(call);
  }
  // A split call brings its seed (backward is a second call); any other draws one.
  if (problem->dropout.p > 0.0)
    problem->dropout.seed = call.split ? call.dropout_seed : TileDropout::draw_seed();
  return problem;
}

}  // namespace

KernelSpec fused_tiles_spec() {
  return {"fused_tiles",
          AttentionBackend::kChunked,
          /*runs_16bit_cuda_in_its_dtype=*/false,
          [](const KernelInput& input) {
            // A graph's program reads its tensors on the CPU: made for CPU calls only (a CUDA
            // call's bias tensor is not copied to be declined).
            std::string why_not_variant;
            const auto variant =
                input.call.query.device().is_cpu()
                    ? score_variant_of(input.call.options.score_mod(), &why_not_variant)
                    : std::nullopt;
            auto declined = tiles_decline(input, variant, why_not_variant);
            // A declined call makes no block mask here (the planner asks on to the next
            // kernel); its plan is made if it is run regardless (the mutation test).
            const auto made = declined.empty() ? problem_of(input, variant)
                                               : c10::intrusive_ptr<FusedTileProblem>();
            const auto problem_for = [made, variant](const KernelInput& in) {
              return made ? made : problem_of(in, variant);
            };
            SplitKernel split{
                [problem_for](const KernelInput& in) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  const auto result = tiles_forward(*problem, slices_of(call.query),
                                                    slices_of(call.key), slices_of(call.value));
                  // 16-bit: the output before its rounding, which the planner rounds
                  // (SplitForward::unrounded).
                  const auto& out = result.out_float.defined() ? result.out_float : result.out;
                  return SplitOutputs{shaped_like(out, call.query), result.lse, result.row_max};
                },
                [problem_for](const KernelInput& in, const SplitSaved& saved) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  auto grads = backward_with_parameters(
                      *problem, slices_of(call.query), slices_of(call.key), slices_of(call.value),
                      slices_of(saved.out), saved.lse.contiguous(), slices_of(saved.grad_out),
                      saved.parameters);
                  grads[0] = shaped_like(grads[0], call.query);
                  grads[1] = shaped_like(grads[1], call.key);
                  grads[2] = shaped_like(grads[2], call.value);
                  return grads;
                },
                /*keeps_row_max=*/true};
            return KernelDecision{
                std::move(declined),
                [problem_for](const KernelInput& in) {
                  const auto problem = problem_for(in);
                  const auto& call = in.call;
                  std::vector<torch::Tensor> parameters;
                  for (const auto& t : problem->variant.tensors()) {
                    if (t.is_floating_point() && t.requires_grad() && torch::GradMode::is_enabled())
                      parameters.push_back(t);
                  }
                  return functional::AttentionOutput{
                      FusedTileAttention::apply(problem, call.query, call.key, call.value,
                                                at::TensorList(parameters)),
                      {}};
                },
                std::move(split)};
          },
          /*takes_sinks=*/false,
          /*runs_16bit_cpu_in_its_dtype=*/true};
}

}  // namespace attnkit::detail
