#include "checks.h"

#include <sstream>

namespace attnkit::detail {

void check_positive_option(const char* module, const char* name, int64_t value) {
  TORCH_CHECK(value > 0, "[", module, "] option ", name, " must be > 0, got ", value);
}

void check_dropout_option(const char* module, double dropout) {
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "[", module,
              "] option dropout must be in [0, 1), got ", dropout);
}

void check_query_offset(const char* fn, int64_t query_offset) {
  TORCH_CHECK(query_offset >= 0, fn,
              " query_offset must be >= 0 (the key position of query 0), got ", query_offset);
}

std::string shape_string(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

void check_forward_input(const char* module, const torch::Tensor& x, const InputSpec& spec,
                         const torch::Tensor& reference) {
  TORCH_CHECK(x.defined(), "[", module, "::forward] x: expected a tensor, got an undefined one");
  const auto rank = x.dim();
  if (spec.allow_unbatched) {
    TORCH_CHECK(rank == 2 || rank == 3, "[", module,
                "::forward] x: expected a 2-D (num_tokens, d_in) or 3-D (b, num_tokens, d_in) "
                "tensor, got ",
                rank, "-D with shape ", shape_string(x));
  } else {
    TORCH_CHECK(rank == 3, "[", module,
                "::forward] x: expected a 3-D tensor (b, num_tokens, d_in), got ", rank,
                "-D with shape ", shape_string(x));
  }
  TORCH_CHECK(x.size(-1) == spec.d_in, "[", module,
              "::forward] x: expected last dimension d_in = ", spec.d_in, ", got ", x.size(-1),
              " (shape ", shape_string(x), ")");
  const auto num_tokens = x.size(-2);
  TORCH_CHECK(spec.context_length == 0 || num_tokens <= spec.context_length, "[", module,
              "::forward] x: num_tokens = ", num_tokens,
              " exceeds context_length = ", spec.context_length, " (shape ", shape_string(x), ")");
  TORCH_CHECK(x.device() == reference.device(), "[", module, "::forward] x: expected device ",
              reference.device(), " (where the module's parameters are), got ", x.device());
  TORCH_CHECK(x.scalar_type() == reference.scalar_type(), "[", module,
              "::forward] x: expected dtype ", reference.scalar_type(),
              " (the module's parameters), got ", x.scalar_type());
}

}  // namespace attnkit::detail
