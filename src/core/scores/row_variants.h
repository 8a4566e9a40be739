#pragma once

// Score functions as the fused tile kernel's rows evaluate them, FlashInfer's way: one small
// type per variant, each with
//   - kName, and `from`: the variant a ScoreMod is, when it is this one;
//   - Rows<T>: its forward on a row of scores (`apply`) and its gradient (`backward`), and
//     what backward reads besides the gradient (kKeeps);
//   - `tensors`: what it reads whose gradients backward computes; `lacks`: why a call's shape
//     does not fit it ("" when it does).
// A new variant is one type here and its name in ScoreVariants (below); the kernels compose
// with each through RowScore (row_score.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <torch/torch.h>

#include "attnkit/score_mod.h"
#include "core/base/checks.h"
#include "core/base/row_softmax.h"
#include "core/scores/score_mods.h"
#include "core/scores/score_program.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

/// What a variant's backward reads besides the gradient: nothing, the scores after the
/// function (a softcap's derivative is 1 - (modified / cap)^2), or before it (a program
/// recomputes its values).
enum class Kept { kNothing, kModified, kRaw };

/// Where a row sits: batch o, head `head`, query position q, its first key position k0 (in the
/// sequence: a variant's offsets added).
struct RowAt {
  int64_t o, head, q, k0;
};

/// No score function.
struct IdentityScore {
  static constexpr const char* kName = "none";
  static constexpr Kept kKeeps = Kept::kNothing;
  static std::optional<IdentityScore> from(const ScoreMod& score_mod, std::string*) {
    return score_mod ? std::nullopt : std::optional<IdentityScore>(IdentityScore{});
  }
  std::vector<torch::Tensor> tensors() const { return {}; }
  std::string lacks(int64_t) const { return ""; }

  template <typename T>
  struct Rows {
    explicit Rows(const IdentityScore&) {}
    void apply(T*, int64_t, const RowAt&, ScoreProgram::Workspace&) const {}
    void backward(T*, const T*, int64_t, const RowAt&, ScoreProgram::Workspace&,
                  const std::vector<GradSink>&) const {}
  };
};

/// Soft-capping, cap * tanh(score / cap) (score_mods::softcap).
struct SoftcapRows {
  static constexpr const char* kName = "softcap";
  static constexpr Kept kKeeps = Kept::kModified;
  double cap = 0.0;
  static std::optional<SoftcapRows> from(const ScoreMod& score_mod, std::string*) {
    const auto* softcap = score_mod ? score_mod.target<SoftcapScore>() : nullptr;
    return softcap ? std::optional<SoftcapRows>(SoftcapRows{softcap->cap}) : std::nullopt;
  }
  std::vector<torch::Tensor> tensors() const { return {}; }
  std::string lacks(int64_t) const { return ""; }

  template <typename T>
  struct Rows {
    T cap;
    explicit Rows(const SoftcapRows& v) : cap(static_cast<T>(v.cap)) {}
    void apply(T* s, int64_t count, const RowAt&, ScoreProgram::Workspace&) const {
      softcap_row(s, count, cap);
    }
    void backward(T* ds, const T* kept, int64_t count, const RowAt&, ScoreProgram::Workspace&,
                  const std::vector<GradSink>&) const {
      // d/ds cap tanh(s / cap) = 1 - tanh^2 = 1 - (modified / cap)^2; a masked entry
      // (modified -inf, ds 0) clamps to tanh -1, so its factor is 0, not -inf.
      const T inverse = 1 / cap;
      for (int64_t j = 0; j < count; ++j) {
        const T t = std::clamp<T>(kept[j] * inverse, -1, 1);
        ds[j] *= 1 - t * t;
      }
    }
  };
};

/// A variant's table in T on the CPU, contiguous, as its rows read it.
template <typename T>
torch::Tensor rows_table(const torch::Tensor& table) {
  return table.detach().to(torch::kCPU, c10::CppTypeToScalarType<T>::value).contiguous();
}

/// ALiBi, slopes[h] * (kv_idx - q_idx) added (score_mods::alibi).
struct AlibiRows {
  static constexpr const char* kName = "alibi";
  static constexpr Kept kKeeps = Kept::kNothing;
  torch::Tensor slopes;  // (heads)
  static std::optional<AlibiRows> from(const ScoreMod& score_mod, std::string*) {
    const auto* additive = score_mod ? score_mod.target<AdditiveScore>() : nullptr;
    const auto* alibi = additive ? std::get_if<AlibiBias>(&additive->form) : nullptr;
    return alibi ? std::optional<AlibiRows>(AlibiRows{alibi->slopes}) : std::nullopt;
  }
  std::vector<torch::Tensor> tensors() const { return {slopes}; }
  std::string lacks(int64_t heads) const {
    if (slopes.dim() == 1 && slopes.size(0) == heads)
      return "";
    return c10::str("ALiBi's slopes must be one per head (", heads, "), not ",
                    shape_string(slopes));
  }

  template <typename T>
  struct Rows {
    torch::Tensor slopes;
    explicit Rows(const AlibiRows& v) : slopes(rows_table<T>(v.slopes)) {}
    void apply(T* s, int64_t count, const RowAt& at, ScoreProgram::Workspace&) const {
      const T slope = slopes.data_ptr<T>()[at.head];
      const T first = static_cast<T>(at.k0 - at.q);
      for (int64_t j = 0; j < count; ++j)
        s[j] += slope * (first + static_cast<T>(j));
    }
    void backward(T* ds, const T*, int64_t count, const RowAt& at, ScoreProgram::Workspace&,
                  const std::vector<GradSink>& tensor_grads) const {
      if (tensor_grads.empty() || tensor_grads[0].sums == nullptr)
        return;
      double sum = 0.0;
      for (int64_t j = 0; j < count; ++j)
        sum += static_cast<double>(ds[j]) * static_cast<double>(at.k0 + j - at.q);
      tensor_grads[0].sums[at.head] += sum;
    }
  };
};

/// A relative-position table, table[h, clamp(kv_idx - q_idx, -D, D) + D] added
/// (score_mods::relative_position_bias).
struct RelativeBiasRows {
  static constexpr const char* kName = "relative_bias";
  static constexpr Kept kKeeps = Kept::kNothing;
  torch::Tensor table;  // (heads or 1, 2 D + 1)
  int64_t max_distance = 0;
  static std::optional<RelativeBiasRows> from(const ScoreMod& score_mod, std::string*) {
    const auto* additive = score_mod ? score_mod.target<AdditiveScore>() : nullptr;
    const auto* relative = additive ? std::get_if<RelativeBias>(&additive->form) : nullptr;
    return relative ? std::optional<RelativeBiasRows>(
                          RelativeBiasRows{relative->table, relative->max_distance})
                    : std::nullopt;
  }
  std::vector<torch::Tensor> tensors() const { return {table}; }
  std::string lacks(int64_t heads) const {
    if (table.size(0) == 1 || table.size(0) == heads)
      return "";
    return c10::str("a relative-position table must have 1 or ", heads, " rows, not ",
                    shape_string(table));
  }

  template <typename T>
  struct Rows {
    torch::Tensor table;
    int64_t max_distance;
    bool shared;  // one row for every head
    explicit Rows(const RelativeBiasRows& v)
        : table(rows_table<T>(v.table)),
          max_distance(v.max_distance),
          shared(v.table.size(0) == 1) {}
    int64_t row_of(int64_t head) const { return (shared ? 0 : head) * table.size(1); }
    void apply(T* s, int64_t count, const RowAt& at, ScoreProgram::Workspace&) const {
      const T* bias = table.data_ptr<T>() + row_of(at.head);
      const int64_t d = max_distance;
      for (int64_t j = 0; j < count; ++j)
        s[j] += bias[std::clamp(at.k0 + j - at.q, -d, d) + d];
    }
    void backward(T* ds, const T*, int64_t count, const RowAt& at, ScoreProgram::Workspace&,
                  const std::vector<GradSink>& tensor_grads) const {
      if (tensor_grads.empty() || tensor_grads[0].sums == nullptr)
        return;
      double* row = tensor_grads[0].sums + row_of(at.head);
      const int64_t d = max_distance;
      for (int64_t j = 0; j < count; ++j)
        row[std::clamp(at.k0 + j - at.q, -d, d) + d] += ds[j];
    }
  };
};

/// Any other ScoreGraph, compiled for rows (score_program.h). `from` compiles it; a graph that
/// rows cannot evaluate is no variant, and `why` says why (ScoreProgram::compile's reason).
struct GraphRows {
  static constexpr const char* kName = "graph";
  static constexpr Kept kKeeps = Kept::kRaw;
  std::shared_ptr<const ScoreProgram> program;
  static std::optional<GraphRows> from(const ScoreMod& score_mod, std::string* why) {
    if (!score_mod)
      return std::nullopt;
    const GraphScore* graph = score_mod.target<GraphScore>();
    bool adds_score = false;
    if (graph == nullptr) {
      const auto* additive = score_mod.target<AdditiveScore>();
      graph = additive ? std::get_if<GraphScore>(&additive->form) : nullptr;
      adds_score = true;
    }
    if (graph == nullptr)
      return std::nullopt;
    auto program = ScoreProgram::compile(*graph->graph, graph->tensors, adds_score, why);
    return program ? std::optional<GraphRows>(GraphRows{std::move(program)}) : std::nullopt;
  }
  std::vector<torch::Tensor> tensors() const { return program->tensors(); }
  std::string lacks(int64_t) const { return ""; }

  template <typename T>
  struct Rows {
    const ScoreProgram* program;
    explicit Rows(const GraphRows& v) : program(v.program.get()) {}
    void apply(T* s, int64_t count, const RowAt& at, ScoreProgram::Workspace& work) const {
      program->apply(s, count, at.o, at.head, at.q, at.k0, work);
    }
    void backward(T* ds, const T* kept, int64_t count, const RowAt& at,
                  ScoreProgram::Workspace& work, const std::vector<GradSink>& tensor_grads) const {
      program->backward(ds, kept, count, at.o, at.head, at.q, at.k0, work, tensor_grads);
    }
  };
};

/// A C++ function, called on tensors one row at a time: a row's scores (1, 1, 1, count) at
/// b = o, h = head, q_idx = q, kv_idx = k0 .. k0 + count - 1. Slow beside the others (a few
/// LibTorch ops per row), and forward only, so `from` never takes one: only the paged kernels,
/// which record no autograd, make it (forward_score_variant_of).
struct FunctionRows {
  static constexpr const char* kName = "function";
  static constexpr Kept kKeeps = Kept::kNothing;
  ScoreMod function;
  static std::optional<FunctionRows> from(const ScoreMod&, std::string*) { return std::nullopt; }
  std::vector<torch::Tensor> tensors() const { return {}; }
  std::string lacks(int64_t) const { return ""; }

  template <typename T>
  struct Rows {
    const ScoreMod* function;
    explicit Rows(const FunctionRows& v) : function(&v.function) {}
    void apply(T* s, int64_t count, const RowAt& at, ScoreProgram::Workspace&) const {
      // The kernels' workers need not share the caller's grad mode; nothing here is trained.
      const torch::NoGradGuard no_grad;
      const auto index = torch::kInt64;
      const auto scores = torch::from_blob(s, {1, 1, 1, count}, c10::CppTypeToScalarType<T>::value);
      const auto modified = apply_score_mod(
          *function, scores,
          {torch::full({1, 1, 1, 1}, at.o, index), torch::full({1, 1, 1, 1}, at.head, index),
           torch::full({1, 1, 1, 1}, at.q, index),
           torch::arange(at.k0, at.k0 + count, index).view({1, 1, 1, -1})});
      scores.copy_(modified);
    }
    void backward(T*, const T*, int64_t, const RowAt&, ScoreProgram::Workspace&,
                  const std::vector<GradSink>&) const {
      TORCH_INTERNAL_ASSERT(false, "a C++ score function's rows run forward only");
    }
  };
};

/// Every variant, one type each (ScoreBind::bind makes a graph that matches a named function that
/// function's value, so the types never overlap).
template <typename... Variants>
struct VariantList {
  using Value = std::variant<Variants...>;
  template <typename T>
  using Rows = std::variant<typename Variants::template Rows<T>...>;
};
using ScoreVariants =
    VariantList<IdentityScore, SoftcapRows, AlibiRows, RelativeBiasRows, GraphRows, FunctionRows>;

/// A score function as the fused tile kernel evaluates it: its variant, and the positions it
/// reads (q_idx is query_offset plus the query's index in the call, kv_idx key_offset plus the
/// key's: a PositionedScore's offsets).
struct ScoreVariant {
  ScoreVariants::Value form;
  int64_t query_offset = 0;
  int64_t key_offset = 0;

  /// The variant's kName ("none", "softcap", "alibi", "relative_bias", "graph", "function").
  const char* name() const;
  /// The tensors it reads, whose gradients backward computes (a table, or the graph's).
  std::vector<torch::Tensor> tensors() const;
  /// Why a call of `heads` query heads does not fit it; "" when it does.
  std::string lacks(int64_t heads) const;
  /// What its backward reads besides the gradient.
  Kept keeps() const;
  /// The compiled graph of a graph variant; nullptr for the others.
  const ScoreProgram* program() const;
};

/// The variant a score function is (IdentityScore for none); nullopt for a C++ function, or a
/// graph that rows cannot evaluate, with the reason in `why` (when given).
std::optional<ScoreVariant> score_variant_of(const ScoreMod& score_mod, std::string* why = nullptr);

/// score_variant_of, or where it has none, the function called on each row's tensors
/// (FunctionRows): for kernels that run forward only, without autograd (the paged ones).
ScoreVariant forward_score_variant_of(const ScoreMod& score_mod);

/// forward_score_variant_of, checked for a call on the CPU of `heads` query heads: a table of
/// another head count, or a tensor it reads on another device, is refused, `fn` in the message.
ScoreVariant cpu_forward_score_variant(const char* fn, const ScoreMod& score_mod, int64_t heads);

}  // namespace attnkit::detail
