// The score functions: the ready-made ones (score_mods), what they are as values to a kernel
// (score_variants.h), and the helpers every kernel calls them through.

#include "core/scores/score_mods.h"

#include <cmath>
#include <unordered_set>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "attnkit/attention_types.h"
#include "attnkit/score_mods.h"
#include "core/base/checks.h"
#include "core/scores/row_variants.h"
#include "core/scores/score_program.h"
#include "core/scores/score_variants.h"

namespace attnkit {

using detail::shape_string;

namespace score_mods {

ScoreMod alibi(const torch::Tensor& slopes) {
  TORCH_CHECK(slopes.defined() && slopes.dim() == 1 && slopes.is_floating_point(),
              "[score_mods::alibi] slopes must be a 1-D floating tensor (heads), got ",
              slopes.defined() ? shape_string(slopes) : std::string("an undefined tensor"));
  const detail::AlibiBias bias{slopes};
  return detail::AdditiveScore{bias, bias};
}

torch::Tensor alibi_slopes(int64_t heads) {
  TORCH_CHECK(heads >= 1, "[score_mods::alibi_slopes] heads must be >= 1, got ", heads);
  return torch::pow(2.0, torch::arange(1, heads + 1, torch::kFloat) * (-8.0 / heads));
}

ScoreMod softcap(double cap) {
  TORCH_CHECK(cap > 0.0 && std::isfinite(cap), "[score_mods::softcap] cap must be > 0, got ", cap);
  return detail::SoftcapScore{cap};
}

ScoreMod relative_position_bias(const torch::Tensor& bias) {
  TORCH_CHECK(
      bias.defined() && bias.dim() == 2 && bias.size(1) % 2 == 1 && bias.is_floating_point(),
      "[score_mods::relative_position_bias] bias must be a floating (heads, 2 D + 1) ",
      "tensor, got ", bias.defined() ? shape_string(bias) : std::string("an undefined tensor"));
  const detail::RelativeBias relative{bias, bias.size(1) / 2};
  return detail::AdditiveScore{relative, relative};
}

}  // namespace score_mods

namespace detail {

torch::Tensor AlibiBias::operator()(const torch::Tensor& score, const torch::Tensor&,
                                    const torch::Tensor& h, const torch::Tensor& q_idx,
                                    const torch::Tensor& kv_idx) const {
  // .to: slopes made on the CPU (alibi_slopes) serve scores on any device.
  return slopes.to(h.device()).index({h}).to(score.scalar_type()) * (kv_idx - q_idx);
}

torch::Tensor RelativeBias::operator()(const torch::Tensor& score, const torch::Tensor&,
                                       const torch::Tensor& h, const torch::Tensor& q_idx,
                                       const torch::Tensor& kv_idx) const {
  const auto head = table.size(0) == 1 ? torch::zeros_like(h) : h;
  const auto distance = (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance;
  return table.to(h.device()).index({head, distance}).to(score.scalar_type());
}

namespace {

// The first of the variants that `score_mod` is; `why` gains a graph's reason when its
// program cannot be compiled.
template <typename... Variants>
std::optional<ScoreVariants::Value> first_variant(VariantList<Variants...>,
                                                  const ScoreMod& score_mod, std::string* why) {
  std::optional<ScoreVariants::Value> found;
  // In list order, stopping at the first that takes it.
  (void)((found = [&]() -> std::optional<ScoreVariants::Value> {
           if (auto variant = Variants::from(score_mod, why))
             return ScoreVariants::Value(std::move(*variant));
           return std::nullopt;
         }())
             .has_value() ||
         ...);
  return found;
}

}  // namespace

const char* ScoreVariant::name() const {
  return std::visit([](const auto& v) { return std::decay_t<decltype(v)>::kName; }, form);
}

std::vector<torch::Tensor> ScoreVariant::tensors() const {
  return std::visit([](const auto& v) { return v.tensors(); }, form);
}

std::string ScoreVariant::lacks(int64_t heads) const {
  return std::visit([heads](const auto& v) { return v.lacks(heads); }, form);
}

Kept ScoreVariant::keeps() const {
  return std::visit([](const auto& v) { return std::decay_t<decltype(v)>::kKeeps; }, form);
}

const ScoreProgram* ScoreVariant::program() const {
  const auto* graph = std::get_if<GraphRows>(&form);
  return graph ? graph->program.get() : nullptr;
}

std::optional<ScoreVariant> score_variant_of(const ScoreMod& score_mod, std::string* why) {
  if (const auto* positioned = score_mod ? score_mod.target<PositionedScore>() : nullptr) {
    const auto& key_offsets = positioned->key_offsets;
    if (positioned->offsets.dim() != 0 || (key_offsets.defined() && key_offsets.dim() != 0)) {
      if (why != nullptr)
        *why = "q_idx counted from a start per row (a ragged cached step)";
      return std::nullopt;
    }
    auto inner = score_variant_of(positioned->score_mod, why);
    if (inner) {
      inner->query_offset += positioned->offsets.item<int64_t>();
      if (key_offsets.defined())
        inner->key_offset += key_offsets.item<int64_t>();
    }
    return inner;
  }
  std::string reason;
  if (auto form = first_variant(ScoreVariants{}, score_mod, &reason))
    return ScoreVariant{std::move(*form)};
  if (why != nullptr)
    *why = reason.empty() ? "a C++ function, which only LibTorch's ops evaluate" : reason;
  return std::nullopt;
}

ScoreVariant forward_score_variant_of(const ScoreMod& score_mod) {
  if (auto variant = score_variant_of(score_mod))
    return std::move(*variant);
  return ScoreVariant{FunctionRows{score_mod}};
}

ScoreVariant cpu_forward_score_variant(const char* fn, const ScoreMod& score_mod, int64_t heads) {
  auto variant = forward_score_variant_of(score_mod);
  const auto lacks = variant.lacks(heads);
  TORCH_CHECK(lacks.empty(), fn, " score_mod: ", lacks);
  for (const auto& t : variant.tensors()) {
    TORCH_CHECK(t.device().is_cpu(), fn, " score_mod reads a tensor on ", t.device(),
                "; the kernel runs on the CPU");
  }
  return variant;
}

bool score_reads_positions(const ScoreMod& score_mod) {
  return score_mod && score_mod.target<SoftcapScore>() == nullptr;
}

ScoreMod score_mod_at_positions(const ScoreMod& score_mod, const torch::Tensor& offsets,
                                const torch::Tensor& key_offsets) {
  if (!score_reads_positions(score_mod))
    return score_mod;
  return PositionedScore{score_mod, offsets, key_offsets};
}

ScoreMod score_mod_at_positions(const ScoreMod& score_mod, int64_t query_offset,
                                int64_t key_offset) {
  if (!score_reads_positions(score_mod) || (query_offset == 0 && key_offset == 0))
    return score_mod;
  return PositionedScore{score_mod, torch::tensor(query_offset, torch::kInt64),
                         torch::tensor(key_offset, torch::kInt64)};
}

torch::Tensor PositionedScore::operator()(const torch::Tensor& score, const torch::Tensor& b,
                                          const torch::Tensor& h, const torch::Tensor& q_idx,
                                          const torch::Tensor& kv_idx) const {
  const auto shift = [&b](const torch::Tensor& t) { return t.dim() == 0 ? t : t.index({b}); };
  return score_mod(score, b, h, q_idx + shift(offsets),
                   key_offsets.defined() ? kv_idx + shift(key_offsets) : kv_idx);
}

torch::Tensor apply_score_mod(const ScoreMod& score_mod, const torch::Tensor& scores,
                              const std::vector<torch::Tensor>& index) {
  auto result = score_mod(scores, index[0], index[1], index[2], index[3]);
  TORCH_CHECK(result.defined() && result.sizes() == scores.sizes() &&
                  result.scalar_type() == scores.scalar_type(),
              "[attention] score_mod must return a tensor of the score's shape ",
              shape_string(scores), " and dtype ", scores.scalar_type(), ", got ",
              result.defined() ? c10::str(shape_string(result), " ", result.scalar_type())
                               : std::string("an undefined tensor"));
  return result;
}

std::vector<torch::Tensor> score_mod_parameters(const ScoreMod& score_mod,
                                                const torch::TensorOptions& options) {
  // A probe: one score, index 0 everywhere, with grad mode on; the leaves of the graph it
  // builds are the tensors the function reads that want gradients.
  const torch::AutoGradMode grad_mode(true);
  const auto zero = torch::zeros({1, 1, 1, 1}, options.dtype(torch::kInt64));
  const auto probe = score_mod(torch::zeros({1, 1, 1, 1}, options), zero, zero, zero, zero);
  std::vector<torch::Tensor> parameters;
  if (!probe.defined() || !probe.requires_grad())
    return parameters;
  std::vector<torch::autograd::Node*> stack{probe.grad_fn().get()};
  std::unordered_set<torch::autograd::Node*> seen;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second)
      continue;
    if (auto* leaf = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      parameters.push_back(leaf->variable);
      continue;
    }
    for (const auto& edge : node->next_edges())
      stack.push_back(edge.function.get());
  }
  return parameters;
}

}  // namespace detail
}  // namespace attnkit
