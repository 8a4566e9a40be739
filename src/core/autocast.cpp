// attnkit::Autocast (autocast.h): LibTorch's autocast switches behind one guard, through the
// version file's autocast_state (sdpa_kernel.cpp).

#include "attnkit/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include "attnkit/attention.h"
#include "core/kernels.h"

namespace attnkit {

Autocast::Autocast(c10::DeviceType device_type, c10::ScalarType dtype) : device_type_(device_type) {
  TORCH_CHECK(device_type == c10::DeviceType::CPU || device_type == c10::DeviceType::CUDA,
              "[Autocast] device_type: expected cpu or cuda, got ", device_type);
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "[Autocast] dtype: expected BFloat16 or Half, got ", dtype);
  TORCH_CHECK(
      dtype != torch::kHalf || device_type != c10::DeviceType::CPU || cpu_multiplies_float16(),
      "[Autocast] dtype Half on the CPU needs a LibTorch with float16 matrix products "
      "(2.x; this one has none); use BFloat16, or a GPU");
  const auto previous = detail::autocast_state(device_type);
  was_enabled_ = previous.enabled;
  previous_dtype_ = previous.dtype;
  detail::set_autocast_state(device_type, {true, dtype});
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  detail::set_autocast_state(device_type_, {was_enabled_, previous_dtype_});
  // As PyTorch's torch.autocast: the cast weights are kept for the outermost region only.
  if (at::autocast::decrement_nesting() == 0)
    at::autocast::clear_cache();
}

}  // namespace attnkit
