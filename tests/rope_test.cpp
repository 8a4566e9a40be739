// Rotary position embeddings: compute_rope_params and apply_rope against
// scripts/rope_reference.py (float64 1e-10, float32 1e-5, outputs and gradients, both layouts,
// with and without Llama 3.1 smoothing, offsets scalar and per row); the property RoPE exists
// for; bad input is named.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attnkit/rope.h"
#include "source_paths.h"
#include "test_support.h"

namespace {

using attnkit::functional::apply_rope;
using attnkit::functional::compute_rope_params;
using attnkit::functional::RopeFrequencyConfig;
using attnkit::functional::RopeLayout;
using attnkit::testing::agreement;
using attnkit::testing::expect_error_containing;
using attnkit::testing::tensors_close;

const std::string kRopeReference =
    std::string(attnkit::testing::kSourceDir) + "/scripts/rope_reference.py";

attnkit::StateDict rope_golden() {
  return attnkit::read_state_dict(std::string(attnkit::testing::kSourceDir) +
                                  "/data/golden/rope/reference.pt");
}

// The reference's configurations (scripts/rope_reference.py): head_dim 16, theta 10,000,
// context 32; "llama31" smooths with factor 4 around original_context_length 16.
std::tuple<torch::Tensor, torch::Tensor> reference_tables(const std::string& freq,
                                                          torch::ScalarType dtype) {
  c10::optional<RopeFrequencyConfig> config;
  if (freq == "llama31")
    config = RopeFrequencyConfig()
                 .factor(4)
                 .low_freq_factor(1)
                 .high_freq_factor(4)
                 .original_context_length(16);
  return compute_rope_params(16, 10000.0, 32, config, dtype);
}

TEST(RopeReference, TablesMatchWithAndWithoutFrequencySmoothing) {
  const auto golden = rope_golden();
  for (const std::string freq : {"none", "llama31"}) {
    for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
      const auto [cos, sin] = reference_tables(freq, dtype);
      EXPECT_EQ(cos.scalar_type(), dtype);
      const auto tolerance = agreement(dtype);
      EXPECT_TRUE(tensors_close(freq + " cos", cos.to(torch::kFloat64),
                                golden["tables/" + freq + "/cos"], tolerance));
      EXPECT_TRUE(tensors_close(freq + " sin", sin.to(torch::kFloat64),
                                golden["tables/" + freq + "/sin"], tolerance));
    }
  }
  // With Llama 3.1's defaults (original context 8,192) smoothing keeps the short wavelengths
  // (2 pi for the first frequency, under 8,192 / 4) and divides the longest (about 19,900 at
  // head_dim 16) by factor 8.
  const auto [plain_cos, plain_sin] = compute_rope_params(16, 10000.0, 32, {}, torch::kFloat64);
  const auto [smooth_cos, smooth_sin] =
      compute_rope_params(16, 10000.0, 32, RopeFrequencyConfig(), torch::kFloat64);
  EXPECT_TRUE(
      tensors_close("fastest frequency", smooth_sin.select(1, 0), plain_sin.select(1, 0), 0));
  const auto last_angle = [](const torch::Tensor& sin) { return torch::asin(sin[1][7]); };
  EXPECT_NEAR(last_angle(smooth_sin).item<double>() * 8, last_angle(plain_sin).item<double>(),
              1e-12);
}

TEST(RopeReference, EveryLayoutFrequencyAndOffsetMatchesWithGradients) {
  const auto golden = rope_golden();
  int cases = 0;
  for (const auto& [layout_name, layout] : {std::pair{"split_half", RopeLayout::kSplitHalf},
                                            std::pair{"interleaved", RopeLayout::kInterleaved}}) {
    for (const std::string freq : {"none", "llama31"}) {
      for (const std::string offsets : {"scalar", "rows"}) {
        const std::string key = std::string("case/") + layout_name + "/" + freq + "/" + offsets;
        for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
          const auto [cos, sin] = reference_tables(freq, dtype);
          const auto x = golden["inputs/x"].to(dtype).detach().requires_grad_(true);
          const auto out = offsets == "scalar"
                               ? apply_rope(x, cos, sin, /*offset=*/3, layout)
                               : apply_rope(x, cos, sin, golden["inputs/offsets"], layout);
          (out * golden["inputs/w"].to(dtype)).sum().backward();
          const auto label = key + " " + std::string(c10::toString(dtype));
          EXPECT_EQ(out.scalar_type(), dtype) << label;
          EXPECT_TRUE(tensors_close(label + " out", out.detach().to(torch::kFloat64),
                                    golden[key + "/out"], agreement(dtype)));
          EXPECT_TRUE(tensors_close(label + " dx", x.grad().to(torch::kFloat64),
                                    golden[key + "/dx"], agreement(dtype)));
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 8);
}

TEST(RopeReference, PythonReferenceAgreesWithItsFile) {
  const auto [status, output] = attnkit::testing::run_leg_python(kRopeReference, "--check");
  ASSERT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK torch"), std::string::npos) << output;
}

// Why RoPE is used: a query at position p against a key at position p' scores by p - p' alone,
// and each head keeps its length.
TEST(Rope, ScoresDependOnRelativePositionOnlyAndNormsAreKept) {
  torch::manual_seed(0);
  const auto [cos, sin] = compute_rope_params(8, 10000.0, 64, {}, torch::kFloat64);
  const auto q = torch::randn({1, 1, 1, 8}, torch::kFloat64);
  const auto k = torch::randn({1, 1, 1, 8}, torch::kFloat64);
  for (const auto layout : {RopeLayout::kSplitHalf, RopeLayout::kInterleaved}) {
    const auto score = [&](int64_t p, int64_t p_key) {
      return (apply_rope(q, cos, sin, p, layout) * apply_rope(k, cos, sin, p_key, layout))
          .sum()
          .item<double>();
    };
    EXPECT_NEAR(score(5, 2), score(40, 37), 1e-12);
    EXPECT_NEAR(score(0, 9), score(20, 29), 1e-12);
    EXPECT_GT(std::abs(score(5, 2) - score(5, 3)), 1e-6);  // and it does depend on p - p'
    EXPECT_NEAR(apply_rope(q, cos, sin, 17, layout).norm().item<double>(), q.norm().item<double>(),
                1e-12);
  }
}

// A batch whose rows sit at different positions: each row equals that row rotated alone.
TEST(Rope, RaggedOffsetsGiveEachRowItsOwnPositions) {
  torch::manual_seed(1);
  const auto [cos, sin] = compute_rope_params(6, 500000.0, 40);
  const auto x = torch::randn({3, 2, 5, 6});
  const auto offsets = torch::tensor({7, 0, 35}, torch::kInt64);
  const auto batched = apply_rope(x, cos, sin, offsets, RopeLayout::kInterleaved);
  for (int64_t r = 0; r < 3; ++r) {
    const auto alone = apply_rope(x.narrow(0, r, 1), cos, sin, offsets[r].item<int64_t>(),
                                  RopeLayout::kInterleaved);
    EXPECT_TRUE(tensors_close("row " + std::to_string(r), batched.narrow(0, r, 1), alone, 0));
  }
  // A scalar tensor offset is the int64_t overload.
  EXPECT_TRUE(tensors_close("scalar tensor",
                            apply_rope(x, cos, sin, torch::scalar_tensor(4, torch::kInt64)),
                            apply_rope(x, cos, sin, 4), 0));
}

TEST(Rope, BadInputNamesTheArgument) {
  expect_error_containing([] { compute_rope_params(7); },
                          "head_dim must be even and >= 2 (RoPE rotates pairs), got 7");
  expect_error_containing([] { compute_rope_params(8, -1.0); }, "theta_base must be > 0, got -1");
  expect_error_containing([] { compute_rope_params(8, 10000.0, 0); },
                          "context_length must be >= 1, got 0");
  expect_error_containing([] { compute_rope_params(8, 10000.0, 16, {}, torch::kInt64); },
                          "dtype must be floating");
  expect_error_containing(
      [] { compute_rope_params(8, 10000.0, 16, RopeFrequencyConfig().high_freq_factor(1)); },
      "freq_config.high_freq_factor must be > low_freq_factor (1), got 1");
  expect_error_containing(
      [] { compute_rope_params(8, 10000.0, 16, RopeFrequencyConfig().factor(0)); },
      "freq_config.factor must be > 0, got 0");

  const auto [cos, sin] = compute_rope_params(8, 10000.0, 16);
  const auto x = torch::randn({2, 3, 5, 8});
  expect_error_containing([&] { apply_rope(x.select(0, 0), cos, sin); },
                          "x must be a floating (b, h, n, head_dim) tensor, got [3, 5, 8]");
  expect_error_containing(
      [&] {
        apply_rope(torch::randn({2, 3, 5, 7}), cos, sin);
      },
      "x's head_dim must be even (RoPE rotates pairs), got 7");
  expect_error_containing(
      [&] {
        apply_rope(torch::randn({2, 3, 5, 6}), cos, sin);
      },
      "cos must be a floating (context_length, 6) table");
  expect_error_containing([&] { apply_rope(x, cos, sin.narrow(0, 0, 8)); },
                          "cos and sin must have one shape, got [16, 8] and [8, 8]");
  expect_error_containing([&] { apply_rope(x, cos, sin, 12); },
                          "positions up to 16 (offset 12 + 5 tokens) pass the tables' "
                          "context_length 16");
  expect_error_containing([&] { apply_rope(x, cos, sin, -1); }, "offset must be >= 0, got -1");
  expect_error_containing(
      [&] {
        apply_rope(x, cos, sin, torch::tensor({0, 12}, torch::kInt64));
      },
      "positions up to 16 (offset 12 + 5 tokens)");
  expect_error_containing(
      [&] {
        apply_rope(x, cos, sin, torch::tensor({0, -2}, torch::kInt64));
      },
      "offset must be >= 0, got -2");
  expect_error_containing(
      [&] {
        apply_rope(x, cos, sin, torch::tensor({0, 1, 2}, torch::kInt64));
      },
      "offsets must be an int64 scalar or (2) tensor, got [3]");
  expect_error_containing(
      [&] {
        apply_rope(x, cos, sin, torch::tensor({0.0, 1.0}));
      },
      "offsets must be an int64 scalar or (2) tensor, got [2] Float");
}

}  // namespace
