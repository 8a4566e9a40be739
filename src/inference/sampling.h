#pragma once
// What generate and the Scheduler share: the checks of a GenerateOptions and the draw of the
// next tokens from the last position's logits.

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include "attnkit/generate.h"

namespace attnkit::detail {

// max_new_tokens >= 0, temperature finite and >= 0, top_k >= 0; `fn` names the caller.
void check_sampling_options(const char* fn, const GenerateOptions& options);

// The next token of each row from the last position's logits (b, vocab) -> (b, 1): the
// argmax, or a draw from softmax(logits / temperature) over the top_k most likely tokens.
torch::Tensor next_tokens(const torch::Tensor& logits, const GenerateOptions& options,
                          at::Generator& generator);

}  // namespace attnkit::detail
