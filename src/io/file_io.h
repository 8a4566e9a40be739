#pragma once

// What the readers and writers of src/io share: the checked, atomic write of a file, and the
// load of a dict into a module with every check made before a weight changes.

#include <functional>
#include <ostream>
#include <string>

#include "attnkit/serialize.h"

namespace attnkit::detail {

/// Writes `path` through a temporary name unique to this process (`path.tmp.<pid>`): `write`
/// fills the stream, which is then flushed and checked, and the file renamed to `path`. A
/// failure removes the temporary file and is an error that starts with `who` and names the
/// file, so `path` never holds a partial file.
void write_atomically(const std::string& path, const char* who,
                      const std::function<void(std::ostream&)>& write);

/// `load_state_dict(module, dict, strict)`, with `source` (the dict's file) in its messages.
LoadResult load_into(torch::nn::Module& module, const StateDict& dict, bool strict,
                     const std::string& source);

}  // namespace attnkit::detail
