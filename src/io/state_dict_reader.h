#pragma once

// The reader behind attnkit::read_state_dict: torch.save's zip archive (zip_archive.h), whose
// data.pkl a pickle reader that accepts only a dict of tensors reads (tensor_unpickler.h).

#include <string>

#include "attnkit/serialize.h"

namespace attnkit::detail {

/// Parses `bytes`, the whole file, as torch.save's format. Errors are c10::Errors that start
/// with "[read_state_dict] '<name>'" and say what is wrong (a damaged record names the record).
StateDict parse_state_dict(const std::string& bytes, const std::string& name);

}  // namespace attnkit::detail
