#pragma once

// The score function as the fused tile kernel's row loops (fused_tiles_forward.cpp,
// fused_tiles_backward.cpp) call it: its variant's rows (row_variants.h) in T, at the
// positions the variant reads.

#include <cstdint>
#include <type_traits>
#include <variant>
#include <vector>

#include <torch/torch.h>

#include "core/scores/row_variants.h"
#include "core/scores/score_program.h"

namespace attnkit::detail {

template <typename T>
struct RowScore {
  using Kept = ::attnkit::detail::Kept;

  typename ScoreVariants::template Rows<T> rows;
  const ScoreProgram* program;       // a graph's, for its workspace
  int64_t query_offset, key_offset;  // added to the call's positions
  Kept keeps;

  explicit RowScore(const ScoreVariant& v)
      : rows(std::visit(
            [](const auto& variant) -> typename ScoreVariants::template Rows<T> {
              using Variant = std::decay_t<decltype(variant)>;
              return typename Variant::template Rows<T>(variant);
            },
            v.form)),
        program(v.program()),
        query_offset(v.query_offset),
        key_offset(v.key_offset),
        keeps(v.keeps()) {}

  // A worker's buffers for rows of up to `widest` keys (a program's; none otherwise).
  ScoreProgram::Workspace workspace(int64_t widest) const {
    return program ? program->workspace(widest, std::is_same_v<T, float>)
                   : ScoreProgram::Workspace{};
  }
  Kept backward_keeps() const { return keeps; }

  // Scores s[0, count) of the call's query q against its keys k0, k0 + 1, ... of batch o
  // and head `head`, modified in place.
  void apply(T* s, int64_t count, int64_t o, int64_t head, int64_t q, int64_t k0,
             ScoreProgram::Workspace& work) const {
    const RowAt at{o, head, q + query_offset, k0 + key_offset};
    std::visit([&](const auto& r) { r.apply(s, count, at, work); }, rows);
  }

  // Backward through apply: ds[0, count), the gradient with respect to the modified scores,
  // becomes the one with respect to the scores; `kept` is what backward_keeps() names. The
  // gradients of the tensors the function reads (tensor_grads[t]; a table is tensor 0, summed
  // in float64) gain this row's share.
  void backward(T* ds, const T* kept, int64_t count, int64_t o, int64_t head, int64_t q, int64_t k0,
                ScoreProgram::Workspace& work, const std::vector<GradSink>& tensor_grads) const {
    const RowAt at{o, head, q + query_offset, k0 + key_offset};
    std::visit([&](const auto& r) { r.backward(ds, kept, count, at, work, tensor_grads); }, rows);
  }
};

}  // namespace attnkit::detail
