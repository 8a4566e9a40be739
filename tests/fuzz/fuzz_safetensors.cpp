// libFuzzer target: attnkit::load_safetensors on arbitrary bytes (the file is a memfd, so the
// reader maps it as it maps a real file), then a non-strict load into a module through a name
// map. Any outcome but a value or a c10::Error is a finding (crash, hang, leak, or an
// allocation above -malloc_limit_mb; see scripts/fuzz.sh).

#include <cstddef>
#include <cstdint>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

#include "attnkit/attnkit.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static attnkit::MultiHeadAttention module(/*d_in=*/6, /*d_out=*/8, /*context_length=*/7,
                                            /*dropout=*/0.0, /*num_heads=*/2);
  static const attnkit::NameMap names{
      "model.",
      {R"(.*\.bias_mask)"},
      {{R"(c_attn\.weight)", {"W_query.weight", "W_key.weight", "W_value.weight"}, true}}};
  const int fd = ::memfd_create("fuzz-input.safetensors", MFD_CLOEXEC);
  if (fd < 0)
    __builtin_trap();
  if (size > 0 && ::write(fd, data, size) != static_cast<ssize_t>(size))
    __builtin_trap();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    attnkit::load_safetensors_metadata(path);
    const auto dict = attnkit::load_safetensors(path);
    for (const auto& item : dict)
      item.value().sum();  // every byte a tensor views is readable
    attnkit::load_safetensors(*module, path, names, /*strict=*/false);
  } catch (const c10::Error&) {
  }
  ::close(fd);
  return 0;
}
