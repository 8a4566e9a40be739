// libFuzzer target: attnkit::read_state_dict's parser, then load_state_dict into a module,
// on arbitrary bytes. Any outcome but a value or a c10::Error is a finding (crash, hang,
// leak, or an allocation above -malloc_limit_mb; see scripts/fuzz.sh).

#include <cstddef>
#include <cstdint>
#include <string>

#include "attnkit/attnkit.h"
#include "io/state_dict_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static attnkit::MultiHeadAttention module(/*d_in=*/6, /*d_out=*/8, /*context_length=*/7,
                                            /*dropout=*/0.0, /*num_heads=*/2);
  try {
    const auto dict = attnkit::detail::parse_state_dict(
        std::string(reinterpret_cast<const char*>(data), size), "fuzz-input.pt");
    attnkit::load_state_dict(*module, dict, /*strict=*/false);
  } catch (const c10::Error&) {
  }
  return 0;
}
