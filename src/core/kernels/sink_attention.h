#pragma once

// Attention sinks (sink_attention.cpp): a split call's forward and backward with each head's
// sink logit in the softmax.

#include "core/plan/kernel_spec.h"

namespace attnkit::detail {

KernelSpec sinks_spec();

}  // namespace attnkit::detail
