#pragma once

// Validation shared by every module: option checks for reset() and input checks for
// forward(). Messages name the module, the argument, the expected and the actual value.

#include <string>

#include <torch/torch.h>

namespace attnkit::detail {

/// Fails unless `value > 0`: "[Module] option name must be > 0, got value".
void check_positive_option(const char* module, const char* name, int64_t value);

/// Fails unless `0 <= dropout < 1`.
void check_dropout_option(const char* module, double dropout);

/// Fails unless `query_offset >= 0`; `fn` names the caller ("[chunked_attention]").
void check_query_offset(const char* fn, int64_t query_offset);

/// What a module's forward accepts.
struct InputSpec {
  int64_t d_in;
  /// 0 = no limit on num_tokens.
  int64_t context_length = 0;
  /// Accept (n, d_in) besides (b, n, d_in).
  bool allow_unbatched = false;
};

/// Checks `x` against `spec` and against `reference` (a parameter of the module) for
/// device and dtype. `module` is the module's name as printed in messages.
void check_forward_input(const char* module, const torch::Tensor& x, const InputSpec& spec,
                         const torch::Tensor& reference);

/// "[2, 6, 3]"
std::string shape_string(const torch::Tensor& t);

}  // namespace attnkit::detail
