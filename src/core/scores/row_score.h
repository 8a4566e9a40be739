#pragma once

// The score function as the fused tile kernel's row loops (fused_tiles.cpp) read it: a named
// variant (softcap, ALiBi, a relative-position table) with its table in T on the CPU, or a
// compiled score graph (score_program.h); forward on a row of scores, and its gradient.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <torch/torch.h>

#include "core/base/row_softmax.h"
#include "core/scores/score_program.h"
#include "core/scores/score_variants.h"

namespace attnkit::detail {

// The score function as the row loops read it: its table in T on the CPU, or its program.
template <typename T>
struct RowScore {
  ScoreVariant::Kind kind;
  T cap;
  torch::Tensor table;  // kAlibi: (heads); kRelativeBias: (heads or 1, 2 D + 1)
  int64_t max_distance;
  std::shared_ptr<const ScoreProgram> program;  // kGraph
  int64_t query_offset, key_offset;             // added to the call's positions

  explicit RowScore(const ScoreVariant& v)
      : kind(v.kind),
        cap(static_cast<T>(v.cap)),
        max_distance(v.max_distance),
        program(v.program),
        query_offset(v.query_offset),
        key_offset(v.key_offset) {
    if (v.table.defined())
      table = v.table.detach().to(torch::kCPU, c10::CppTypeToScalarType<T>::value).contiguous();
  }
  int64_t table_row(int64_t head) const {
    return kind == ScoreVariant::Kind::kRelativeBias && table.size(0) == 1 ? 0 : head;
  }
  // A worker's buffers for rows of up to `widest` keys (a program's; none otherwise).
  ScoreProgram::Workspace workspace(int64_t widest) const {
    return program ? program->workspace(widest, std::is_same_v<T, float>)
                   : ScoreProgram::Workspace{};
  }
  // What backward reads besides the gradient: the scores after the function (a softcap's
  // derivative is 1 - (modified / cap)^2) or before it (a program recomputes its values).
  enum class Kept { kNothing, kModified, kRaw };
  Kept backward_keeps() const {
    return kind == ScoreVariant::Kind::kSoftcap ? Kept::kModified
           : program                            ? Kept::kRaw
                                                : Kept::kNothing;
  }

  // Scores s[0, count) of the call's query q against its keys k0, k0 + 1, ... of batch o
  // and head `head`, modified in place.
  void apply(T* s, int64_t count, int64_t o, int64_t head, int64_t q, int64_t k0,
             ScoreProgram::Workspace& work) const {
    q += query_offset;  // positions in the sequence
    k0 += key_offset;
    switch (kind) {
      case ScoreVariant::Kind::kNone:
        return;
      case ScoreVariant::Kind::kGraph:
        program->apply(s, count, o, head, q, k0, work);
        return;
      case ScoreVariant::Kind::kSoftcap:
        softcap_row(s, count, cap);
        return;
      case ScoreVariant::Kind::kAlibi: {
        const T slope = table.data_ptr<T>()[head];
        const T first = static_cast<T>(k0 - q);
        for (int64_t j = 0; j < count; ++j)
          s[j] += slope * (first + static_cast<T>(j));
        return;
      }
      case ScoreVariant::Kind::kRelativeBias: {
        const T* bias = table.data_ptr<T>() + table_row(head) * table.size(1);
        const int64_t d = max_distance;
        for (int64_t j = 0; j < count; ++j)
          s[j] += bias[std::clamp(k0 + j - q, -d, d) + d];
        return;
      }
    }
  }

  // Backward through apply: ds[0, count), the gradient with respect to the modified scores,
  // becomes the one with respect to the scores; `kept` is what backward_keeps() names. The
  // gradients of the tensors the function reads (tensor_grads[t]; a table is tensor 0, summed
  // in float64) gain this row's share.
  void backward(T* ds, const T* kept, int64_t count, int64_t o, int64_t head, int64_t q, int64_t k0,
                ScoreProgram::Workspace& work, const std::vector<GradSink>& tensor_grads) const {
    q += query_offset;
    k0 += key_offset;
    double* table_grad = tensor_grads.empty() ? nullptr : tensor_grads[0].sums;
    switch (kind) {
      case ScoreVariant::Kind::kNone:
        return;
      case ScoreVariant::Kind::kGraph:
        program->backward(ds, kept, count, o, head, q, k0, work, tensor_grads);
        return;
      case ScoreVariant::Kind::kSoftcap: {
        // d/ds cap tanh(s / cap) = 1 - tanh^2 = 1 - (modified / cap)^2; a masked entry
        // (modified -inf, ds 0) clamps to tanh -1, so its factor is 0, not -inf.
        const T inverse = 1 / cap;
        for (int64_t j = 0; j < count; ++j) {
          const T t = std::clamp<T>(kept[j] * inverse, -1, 1);
          ds[j] *= 1 - t * t;
        }
        return;
      }
      case ScoreVariant::Kind::kAlibi: {
        if (table_grad == nullptr)
          return;
        double sum = 0.0;
        for (int64_t j = 0; j < count; ++j)
          sum += static_cast<double>(ds[j]) * static_cast<double>(k0 + j - q);
        table_grad[head] += sum;
        return;
      }
      case ScoreVariant::Kind::kRelativeBias: {
        if (table_grad == nullptr)
          return;
        double* row = table_grad + table_row(head) * table.size(1);
        const int64_t d = max_distance;
        for (int64_t j = 0; j < count; ++j)
          row[std::clamp(k0 + j - q, -d, d) + d] += ds[j];
        return;
      }
    }
  }
};

}  // namespace attnkit::detail
