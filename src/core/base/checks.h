#pragma once

// Validation shared by every module: option checks for reset() and input checks for
// forward(). Messages name the module, the argument, the expected and the actual value.

#include <string>

#include <torch/torch.h>

namespace attnkit::detail {

/// "1.07 GB", "160 GB", "512 kB": a size in bytes for a message (decimal units).
std::string format_bytes(double bytes);

/// Refuses an allocation of `bytes` over attnkit::memory_budget(): "<who>: <what> needs
/// <size>, over attnkit's memory budget of <budget> (<where it comes from>); <way_out>".
/// `setter`: what a set budget is named after in the message (attnkit-train: its flag).
void check_memory_budget(const std::string& who, const std::string& what, double bytes,
                         const std::string& way_out,
                         const char* setter = "attnkit::set_memory_budget");

/// Fails unless `value > 0`: "[Module] option name must be > 0, got value".
void check_positive_option(const char* module, const char* name, int64_t value);

/// Fails unless `0 <= dropout < 1`.
void check_dropout_option(const char* module, double dropout);

/// Fails unless an option sliding_window_size is unset, or >= 1 on a causal module.
void check_window_option(const char* module, const c10::optional<int64_t>& window, bool causal);

/// Fails unless `query_offset >= 0`; `fn` names the caller ("[chunked_attention]").
void check_query_offset(const char* fn, int64_t query_offset);

/// Fails unless an unset `window_size`, or one >= 1 together with `is_causal` (a sliding
/// window is a restriction of the causal mask).
void check_window_size(const char* fn, const c10::optional<int64_t>& window_size, bool is_causal);

/// `device` with its index, as the tensors on it report theirs: a bare "cuda" is the current
/// GPU (where LibTorch sees one); any other device as it is.
torch::Device indexed_device(const torch::Device& device);

/// Query heads per key/value head of query (b, ..., H, n, hd) against key (b, ..., G, m, hd):
/// 1 for tensors below 4-D (no head dimension) or with equal head counts; fails unless G
/// divides H.
int64_t query_heads_per_kv_head(const char* fn, const torch::Tensor& query,
                                const torch::Tensor& key);

/// What a module's forward accepts.
struct InputSpec {
  int64_t d_in;
  /// 0 = no limit on num_tokens.
  int64_t context_length = 0;
  /// Accept (n, d_in) besides (b, n, d_in).
  bool allow_unbatched = false;
};

/// Checks `x` against `spec` and against `reference` (a parameter of the module) for
/// device and dtype. `module` is the module's name as printed in messages, `argument` the
/// argument's.
void check_forward_input(const char* module, const torch::Tensor& x, const InputSpec& spec,
                         const torch::Tensor& reference, const char* argument = "x");

/// "[2, 6, 3]"
std::string shape_string(const torch::Tensor& t);

/// Fails ("WHO: 'PATH' is a directory; expected a file") when `path` names a directory, which
/// a std::fstream opens without complaint and then fails to read or replace.
void check_not_directory(const std::string& who, const std::string& path);

}  // namespace attnkit::detail
