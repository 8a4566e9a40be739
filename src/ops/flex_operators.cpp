// attnkit's core as PyTorch operators (TORCH_LIBRARY(attnkit)), the library the Python package
// loads (docs/python.md). Schemas take tensors and scalars only:
// - a block mask as FlexAttention's block lists, and the partial tiles' own bits, packed
//   (P, q_block_size, kv_block_size) in the lists' order: batch, head, query block, then the
//   kv_num_blocks first entries of kv_indices (what mask_mod gave on those tiles), or one
//   tile per slot of kv_indices (block_lists.h, which reads them);
// - a score function as a ScoreGraph's text and the tensors it captures.
// Each operator has a kernel for the CPU and CUDA (LibTorch operations, any device), a Meta
// kernel (fake tensors: torch.compile traces the operators without running them), and
// flex_attention an autograd kernel whose backward is the operator flex_attention_backward,
// so AOTAutograd sees both, and autocast kernels (the C++ API's autocast policy). The kernel is
// the planner's choice among the kernels with a split forward and backward (LibTorch's CPU
// flash kernel for no mask or a causal one, else attnkit's chunked kernel, memory linear in
// n), computing 16-bit inputs in float32.

#include <torch/library.h>
#include <torch/torch.h>

#include "attnkit/block_mask.h"
#include "attnkit/score_graph.h"
#include "core/base/autocast.h"
#include "core/base/checks.h"
#include "core/base/matrix_units.h"
#include "core/masks/mask_form.h"
#include "core/plan/planner.h"
#include "ops/block_lists.h"

namespace attnkit::ops {

namespace {

using detail::shape_string;
using torch::Tensor;

// The arguments every flex operator shares, after q, k, v (and backward's extra tensors).
struct FlexArguments {
  c10::optional<Tensor> kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  c10::optional<Tensor> partial_tiles;
  // A Mask's value form and its tensors (core/masks/mask_form.h): attnkit.attention's own
  // masks, passed as they are; `&` the block lists' mask where both are given.
  std::string mask;
  std::vector<Tensor> mask_tensors;
  int64_t q_block_size = 128, kv_block_size = 128;
  std::string score_graph;
  std::vector<Tensor> score_tensors;
  double scale = 1.0;
  double dropout_p = 0.0;
  int64_t dropout_seed = -1;
  bool max_scores = false;  // the forward gives each row's largest score too
};

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (const auto* item : {&q, &k, &v}) {
    const char* name = item == &q ? "query" : item == &k ? "key" : "value";
    TORCH_CHECK(item->dim() == 4, kOp, " ", name, " must be 4-D (B, H, S, D), got ",
                shape_string(*item));
    TORCH_CHECK(item->is_floating_point(), kOp, " ", name, " must be floating point, got ",
                item->scalar_type());
    TORCH_CHECK(item->scalar_type() == q.scalar_type() && item->device() == q.device(), kOp,
                " query, key and value must share a dtype and device, got query ", q.scalar_type(),
                " on ", q.device(), " and ", name, " ", item->scalar_type(), " on ",
                item->device());
  }
  // Sizes as SymInts: under torch.compile the fake kernels run this on symbolic shapes, and
  // reading a plain size would fix the length the graph was traced with.
  TORCH_CHECK(k.sym_size(0) == q.sym_size(0) && v.sym_size(0) == q.sym_size(0), kOp,
              " query, key and value must have one batch size, got ", shape_string(q), ", ",
              shape_string(k), ", ", shape_string(v));
  TORCH_CHECK(k.sym_size(1) == v.sym_size(1) && k.sym_size(2) == v.sym_size(2), kOp,
              " key and value must have the same heads and length, got ", shape_string(k), " and ",
              shape_string(v));
  TORCH_CHECK(k.sym_size(1) >= 1 && q.sym_size(1) % k.sym_size(1) == 0, kOp,
              " the key/value heads must divide the query heads (grouped-query attention), "
              "got ",
              q.size(1), " query heads and ", k.size(1), " key/value heads");
  TORCH_CHECK(k.sym_size(3) == q.sym_size(3), kOp, " query and key must have one head_dim, got ",
              q.size(3), " and ", k.size(3));
}

// The mask of the arguments: their block lists and partial tiles (block_lists.h) and their
// mask's value form (mask_form.h), both where both are given.
Mask mask_of(const Tensor& q, const Tensor& k, const FlexArguments& args) {
  const auto lists = block_lists_mask(q, k, args.kv_num_blocks, args.kv_indices,
                                      args.full_kv_num_blocks, args.full_kv_indices,
                                      args.partial_tiles, args.q_block_size, args.kv_block_size);
  const auto given = detail::mask_of_form(kOp, args.mask, args.mask_tensors);
  given.check(kOp, q.size(0), q.size(1), q.size(2), k.size(2), q.device());
  return lists.is_none() ? given : given.is_none() ? lists : lists & given;
}

// Every captured tensor on the query's device and real: one on another device would be read as
// garbage, and one on meta (no data) sends the call to the fake kernel, whose outputs are
// uninitialised. A CPU scalar serves any device, as in PyTorch's own operations. Run by the
// kernels and the fake kernels alike.
void check_score_tensors(const Tensor& query, at::TensorList score_tensors) {
  for (size_t i = 0; i < score_tensors.size(); ++i) {
    const auto& t = score_tensors[i];
    TORCH_CHECK(t.device() == query.device() || (t.dim() == 0 && t.is_cpu()), kOp,
                " score_tensors[", i, "] (the score_mod's captured tensor ", i, ", ",
                t.scalar_type(), " ", shape_string(t), ") is on ", t.device(), ", the query on ",
                query.device(), ": move it to the query's device");
    TORCH_CHECK(!t.is_complex(), kOp, " score_tensors[", i, "] (the score_mod's captured tensor ",
                i, ", ", shape_string(t), ") is ", t.scalar_type(),
                "; expected a real, integer or bool tensor, as the query's ", query.scalar_type(),
                " scores are real");
  }
}

// The planner's split call for the arguments on query, key and value (a score function bound
// to `score_tensors`).
detail::AttentionCall call_of(const Tensor& query, const Tensor& key, const Tensor& value,
                              const FlexArguments& args, const std::vector<Tensor>& score_tensors) {
  TORCH_CHECK(args.dropout_p >= 0.0 && args.dropout_p < 1.0, kOp,
              " dropout_p must be in [0, 1), got ", args.dropout_p);
  TORCH_CHECK(args.dropout_p == 0.0 || args.dropout_seed >= 0, kOp,
              " dropout_p > 0 needs a dropout_seed >= 0, got ", args.dropout_seed);
  TORCH_CHECK(!args.score_graph.empty() || score_tensors.empty(), kOp,
              " score_tensors without a score_graph");
  check_score_tensors(query, score_tensors);
  detail::AttentionCall call;
  call.query = query;
  call.key = key;
  call.value = value;
  call.options.mask(mask_of(query, key, args))
      .scale(args.scale)
      .dropout_p(args.dropout_p)
      .training(args.dropout_p > 0.0)
      .query_block_size(args.q_block_size)
      .key_block_size(std::max<int64_t>(1024, args.kv_block_size));
  if (!args.score_graph.empty())
    call.options.score_mod(ScoreGraph::parse(args.score_graph).bind(score_tensors));
  call.backend_is_preference = true;
  call.split = true;
  call.dropout_seed = args.dropout_p > 0.0 ? args.dropout_seed : -1;
  call.wants_row_max = args.max_scores;
  return call;
}

// The output, its lse, what backward reads as the output: for 16-bit inputs the output
// before its rounding (float32; backward's D = rowsum(dO * O) from the rounded output missed a
// per-head bias's gradient, 0 in exact arithmetic, by 1e-4), else a (0) tensor (the output
// itself serves); and the rows' largest scores (FlexAttention's max_scores, as the lse) where
// args.max_scores asks, else a (0) tensor.
std::tuple<Tensor, Tensor, Tensor, Tensor> flex_forward(const Tensor& query, const Tensor& key,
                                                        const Tensor& value,
                                                        const FlexArguments& args,
                                                        bool backward_follows) {
  check_inputs(query, key, value);
  const torch::NoGradGuard no_grad;
  auto call = call_of(query, key, value, args, args.score_tensors);
  call.backward_follows = backward_follows;
  auto result = detail::run_split_forward(call);
  auto for_backward = result.unrounded.defined() ? result.unrounded.contiguous()
                                                 : torch::empty({0}, query.options());
  auto row_max =
      args.max_scores ? result.row_max.contiguous() : torch::empty({0}, result.lse.options());
  return {result.out.contiguous(), result.lse.contiguous(), for_backward, row_max};
}

std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> flex_backward(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& lse, const FlexArguments& args) {
  check_inputs(query, key, value);
  TORCH_CHECK(grad_out.sizes() == out.sizes() && lse.dim() == 3, kOp,
              " backward: grad_out must be shaped as out ", shape_string(out), ", got ",
              shape_string(grad_out));
  // The score function reads leaves that want gradients: each floating captured tensor.
  std::vector<Tensor> leaves, parameters;
  for (const auto& t : args.score_tensors) {
    leaves.push_back(t.is_floating_point() ? t.detach().requires_grad_(true) : t);
    if (t.is_floating_point())
      parameters.push_back(leaves.back());
  }
  auto grads = detail::run_split_backward(call_of(query, key, value, args, leaves),
                                          {out, lse, grad_out, parameters});
  // Contiguous gradients, as the Meta kernel promises.
  std::vector<Tensor> tensor_grads;
  size_t next = 3;
  for (const auto& t : args.score_tensors) {
    tensor_grads.push_back(t.is_floating_point() ? grads[next++].contiguous()
                                                 : torch::zeros(t.sizes(), t.options()));
  }
  return {grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), tensor_grads};
}

// The schemas' shared tail, in the order FlexArguments reads it.
#define ATTNKIT_FLEX_TAIL                                                                     \
  "Tensor? kv_num_blocks, Tensor? kv_indices, Tensor? full_kv_num_blocks, "                   \
  "Tensor? full_kv_indices, Tensor? partial_tiles, str mask, Tensor[]? mask_tensors, "        \
  "int q_block_size, int kv_block_size, "                                                     \
  "str score_graph, Tensor[] score_tensors, float scale, float dropout_p, int dropout_seed, " \
  "bool max_scores=False"

// The tail as every kernel's C++ parameters, and their names to pass it on: one list, so that
// an argument added to the schema is added once here (and to FlexArguments).
#define ATTNKIT_FLEX_PARAMETERS                                                                    \
  const c10::optional<Tensor>&kv_num_blocks, const c10::optional<Tensor>&kv_indices,               \
      const c10::optional<Tensor>&full_kv_num_blocks, const c10::optional<Tensor>&full_kv_indices, \
      const c10::optional<Tensor>&partial_tiles, c10::string_view mask,                            \
      c10::optional<at::TensorList> mask_tensors, int64_t q_block_size, int64_t kv_block_size,     \
      c10::string_view score_graph, at::TensorList score_tensors, double scale, double dropout_p,  \
      int64_t dropout_seed, bool max_scores
#define ATTNKIT_FLEX_ARGUMENTS                                                                 \
  kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_tiles, mask,         \
      mask_tensors, q_block_size, kv_block_size, score_graph, score_tensors, scale, dropout_p, \
      dropout_seed, max_scores

FlexArguments arguments_of(ATTNKIT_FLEX_PARAMETERS) {
  return {kv_num_blocks,
          kv_indices,
          full_kv_num_blocks,
          full_kv_indices,
          partial_tiles,
          std::string(mask),
          mask_tensors.has_value() ? mask_tensors->vec() : std::vector<Tensor>(),
          q_block_size,
          kv_block_size,
          std::string(score_graph),
          score_tensors.vec(),
          scale,
          dropout_p,
          dropout_seed,
          max_scores};
}

std::tuple<Tensor, Tensor, Tensor> flex_attention_kernel(const Tensor& query, const Tensor& key,
                                                         const Tensor& value,
                                                         ATTNKIT_FLEX_PARAMETERS) {
  auto [out, lse, for_backward, row_max] =
      flex_forward(query, key, value, arguments_of(ATTNKIT_FLEX_ARGUMENTS),
                   /*backward_follows=*/false);
  return {out, lse, row_max};
}

// flex_attention with what its backward reads as the output (flex_forward): the autograd
// kernel's forward.
std::tuple<Tensor, Tensor, Tensor, Tensor> flex_attention_for_backward_kernel(
    const Tensor& query, const Tensor& key, const Tensor& value, ATTNKIT_FLEX_PARAMETERS) {
  return flex_forward(query, key, value, arguments_of(ATTNKIT_FLEX_ARGUMENTS),
                      /*backward_follows=*/true);
}

std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> flex_attention_backward_kernel(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& out, const Tensor& lse, ATTNKIT_FLEX_PARAMETERS) {
  return flex_backward(grad_out, query, key, value, out, lse, arguments_of(ATTNKIT_FLEX_ARGUMENTS));
}

// Fake kernels: the outputs' shapes and dtypes only.
std::tuple<Tensor, Tensor, Tensor> flex_attention_meta(const Tensor& query, const Tensor& key,
                                                       const Tensor& value,
                                                       ATTNKIT_FLEX_PARAMETERS) {
  const auto args = arguments_of(ATTNKIT_FLEX_ARGUMENTS);
  check_inputs(query, key, value);
  check_score_tensors(query, args.score_tensors);
  auto shape = query.sym_sizes().vec();
  shape.back() = value.sym_size(-1);
  const auto rows = query.options().dtype(detail::compute_dtype(query));
  const std::vector<c10::SymInt> per_row{query.sym_size(0), query.sym_size(1), query.sym_size(2)};
  return {at::empty_symint(shape, query.options()), at::empty_symint(per_row, rows),
          args.max_scores ? at::empty_symint(per_row, rows) : torch::empty({0}, rows)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> flex_attention_for_backward_meta(
    const Tensor& query, const Tensor& key, const Tensor& value, ATTNKIT_FLEX_PARAMETERS) {
  auto [out, lse, row_max] = flex_attention_meta(query, key, value, ATTNKIT_FLEX_ARGUMENTS);
  auto for_backward = detail::is_16bit(query) ? at::empty_symint(out.sym_sizes(), lse.options())
                                              : torch::empty({0}, query.options());
  return {out, lse, for_backward, row_max};
}

std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>> flex_attention_backward_meta(
    const Tensor& /*grad_out*/, const Tensor& query, const Tensor& key, const Tensor& value,
    const Tensor& /*out*/, const Tensor& /*lse*/, ATTNKIT_FLEX_PARAMETERS) {
  const auto args = arguments_of(ATTNKIT_FLEX_ARGUMENTS);
  check_score_tensors(query, args.score_tensors);
  // Contiguous, as the kernel's (whatever the inputs' strides).
  const auto like = [](const Tensor& t) { return at::empty_symint(t.sym_sizes(), t.options()); };
  std::vector<Tensor> tensor_grads;
  for (const auto& t : args.score_tensors)
    tensor_grads.push_back(like(t));
  return {like(query), like(key), like(value), tensor_grads};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The lse's gradient g through the backward kernels as they are. d lse_i / d s_ij = P_ij, so
// dS_ij = P_ij (dP_ij - D_i + g_i), where dP = dO V^T and D = rowsum(dO * O). A value column
// of ones with g as its output gradient adds g_i to every dP_ij; that column's output is given
// as 0, so D stays rowsum(dO * O). The column's dV is dropped. One more column for an even
// value width (the 16-bit products pack pairs of rows).
// grad_out (b, hq, n, dv), value (b, hkv, m, dv), out (b, hq, n, dv), grad_lse (b, hq, n)
//   -> the three with dv + extra columns.
std::tuple<Tensor, Tensor, Tensor> with_lse_gradient(const Tensor& grad_out, const Tensor& value,
                                                     const Tensor& out, const Tensor& grad_lse) {
  const int64_t extra = value.size(-1) % 2 == 0 ? 2 : 1;
  const auto column = [extra](const Tensor& t, const Tensor& first) {
    auto sizes = t.sizes().vec();
    sizes.back() = extra;
    auto added = torch::zeros(sizes, t.options());
    added.select(-1, 0).copy_(first);
    return torch::cat({t, added}, -1);
  };
  // A row that sees no key has lse +inf (or -inf from Python) and no weights: g moves nothing.
  const auto g = grad_lse.to(grad_out.scalar_type());
  return {column(grad_out, g), column(value, torch::ones({}, value.options())),
          column(out, torch::zeros({}, out.options()))};
}

// The mask's tensors among the autograd kernel's `blocks` (after the five lists).
std::vector<Tensor> mask_tensors_in(const std::vector<c10::optional<Tensor>>& blocks) {
  std::vector<Tensor> tensors;
  for (size_t i = 5; i < blocks.size(); ++i)
    tensors.push_back(*blocks[i]);
  return tensors;
}

// The autograd kernel: forward below autograd, backward through flex_attention_backward.
struct FlexAttentionFunction : public torch::autograd::Function<FlexAttentionFunction> {
  // `blocks`: kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, partial_tiles,
  // then the mask's tensors (none differentiable, so passed as one non-tensor argument).
  static variable_list forward(AutogradContext* ctx, const Tensor& query, const Tensor& key,
                               const Tensor& value,
                               const std::vector<c10::optional<Tensor>>& blocks,
                               const std::string& mask, int64_t q_block_size, int64_t kv_block_size,
                               const std::string& score_graph, at::TensorList score_tensors,
                               double scale, double dropout_p, int64_t dropout_seed,
                               bool max_scores) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("attnkit::flex_attention_for_backward", "")
                         .typed<decltype(flex_attention_for_backward_kernel)>();
    const auto mask_tensors = mask_tensors_in(blocks);
    Tensor out, lse, for_backward, row_max;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, lse, for_backward, row_max) =
          op.call(query, key, value, blocks[0], blocks[1], blocks[2], blocks[3], blocks[4], mask,
                  at::TensorList(mask_tensors), q_block_size, kv_block_size, score_graph,
                  score_tensors, scale, dropout_p, dropout_seed, max_scores);
    }
    // Backward's output: the unrounded one of a 16-bit call.
    variable_list saved{query, key, value, for_backward.dim() == out.dim() ? for_backward : out,
                        lse};
    saved.insert(saved.end(), score_tensors.begin(), score_tensors.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["blocks"] = blocks;
    ctx->saved_data["mask"] = mask;
    ctx->saved_data["q_block_size"] = q_block_size;
    ctx->saved_data["kv_block_size"] = kv_block_size;
    ctx->saved_data["score_graph"] = score_graph;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["dropout_seed"] = dropout_seed;
    // Unused outputs' gradients stay undefined: a call whose lse takes no gradient pays
    // nothing for it (with_lse_gradient).
    ctx->set_materialize_grads(false);
    ctx->mark_non_differentiable({row_max});  // FlexAttention's max_scores has no gradient
    return {out, lse, row_max};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("attnkit::flex_attention_backward", "")
                         .typed<decltype(flex_attention_backward_kernel)>();
    // The engine records the backward's graph (grad mode on) only for create_graph=True. The
    // kernels' backward is not itself differentiable: refuse, rather than give second-order
    // gradients of zero.
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "[attnkit::flex_attention] second-order gradients are not supported: the "
                "backward was asked to record its own graph (create_graph=True), and attnkit's "
                "kernels do not; differentiate once (create_graph=False)");
    const auto saved = ctx->get_saved_variables();
    const std::vector<Tensor> score_tensors(saved.begin() + 5, saved.end());
    const auto blocks = ctx->saved_data["blocks"].to<std::vector<c10::optional<Tensor>>>();
    const auto dropout_p = ctx->saved_data["dropout_p"].toDouble();
    // Contiguous, so that a compiled graph's backward sees the strides it was traced with.
    auto grad_out = grads[0].defined() ? grads[0].contiguous() : torch::zeros_like(saved[3]);
    auto value = saved[2];
    auto out = saved[3];
    if (grads[1].defined()) {
      TORCH_CHECK(dropout_p == 0.0,
                  "[attnkit::flex_attention] the lse's gradient with dropout_p > 0 is not "
                  "supported (lse is the softmax's, before dropout); got dropout_p ",
                  dropout_p);
      std::tie(grad_out, value, out) = with_lse_gradient(grad_out, value, out, grads[1]);
    }
    const auto mask_tensors = mask_tensors_in(blocks);
    auto [dq, dk, dv, tensor_grads] = op.call(
        grad_out, saved[0], saved[1], value, out, saved[4], blocks[0], blocks[1], blocks[2],
        blocks[3], blocks[4], ctx->saved_data["mask"].toStringRef(), at::TensorList(mask_tensors),
        ctx->saved_data["q_block_size"].toInt(), ctx->saved_data["kv_block_size"].toInt(),
        ctx->saved_data["score_graph"].toStringRef(), score_tensors,
        ctx->saved_data["scale"].toDouble(), dropout_p, ctx->saved_data["dropout_seed"].toInt(),
        /*max_scores=*/false);
    if (grads[1].defined())
      dv = dv.narrow(-1, 0, saved[2].size(-1)).contiguous();
    // One gradient per forward argument: q, k, v, the blocks, the mask, the two block sizes,
    // the graph, each score tensor, then scale, dropout_p, the seed and max_scores.
    variable_list result{dq, dk, dv};
    result.resize(result.size() + 5);
    for (size_t i = 0; i < score_tensors.size(); ++i)
      result.push_back(score_tensors[i].is_floating_point() ? tensor_grads[i] : Tensor());
    result.resize(result.size() + 4);
    return result;
  }
};

std::tuple<Tensor, Tensor, Tensor> flex_attention_autograd(const Tensor& query, const Tensor& key,
                                                           const Tensor& value,
                                                           ATTNKIT_FLEX_PARAMETERS) {
  // Without a gradient to keep (no_grad, inference) the plain operator: a 16-bit call then
  // rounds P for the matrix units' P V (flex_forward).
  bool wants_gradient = query.requires_grad() || key.requires_grad() || value.requires_grad();
  for (const auto& t : score_tensors)
    wants_gradient = wants_gradient || t.requires_grad();
  if (!torch::GradMode::is_enabled() || !wants_gradient) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("attnkit::flex_attention", "")
                         .typed<decltype(flex_attention_kernel)>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(query, key, value, ATTNKIT_FLEX_ARGUMENTS);
  }
  std::vector<c10::optional<Tensor>> blocks{kv_num_blocks, kv_indices, full_kv_num_blocks,
                                            full_kv_indices, partial_tiles};
  if (mask_tensors.has_value())
    blocks.insert(blocks.end(), mask_tensors->begin(), mask_tensors->end());
  auto outputs = FlexAttentionFunction::apply(
      query, key, value, blocks, std::string(mask), q_block_size, kv_block_size,
      std::string(score_graph), score_tensors, scale, dropout_p, dropout_seed, max_scores);
  return {outputs[0], outputs[1], outputs[2]};
}

// Under autocast, as the C++ API: the inputs in the autocast dtype (float64 keeps its own),
// then the operator with autocast off; 16-bit is computed in float32 and rounded once.
std::tuple<Tensor, Tensor, Tensor> flex_attention_autocast(const Tensor& query, const Tensor& key,
                                                           const Tensor& value,
                                                           ATTNKIT_FLEX_PARAMETERS) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attnkit::flex_attention", "")
                       .typed<decltype(flex_attention_kernel)>();
  const auto q = query.to(detail::attention_dtype(query));
  const auto k = key.to(detail::attention_dtype(key));
  const auto v = value.to(detail::attention_dtype(value));
  const detail::NoAutocast no_autocast;
  return op.call(q, k, v, ATTNKIT_FLEX_ARGUMENTS);
}

// How 16-bit CPU calls of `dtype` multiply: the matrix units' name, or "float32: " and why.
std::string cpu_16bit_matmul(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "[attnkit.cpu_16bit_matmul] dtype: expected torch.bfloat16 or torch.float16, got ",
              dtype);
  const auto lacks = detail::cpu_16bit_matmul_lacks(dtype);
  return lacks.empty() ? detail::cpu_16bit_matmul_units(dtype) : "float32: " + lacks;
}

}  // namespace

TORCH_LIBRARY(attnkit, m) {
  m.def("flex_attention(Tensor query, Tensor key, Tensor value, " ATTNKIT_FLEX_TAIL
        ") -> (Tensor, Tensor, Tensor)");
  m.def(
      "flex_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor lse, " ATTNKIT_FLEX_TAIL ") -> (Tensor, Tensor, Tensor, Tensor[])");
  m.def("flex_attention_for_backward(Tensor query, Tensor key, Tensor value, " ATTNKIT_FLEX_TAIL
        ") -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("cpu_16bit_matmul(ScalarType dtype) -> str", &cpu_16bit_matmul);
}

TORCH_LIBRARY_IMPL(attnkit, CPU, m) {
  m.impl("flex_attention", &flex_attention_kernel);
  m.impl("flex_attention_for_backward", &flex_attention_for_backward_kernel);
  m.impl("flex_attention_backward", &flex_attention_backward_kernel);
}

TORCH_LIBRARY_IMPL(attnkit, CUDA, m) {
  m.impl("flex_attention", &flex_attention_kernel);
  m.impl("flex_attention_for_backward", &flex_attention_for_backward_kernel);
  m.impl("flex_attention_backward", &flex_attention_backward_kernel);
}

TORCH_LIBRARY_IMPL(attnkit, Meta, m) {
  m.impl("flex_attention", &flex_attention_meta);
  m.impl("flex_attention_for_backward", &flex_attention_for_backward_meta);
  m.impl("flex_attention_backward", &flex_attention_backward_meta);
}

TORCH_LIBRARY_IMPL(attnkit, AutocastCPU, m) {
  m.impl("flex_attention", &flex_attention_autocast);
}

TORCH_LIBRARY_IMPL(attnkit, AutocastCUDA, m) {
  m.impl("flex_attention", &flex_attention_autocast);
}

TORCH_LIBRARY_IMPL(attnkit, Autograd, m) {
  m.impl("flex_attention", &flex_attention_autograd);
}

}  // namespace attnkit::ops
