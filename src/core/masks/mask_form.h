#pragma once

// A Mask's value form: text and tensors, as a ScoreGraph has, so that a caller with no C++
// objects (the Python package, through the operators' schema) passes causal, windows, key
// lengths and documents as they are, and the kernels read their structure.
//
// The form is parts joined by " & " (every part allows):
//   causal(OFFSET)              Mask::causal(OFFSET)
//   causal(OFFSET, window=W)    Mask::causal(OFFSET).sliding_window(W)
//   key_padding(#I)             Mask::key_padding(tensors[I]), (b) int64 lengths
//   documents(#I)               Mask::documents(tensors[I]), (n) or (b, n) int64 ids
// The empty form masks nothing.

#include <string>

#include <torch/torch.h>

#include "attnkit/mask.h"

namespace attnkit::detail {

/// The mask that `form` writes, reading its tensors from `tensors`. Fails with a c10::Error
/// naming `fn` for a form it cannot read (naming the part and what it expected), a tensor
/// index outside `tensors`, or a tensor left unread.
Mask mask_of_form(const char* fn, const std::string& form, at::TensorList tensors);

}  // namespace attnkit::detail
