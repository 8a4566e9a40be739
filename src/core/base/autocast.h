#pragma once

// LibTorch's autocast as the kernels see it: its state per device type, a guard that keeps it
// off, and the dtype a tensor runs attention in under it (autocast.cpp).

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

namespace attnkit::detail {

/// Keeps LibTorch's autocast off while alive. The kernels choose their own dtypes (a 16-bit
/// call is computed in float32), which autocast would cast back down; the planner runs every
/// call under one, and the kernels' own backward functions run under one too.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

/// LibTorch's autocast on this thread for one device type: whether it is on, and its dtype.
struct AutocastState {
  bool enabled = false;
  torch::ScalarType dtype = torch::kFloat;
};

/// The autocast state for `device_type` (kCPU and kCUDA; any other type: off).
AutocastState autocast_state(c10::DeviceType device_type);

/// Sets the autocast state for `device_type` (kCPU or kCUDA).
void set_autocast_state(c10::DeviceType device_type, const AutocastState& state);

/// The dtype a query, key or value runs attention in: under LibTorch's autocast for its
/// device, the autocast dtype (float64 keeps its own, as PyTorch's autocast leaves it); else
/// its own.
torch::ScalarType attention_dtype(const torch::Tensor& tensor);

}  // namespace attnkit::detail
