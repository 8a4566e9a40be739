#pragma once

/// LibTorch's autocast (automatic mixed precision) from C++, on every LibTorch attnkit
/// builds with (1.13 and 2.x name its switches differently).
///
/// While an `Autocast` is alive on a thread, the ops LibTorch lists as safe in 16 bits
/// (linear layers, matrix products) run in `dtype` on that thread for tensors on
/// `device_type`, as PyTorch's `torch.autocast(device_type, dtype)` does; the rest keep their
/// dtype. attnkit's attention under autocast: its floating query, key and value are cast to
/// the autocast dtype (as PyTorch's SDPA is), and the call is computed as every 16-bit call
/// is, in float32 inside and rounded once; the result comes back in the autocast dtype. A
/// module takes inputs in its parameters' dtype or in the autocast dtype.
///
/// Run backward after the guard is gone, as in PyTorch: backward's ops follow the dtypes
/// forward recorded.
///
/// Example:
///   { attnkit::Autocast autocast(torch::kCPU, torch::kBFloat16);
///     loss = criterion(model->forward(x), y); }
///   loss.backward();

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace attnkit {

/// Whether this LibTorch multiplies float16 matrices on the CPU (2.x does; 1.13 does not, so
/// its float16 modules need a GPU). attnkit's attention core computes 16-bit inputs in
/// float32 either way. Probed once.
bool cpu_multiplies_float16();

class Autocast {
 public:
  /// Turns autocast on for `device_type` (kCPU or kCUDA) in `dtype` (kBFloat16 or kHalf) on
  /// this thread. float16 on the CPU needs a LibTorch with float16 matrix products
  /// (cpu_multiplies_float16(); 1.13 has none). Anything else is refused, by name.
  Autocast(c10::DeviceType device_type, c10::ScalarType dtype);
  /// Restores the state it found (autocast on or off, and its dtype), and frees LibTorch's
  /// cache of 16-bit weight copies when the outermost guard ends.
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
  c10::ScalarType previous_dtype_;
};

}  // namespace attnkit
