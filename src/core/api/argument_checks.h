#pragma once

// The checks every attention entry point runs on its arguments (attention.cpp).

#include <torch/torch.h>

#include "attnkit/attention_types.h"

namespace attnkit::functional {

/// The checks of every attention call's arguments (attention.cpp), naming `fn` in their
/// messages: defined tensors of one rank, dtype and device, heads that group, the options'
/// ranges, and the mask against the problem.
void check_attention_arguments(const torch::Tensor& query, const torch::Tensor& key,
                               const torch::Tensor& value, const AttentionOptions& options,
                               const char* fn = "[attention]");

}  // namespace attnkit::functional
