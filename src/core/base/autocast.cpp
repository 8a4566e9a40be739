// LibTorch's autocast: attnkit::Autocast (attnkit/autocast.h), its switches on each LibTorch
// (named per device type until 2.4, by a device-type argument since), the dtype a tensor runs
// attention in under it, and whether the CPU multiplies float16 (probed once).

#include "core/base/autocast.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "attnkit/autocast.h"

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

namespace attnkit::detail {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
AutocastState autocast_state(c10::DeviceType device_type) {
  if (device_type != c10::DeviceType::CPU && device_type != c10::DeviceType::CUDA)
    return {};
  return {at::autocast::is_autocast_enabled(device_type),
          at::autocast::get_autocast_dtype(device_type)};
}

void set_autocast_state(c10::DeviceType device_type, const AutocastState& state) {
  at::autocast::set_autocast_enabled(device_type, state.enabled);
  at::autocast::set_autocast_dtype(device_type, state.dtype);
}
#else
AutocastState autocast_state(c10::DeviceType device_type) {
  if (device_type == c10::DeviceType::CPU)
    return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
  if (device_type == c10::DeviceType::CUDA)
    return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  return {};
}

void set_autocast_state(c10::DeviceType device_type, const AutocastState& state) {
  if (device_type == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(state.enabled);
    at::autocast::set_autocast_cpu_dtype(state.dtype);
  } else {
    at::autocast::set_enabled(state.enabled);
    at::autocast::set_autocast_gpu_dtype(state.dtype);
  }
}
#endif

torch::ScalarType attention_dtype(const torch::Tensor& tensor) {
  const auto own = tensor.scalar_type();
  if (own == torch::kDouble || !tensor.is_floating_point())
    return own;
  const auto autocast = autocast_state(tensor.device().type());
  return autocast.enabled ? autocast.dtype : own;
}

}  // namespace attnkit::detail

namespace attnkit {

bool cpu_multiplies_float16() {
  static const bool multiplies = [] {
    try {
      const auto one = torch::ones({1, 1}, torch::kHalf);
      torch::mm(one, one);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return multiplies;
}

}  // namespace attnkit
