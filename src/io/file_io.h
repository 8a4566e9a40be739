#pragma once

// What the readers and writers of src/io share: where an atomic write (attnkit::write_atomically,
// attnkit/serialize.h) puts its file, and the load of a dict into a module with every check made
// before a weight changes.

#include <functional>
#include <ostream>
#include <string>

#include "attnkit/serialize.h"

namespace attnkit::detail {

/// The file a write of `path` replaces: the end of a chain of symbolic links (a link to a
/// missing file gives that file's path), else `path` itself.
std::string write_destination(const std::string& path);

/// The temporary file a write of `path` goes through, unique to this process: beside the file it
/// replaces (`write_destination(path).<pid>.tmp`), so that the rename stays on one file system.
std::string temporary_path(const std::string& path);

/// `load_state_dict(module, dict, strict)`, with `source` (the dict's file) in its messages.
LoadResult load_into(torch::nn::Module& module, const StateDict& dict, bool strict,
                     const std::string& source);

}  // namespace attnkit::detail
