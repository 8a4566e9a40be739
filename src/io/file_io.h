#pragma once

// What the readers and writers of src/io share: the checked, atomic write of a file, and the
// load of a dict into a module with every check made before a weight changes.

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

/// Writes `path` so that it holds the old file or the whole new one, never a part: `write`
/// fills a stream on temporary_path(path), which is flushed, checked, synced to disk and
/// renamed over write_destination(path). A symbolic link keeps pointing where it pointed, at
/// the new file. A FIFO or a device is written directly: there is no file to rename over, and
/// replacing one would destroy it. A directory is refused. A failure removes the temporary
/// file and is an error that starts with `who` and names the file.
void write_atomically(const std::string& path, const char* who,
                      const std::function<void(std::ostream&)>& write);

/// `load_state_dict(module, dict, strict)`, with `source` (the dict's file) in its messages.
LoadResult load_into(torch::nn::Module& module, const StateDict& dict, bool strict,
                     const std::string& source);

}  // namespace attnkit::detail
