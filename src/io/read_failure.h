#pragma once

// How the readers of torch.save's format (zip_archive.cpp, tensor_unpickler.cpp,
// state_dict_reader.cpp) fail: a c10::Error that starts with "[read_state_dict] '<file>'".

#include <cstdint>
#include <string>

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace attnkit::detail {

inline constexpr const char* kPythonHint =
    "expected a dict of tensors saved by attnkit::save_state_dict or by Python's "
    "torch.save(model.state_dict(), path)";

template <typename... Args>
[[noreturn]] void read_failure(const std::string& name, const Args&... args) {
  throw c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                   c10::str("[read_state_dict] '", name, "' ", args...));
}

}  // namespace attnkit::detail
