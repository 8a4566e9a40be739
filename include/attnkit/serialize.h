#pragma once

/// State dicts that cross between C++ and Python.
///
/// The file format is the one `torch.save` writes (a zip archive holding a pickled dict of
/// tensors), naming only what `torch.save` names, so that Python's `torch.load(path)` returns
/// the dict with the weights-only unpickler too (PyTorch 2.6's default; `weights_only=True`
/// on 1.13), and the Python class's `load_state_dict` accepts it as is.
///
/// Reading accepts only what a dict of tensors needs, like PyTorch's weights-only unpickler:
/// every zip record must match its CRC-32, every tensor must lie inside its storage, and no
/// global other than the tensor-rebuilding ones is called, so a damaged or hostile file is a
/// `c10::Error` that names the file (and the record), never a crash or a huge allocation.
/// From Python, `torch.save(model.state_dict(), path)` (an OrderedDict) and
/// `torch.save(dict(model.state_dict()), path)` both work.

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace attnkit {

/// Parameters and buffers by their Python `state_dict()` keys ("W_query.weight", "mask").
/// `state_dict(module)` has exactly the keys of the Python class's `state_dict()`: entries
/// that attnkit's module does not hold, such as the book's `mask` buffer of
/// MultiHeadAttention and MultiHeadAttentionCombinedQKV, are made at save time
/// (PythonOnlyState), so the Python class loads attnkit's files with its default strict
/// `load_state_dict`; loading ignores those keys.
using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

/// The module's parameters, then its buffers, then the Python-only entries of the module and
/// its submodules (PythonOnlyState), detached, under their state-dict keys.
/// Example: `for (const auto& item : attnkit::state_dict(*mha)) std::cout << item.key();`
StateDict state_dict(const torch::nn::Module& module);

/// Writes `dict` to `path` in torch.save's format. The file is written to a temporary
/// name, flushed and renamed, so `path` never holds a partial file.
/// Example: `attnkit::write_state_dict(attnkit::state_dict(*mha), "mha.pt");`
void write_state_dict(const StateDict& dict, const std::string& path);

/// Reads a dict of tensors written by `write_state_dict` or by Python's
/// `torch.save(state_dict, path)`. A missing, empty, truncated, damaged or foreign file is a
/// `c10::Error` naming the path.
/// Example: `auto dict = attnkit::read_state_dict("mha.pt");`
StateDict read_state_dict(const std::string& path);

/// Writes `path` so that it holds the old file or the whole new one, never a part: `write`
/// fills a stream on a temporary file beside the one replaced (`<file>.<pid>.tmp`), which is
/// flushed, checked, synced to disk and renamed over it. A symbolic link keeps pointing where
/// it pointed, at the new file. A FIFO or a device is written directly: there is no file to
/// rename over, and replacing one would destroy it. A directory is refused. A failure removes
/// the temporary file and is a `c10::Error` that starts with `who` and names the file.
/// write_state_dict and the safetensors writer write through it.
/// Example: `attnkit::write_atomically("a.json", "--json:", [&](std::ostream& o) { o << s; });`
void write_atomically(const std::string& path, const char* who,
                      const std::function<void(std::ostream&)>& write);

/// `write_state_dict(state_dict(module), path)`.
/// Example: `attnkit::save_state_dict(*mha, "mha.pt");`
void save_state_dict(const torch::nn::Module& module, const std::string& path);

/// What a non-strict load left out.
struct LoadResult {
  /// Keys of the module that the dict lacks (their values were left unchanged).
  std::vector<std::string> missing_keys;
  /// Keys of the dict that the module lacks (ignored).
  std::vector<std::string> unexpected_keys;
  /// Keys the module accepts and ignores, in strict loads too: the `mask` buffer of the Python
  /// MultiHeadAttention and MultiHeadAttentionCombinedQKV, which attnkit does not keep.
  std::vector<std::string> ignored_keys;
};

/// Copies `dict` into the module's parameters and buffers (converting dtype and device).
/// Every key and shape is checked before anything is copied, so a failed load leaves the
/// module untouched. A shape mismatch is always an error naming the key and both shapes;
/// with `strict` (the default) a missing or unexpected key is one too, otherwise they are
/// skipped and reported in the result.
/// Example: `attnkit::load_state_dict(*mha, dict, /*strict=*/false).missing_keys`
LoadResult load_state_dict(torch::nn::Module& module, const StateDict& dict, bool strict = true);

/// `load_state_dict(module, read_state_dict(path), strict)`, with the path in error messages.
/// Example: `attnkit::load_state_dict(*mha, "trained_in_python.pt");`
LoadResult load_state_dict(torch::nn::Module& module, const std::string& path, bool strict = true);

}  // namespace attnkit
