#pragma once

// A pickle reader that accepts only what a dict of tensors needs: the C++ counterpart of
// PyTorch's weights-only unpickler. Nothing in it decides how much memory is allocated: every
// size is checked against the bytes that are there first.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "attnkit/serialize.h"

namespace attnkit::detail {

/// A storage's bytes by its key (torch.save's data/<key> record): where they start, how many.
using StorageLoader = std::function<std::pair<const char*, uint64_t>(const std::string& key)>;

/// The dict of tensors that `pickle` (torch.save's data.pkl) holds, its storages read through
/// `load_storage`. Errors are c10::Errors that start with "[read_state_dict] '<name>'".
StateDict unpickle_state_dict(const std::string& pickle, const std::string& name,
                              const StorageLoader& load_storage);

}  // namespace attnkit::detail
