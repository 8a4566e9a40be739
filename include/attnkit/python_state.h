#pragma once

/// State-dict entries that a module's Python class has and attnkit's module does not hold.

#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace attnkit {

/// A module whose Python class keeps state that attnkit's module makes no use of, such as the
/// book's n^2 `mask` buffer of MultiHeadAttention. `attnkit::state_dict` asks each module for
/// these entries and writes them, made at save time with the Python buffer's dtype and values,
/// so that Python's strict `load_state_dict` takes attnkit's files; `attnkit::load_state_dict`
/// accepts and ignores the same keys (reported in `LoadResult::ignored_keys`).
class PythonOnlyState {
 public:
  virtual ~PythonOnlyState() = default;
  /// The entries, keyed relative to the module ("mask"), as the Python `state_dict()` has them.
  virtual std::vector<std::pair<std::string, torch::Tensor>> python_only_state() const = 0;
  /// Their keys alone, which a load accepts and ignores; override where making the entries
  /// costs (the default makes them).
  virtual std::vector<std::string> python_only_keys() const {
    std::vector<std::string> keys;
    for (const auto& entry : python_only_state())
      keys.push_back(entry.first);
    return keys;
  }
};

}  // namespace attnkit
