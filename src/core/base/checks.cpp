#include "core/base/checks.h"

#include <filesystem>
#include <system_error>

#include "attnkit/attention_types.h"
#include "attnkit/autocast.h"
#include "core/base/autocast.h"

#include <sstream>

namespace attnkit::detail {

torch::Device indexed_device(const torch::Device& device) {
  if (!device.is_cuda() || device.has_index() || !torch::cuda::is_available())
    return device;
  return torch::empty({0}, torch::TensorOptions().device(device)).device();
}

void check_positive_option(const char* module, const char* name, int64_t value) {
  TORCH_CHECK(value > 0, "[", module, "] option ", name, " must be > 0, got ", value);
}

void check_dropout_option(const char* module, double dropout) {
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "[", module,
              "] option dropout must be in [0, 1), got ", dropout);
}

void check_window_option(const char* module, const c10::optional<int64_t>& window, bool causal) {
  if (!window.has_value())
    return;
  TORCH_CHECK(*window >= 1, "[", module, "] option sliding_window_size must be >= 1, got ",
              *window);
  TORCH_CHECK(causal, "[", module, "] option sliding_window_size (", *window,
              ") limits how far back a token attends, so it needs causal = true");
}

void check_query_offset(const char* fn, int64_t query_offset) {
  TORCH_CHECK(query_offset >= 0, fn,
              " query_offset must be >= 0 (the key position of query 0), got ", query_offset);
}

void check_window_size(const char* fn, const c10::optional<int64_t>& window_size, bool is_causal) {
  if (!window_size.has_value())
    return;
  TORCH_CHECK(*window_size >= 1, fn, " window_size must be >= 1, got ", *window_size);
  TORCH_CHECK(is_causal, fn, " window_size (", *window_size,
              ") restricts the causal mask, so it needs is_causal = true");
}

int64_t query_heads_per_kv_head(const char* fn, const torch::Tensor& query,
                                const torch::Tensor& key) {
  if (query.dim() < 4 || key.dim() < 4 || query.size(-3) == key.size(-3))
    return 1;
  const int64_t heads = query.size(-3), kv_heads = key.size(-3);
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0, fn,
              " key and value heads (dim -3) must divide the query heads (grouped-query "
              "attention), got ",
              kv_heads, " key/value heads for ", heads, " query heads (query ", shape_string(query),
              ", key ", shape_string(key), ")");
  return heads / kv_heads;
}

void check_not_directory(const std::string& who, const std::string& path) {
  std::error_code error;
  TORCH_CHECK(!std::filesystem::is_directory(path, error), who, ": '", path,
              "' is a directory; expected a file");
}

std::string shape_string(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

void check_forward_input(const char* module, const torch::Tensor& x, const InputSpec& spec,
                         const torch::Tensor& reference, const char* argument) {
  TORCH_CHECK(x.defined(), "[", module, "::forward] ", argument,
              ": expected a tensor, got an undefined one");
  const auto rank = x.dim();
  if (spec.allow_unbatched) {
    TORCH_CHECK(rank == 2 || rank == 3, "[", module, "::forward] ", argument,
                ": expected a 2-D (num_tokens, d_in) or 3-D (b, num_tokens, d_in) "
                "tensor, got ",
                rank, "-D with shape ", shape_string(x));
  } else {
    TORCH_CHECK(rank == 3, "[", module, "::forward] ", argument,
                ": expected a 3-D tensor (b, num_tokens, d_in), got ", rank, "-D with shape ",
                shape_string(x));
  }
  TORCH_CHECK(x.size(-1) == spec.d_in, "[", module, "::forward] ", argument,
              ": expected last dimension d_in = ", spec.d_in, ", got ", x.size(-1), " (shape ",
              shape_string(x), ")");
  const auto num_tokens = x.size(-2);
  TORCH_CHECK(spec.context_length == 0 || num_tokens <= spec.context_length, "[", module,
              "::forward] ", argument, ": num_tokens = ", num_tokens,
              " exceeds context_length = ", spec.context_length, " (shape ", shape_string(x), ")");
  TORCH_CHECK(x.device() == reference.device(), "[", module, "::forward] ", argument,
              ": expected device ", reference.device(),
              " (where the module's parameters are), got ", x.device());
  // Under autocast, inputs in the autocast dtype are the parameters' as cast.
  TORCH_CHECK(x.scalar_type() == reference.scalar_type() ||
                  (x.is_floating_point() && attention_dtype(x) == attention_dtype(reference) &&
                   attention_dtype(x) == x.scalar_type()),
              "[", module, "::forward] ", argument, ": expected dtype ", reference.scalar_type(),
              " (the module's parameters), got ", x.scalar_type());
  TORCH_CHECK(x.scalar_type() != torch::kHalf || !x.device().is_cpu() || cpu_multiplies_float16(),
              "[", module, "::forward] ", argument,
              ": float16 on the CPU needs a LibTorch with float16 matrix products (2.x; this "
              "one has none); use bfloat16 or float32, or a GPU");
}

}  // namespace attnkit::detail
