#include "attnkit/rope.h"

#include <cmath>

#include "core/base/checks.h"

namespace attnkit::functional {

namespace {

// Llama 3.1's smoothing of inv_freq (head_dim / 2) by wavelength 2 pi / inv_freq.
torch::Tensor smooth_frequencies(const torch::Tensor& inv_freq, const RopeFrequencyConfig& config) {
  const double context = static_cast<double>(config.original_context_length());
  const double low_freq_wavelen = context / config.low_freq_factor();
  const double high_freq_wavelen = context / config.high_freq_factor();
  const auto wavelen = (2.0 * std::acos(-1.0)) / inv_freq;
  const auto scaled = inv_freq / config.factor();
  const auto smooth = (context / wavelen - config.low_freq_factor()) /
                      (config.high_freq_factor() - config.low_freq_factor());
  const auto blended = (1.0 - smooth) * scaled + smooth * inv_freq;
  const auto long_waves = torch::where(wavelen > low_freq_wavelen, scaled, inv_freq);
  const auto medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen);
  return torch::where(medium, blended, long_waves);
}

void check_frequency_config(const RopeFrequencyConfig& config) {
  const char* fn = "[compute_rope_params]";
  TORCH_CHECK(config.factor() > 0.0 && std::isfinite(config.factor()), fn,
              " freq_config.factor must be > 0, got ", config.factor());
  TORCH_CHECK(config.low_freq_factor() > 0.0, fn, " freq_config.low_freq_factor must be > 0, got ",
              config.low_freq_factor());
  TORCH_CHECK(config.high_freq_factor() > config.low_freq_factor(), fn,
              " freq_config.high_freq_factor must be > low_freq_factor (", config.low_freq_factor(),
              "), got ", config.high_freq_factor());
  TORCH_CHECK(config.original_context_length() >= 1, fn,
              " freq_config.original_context_length must be >= 1, got ",
              config.original_context_length());
}

// The checks both apply_rope overloads share: x (b, h, n, d) with d even, and tables
// (context_length, d) on x's device.
void check_rope_inputs(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const char* fn = "[apply_rope]";
  TORCH_CHECK(x.defined() && x.dim() == 4 && x.is_floating_point(), fn,
              " x must be a floating (b, h, n, head_dim) tensor, got ",
              x.defined() ? c10::str(detail::shape_string(x), " ", x.scalar_type())
                          : std::string("an undefined tensor"));
  TORCH_CHECK(x.size(3) % 2 == 0, fn, " x's head_dim must be even (RoPE rotates pairs), got ",
              x.size(3));
  for (const auto& [name, table] : {std::pair{"cos", cos}, std::pair{"sin", sin}}) {
    TORCH_CHECK(table.defined() && table.dim() == 2 && table.size(1) == x.size(3) &&
                    table.is_floating_point(),
                fn, " ", name, " must be a floating (context_length, ", x.size(3),
                ") table from compute_rope_params, got ",
                table.defined() ? c10::str(detail::shape_string(table), " ", table.scalar_type())
                                : std::string("an undefined tensor"));
    TORCH_CHECK(table.device() == x.device(), fn, " ", name, " is on ", table.device(),
                " but x is on ", x.device());
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), fn, " cos and sin must have one shape, got ",
              detail::shape_string(cos), " and ", detail::shape_string(sin));
}

void check_positions(int64_t first, int64_t last_end, int64_t n, int64_t context_length) {
  TORCH_CHECK(first >= 0, "[apply_rope] offset must be >= 0, got ", first);
  TORCH_CHECK(last_end <= context_length, "[apply_rope] positions up to ", last_end - 1,
              " (offset ", last_end - n, " + ", n, " tokens) pass the tables' context_length ",
              context_length, "; compute_rope_params with a larger context_length");
}

// x rotated by the angles whose cosines and sines are `c` and `s`, (1 or b, 1, n, d / 2).
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& c, const torch::Tensor& s,
                     RopeLayout layout) {
  const auto b = x.size(0), h = x.size(1), n = x.size(2), half = x.size(3) / 2;
  // Split-half: (b, h, n, d) -> (b, h, n, 2, d/2), pair i = (x[i], x[i + d/2]).
  // Interleaved: (b, h, n, d) -> (b, h, n, d/2, 2), pair i = (x[2i], x[2i + 1]).
  const bool split_half = layout == RopeLayout::kSplitHalf;
  const int64_t pair_dim = split_half ? 3 : 4;
  const auto pairs = split_half ? x.reshape({b, h, n, 2, half}) : x.reshape({b, h, n, half, 2});
  const auto first = pairs.select(pair_dim, 0);
  const auto second = pairs.select(pair_dim, 1);
  const auto rotated = torch::stack({first * c - second * s, second * c + first * s}, pair_dim);
  return rotated.reshape({b, h, n, 2 * half}).to(x.scalar_type());
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> compute_rope_params(
    int64_t head_dim, double theta_base, int64_t context_length,
    const c10::optional<RopeFrequencyConfig>& freq_config, torch::ScalarType dtype) {
  const char* fn = "[compute_rope_params]";
  TORCH_CHECK(head_dim >= 2 && head_dim % 2 == 0, fn,
              " head_dim must be even and >= 2 (RoPE rotates pairs), got ", head_dim);
  TORCH_CHECK(theta_base > 0.0 && std::isfinite(theta_base), fn, " theta_base must be > 0, got ",
              theta_base);
  TORCH_CHECK(context_length >= 1, fn, " context_length must be >= 1, got ", context_length);
  TORCH_CHECK(c10::isFloatingType(dtype), fn, " dtype must be floating, got ", dtype);
  const auto options = torch::TensorOptions().dtype(dtype);
  // inv_freq[i] = theta_base^(-2i / head_dim), i < head_dim / 2
  auto inv_freq = 1.0 / torch::pow(theta_base, torch::arange(0, head_dim, 2, options) / head_dim);
  if (freq_config) {
    check_frequency_config(*freq_config);
    inv_freq = smooth_frequencies(inv_freq, *freq_config);
  }
  const auto positions = torch::arange(context_length, options);
  const auto angles = positions.unsqueeze(1) * inv_freq.unsqueeze(0);  // (context, d / 2)
  const auto both_halves = torch::cat({angles, angles}, 1);            // (context, d)
  return {torch::cos(both_halves), torch::sin(both_halves)};
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         int64_t offset, RopeLayout layout) {
  check_rope_inputs(x, cos, sin);
  const auto n = x.size(2), half = x.size(3) / 2;
  check_positions(offset, offset + n, n, cos.size(0));
  // (context, d) -> rows offset .. offset + n, first half -> (1, 1, n, d / 2)
  const auto rows = [&](const torch::Tensor& table) {
    return table.narrow(0, offset, n).narrow(1, 0, half).view({1, 1, n, half});
  };
  return rotate(x, rows(cos), rows(sin), layout);
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& offsets, RopeLayout layout) {
  check_rope_inputs(x, cos, sin);
  const auto b = x.size(0), n = x.size(2), half = x.size(3) / 2;
  TORCH_CHECK(offsets.defined() && offsets.scalar_type() == torch::kInt64 &&
                  (offsets.dim() == 0 || (offsets.dim() == 1 && offsets.size(0) == b)),
              "[apply_rope] offsets must be an int64 scalar or (", b, ") tensor, got ",
              offsets.defined()
                  ? c10::str(detail::shape_string(offsets), " ", offsets.scalar_type())
                  : std::string("an undefined tensor"));
  if (offsets.dim() == 0)
    return apply_rope(x, cos, sin, offsets.item<int64_t>(), layout);
  const auto row_offsets = offsets.to(x.device());
  if (b > 0) {
    check_positions(row_offsets.min().item<int64_t>(), row_offsets.max().item<int64_t>() + n, n,
                    cos.size(0));
  }
  // positions (b, n): row r's token i at offsets[r] + i
  const auto positions = row_offsets.unsqueeze(1) + torch::arange(n, row_offsets.options());
  // (context, d) -> (b * n, d / 2) rows -> (b, 1, n, d / 2)
  const auto rows = [&](const torch::Tensor& table) {
    return table.narrow(1, 0, half).index_select(0, positions.flatten()).view({b, 1, n, half});
  };
  return rotate(x, rows(cos), rows(sin), layout);
}

}  // namespace attnkit::functional

namespace attnkit::detail {

RopeTables::RopeTables(const RopeOptions& options, int64_t head_dim)
    : layout_(options.layout()), converted_(std::make_shared<Converted>()) {
  std::tie(cos64_, sin64_) =
      functional::compute_rope_params(head_dim, options.theta_base(), options.context_length(),
                                      options.freq_config(), torch::kFloat64);
}

std::pair<torch::Tensor, torch::Tensor> RopeTables::tables_like(const torch::Tensor& heads) const {
  TORCH_CHECK(defined(), "[RopeTables] no tables: the module has no rope option");
  const auto dtype = heads.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  std::lock_guard<std::mutex> lock(converted_->mutex);
  auto& kept = *converted_;
  if (!kept.cos.defined() || kept.cos.scalar_type() != dtype ||
      kept.cos.device() != heads.device()) {
    kept.cos = cos64_.to(heads.device(), dtype);
    kept.sin = sin64_.to(heads.device(), dtype);
  }
  return {kept.cos, kept.sin};
}

torch::Tensor RopeTables::rotate(const torch::Tensor& heads, int64_t offset) const {
  const auto [cos, sin] = tables_like(heads);
  return functional::apply_rope(heads, cos, sin, offset, layout_);
}

torch::Tensor RopeTables::rotate(const torch::Tensor& heads, const torch::Tensor& offsets) const {
  const auto [cos, sin] = tables_like(heads);
  return functional::apply_rope(heads, cos, sin, offsets, layout_);
}

}  // namespace attnkit::detail
