// Rotary position embeddings: compute_rope_params and apply_rope against
// scripts/rope_reference.py (float64 1e-10, float32 1e-5, outputs and gradients, both layouts,
// with and without Llama 3.1 smoothing, offsets scalar and per row); the property RoPE exists
// for; bad input is named. Then the modules' rope and qk_norm options: forward is QK-norm, RoPE
// and attention composed, on every backend; cached decoding equals forward; the state dict
// holds q_norm.weight and k_norm.weight and no tables; bad options and inputs are named.

#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attnkit/attnkit.h"
#include "module_factory.h"
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

// On each device (CUDA where there is one), against the same float64 reference.
class RopeReferenceDevices : public attnkit::testing::DeviceTest {};

TEST_P(RopeReferenceDevices, EveryLayoutFrequencyAndOffsetMatchesWithGradients) {
  const auto golden = rope_golden();
  int cases = 0;
  for (const auto& [layout_name, layout] : {std::pair{"split_half", RopeLayout::kSplitHalf},
                                            std::pair{"interleaved", RopeLayout::kInterleaved}}) {
    for (const std::string freq : {"none", "llama31"}) {
      for (const std::string offsets : {"scalar", "rows"}) {
        const std::string key = std::string("case/") + layout_name + "/" + freq + "/" + offsets;
        for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
          const auto [cos, sin] = reference_tables(freq, dtype);
          const auto x = golden["inputs/x"].to(device(), dtype).detach().requires_grad_(true);
          const auto out =
              offsets == "scalar"
                  ? apply_rope(x, cos.to(device()), sin.to(device()), /*offset=*/3, layout)
                  : apply_rope(x, cos.to(device()), sin.to(device()),
                               golden["inputs/offsets"].to(device()), layout);
          EXPECT_EQ(out.device(), x.device());
          (out * golden["inputs/w"].to(device(), dtype)).sum().backward();
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

ATTNKIT_INSTANTIATE_DEVICE_TESTS(RopeReferenceDevices);

TEST(RopeReference, PythonReferenceAgreesWithItsFile) {
  const auto [status, output] = attnkit::testing::run_leg_python(kRopeReference, "--check");
  ASSERT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK torch"), std::string::npos) << output;
}

// apps/tiny_gpt's Llama-style model checks itself against this file (tiny_gpt --golden, in
// the package test); here the reference recomputes it with this leg's PyTorch.
TEST(LlamaReference, PythonReferenceAgreesWithItsFile) {
  const auto [status, output] = attnkit::testing::run_leg_python(
      std::string(attnkit::testing::kSourceDir) + "/scripts/llama_reference.py", "--check");
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

// ---- the modules' rope and qk_norm options -----------------------------------------------

using attnkit::AttentionBackend;
using attnkit::RopeOptions;
using attnkit::testing::kBackends;
using attnkit::testing::make_cached_attention;
using attnkit::testing::ModuleConfig;

// RMSNorm by its formula (eps 1e-6): x / sqrt(mean(x^2) + eps) * weight.
torch::Tensor rms_normed(const torch::Tensor& x, const torch::Tensor& weight) {
  return x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-6) * weight;
}

// What a module with qk_norm and rope computes, spelled out with the functional pieces:
// heads (b, n, h * hd) -> (b, h, n, hd), queries and keys normed and rotated at positions
// 0 .. n - 1, causal attention (grouped when g < h), heads merged, out_proj.
torch::Tensor composed(const torch::Tensor& x, torch::nn::Linear& W_query, torch::nn::Linear& W_key,
                       torch::nn::Linear& W_value, torch::nn::Linear& out_proj, int64_t h,
                       int64_t g, const torch::Tensor& q_weight, const torch::Tensor& k_weight,
                       const RopeOptions& rope) {
  const auto split = [](const torch::Tensor& t, int64_t heads) {
    return t.view({t.size(0), t.size(1), heads, -1}).transpose(1, 2);
  };
  const auto [cos, sin] =
      compute_rope_params(W_query->weight.size(0) / h, rope.theta_base(), rope.context_length(),
                          rope.freq_config(), torch::kFloat64);
  const auto q = apply_rope(rms_normed(split(W_query(x), h), q_weight), cos, sin, 0, rope.layout());
  const auto k = apply_rope(rms_normed(split(W_key(x), g), k_weight), cos, sin, 0, rope.layout());
  const auto context = attnkit::functional::attention(q, k, split(W_value(x), g),
                                                      attnkit::functional::AttentionOptions()
                                                          .mask(attnkit::Mask::causal())
                                                          .backend(AttentionBackend::kMath));
  return out_proj(context.transpose(1, 2).reshape({x.size(0), x.size(1), -1}));
}

void randomize_norm_weights(attnkit::RMSNorm& q_norm, attnkit::RMSNorm& k_norm) {
  torch::NoGradGuard no_grad;
  q_norm->weight.uniform_(0.5, 1.5);
  k_norm->weight.uniform_(0.5, 1.5);
}

const std::vector<RopeOptions> kModuleRopes{
    RopeOptions(16), RopeOptions(16)
                         .theta_base(500000.0)
                         .layout(RopeLayout::kInterleaved)
                         .freq_config(RopeFrequencyConfig().factor(4).original_context_length(8))};

TEST(RopeModules, ForwardIsQkNormThenRopeThenAttentionOnEveryBackend) {
  torch::manual_seed(2);
  const auto x = torch::randn({2, 11, 12}, torch::kFloat64);
  for (const auto& rope : kModuleRopes) {
    attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(12, 16, 16, 0.0, 4)
                                        .qkv_bias(true)
                                        .rope(rope)
                                        .qk_norm(true));
    attnkit::GroupedQueryAttention gqa(
        attnkit::GroupedQueryAttentionOptions(12, 16, 0.0, 4, 2).rope(rope).qk_norm(true));
    attnkit::MultiHeadAttentionCombinedQKV combined(mha->options);
    mha->to(torch::kFloat64);
    gqa->to(torch::kFloat64);
    combined->to(torch::kFloat64);
    randomize_norm_weights(mha->q_norm, mha->k_norm);
    randomize_norm_weights(gqa->q_norm, gqa->k_norm);
    combined->copy_weights_from(*mha);
    const auto mha_expected = composed(x, mha->W_query, mha->W_key, mha->W_value, mha->out_proj, 4,
                                       4, mha->q_norm->weight, mha->k_norm->weight, rope);
    const auto gqa_expected = composed(x, gqa->W_query, gqa->W_key, gqa->W_value, gqa->out_proj, 4,
                                       2, gqa->q_norm->weight, gqa->k_norm->weight, rope);
    const auto layout = rope.layout() == RopeLayout::kSplitHalf ? "split-half" : "interleaved";
    for (const auto backend : kBackends) {
      const auto label = c10::str(layout, " ", attnkit::backend_name(backend));
      mha->options.backend(backend);
      gqa->options.backend(backend);
      combined->options.backend(backend);
      EXPECT_TRUE(tensors_close(label + " MultiHeadAttention", mha(x), mha_expected, 1e-10));
      EXPECT_TRUE(tensors_close(label + " GroupedQueryAttention", gqa(x), gqa_expected, 1e-10));
      EXPECT_TRUE(tensors_close(label + " MultiHeadAttentionCombinedQKV", combined(x), mha_expected,
                                1e-10));
    }
    EXPECT_TRUE(tensors_close(c10::str(layout, " forward_with_weights"),
                              mha->forward_with_weights(x).context, mha_expected, 1e-10));
    // A clone rebuilds its tables and computes the same.
    const auto copy = std::dynamic_pointer_cast<attnkit::GroupedQueryAttentionImpl>(gqa->clone());
    EXPECT_TRUE(tensors_close(c10::str(layout, " clone"), copy->forward(x), gqa_expected, 1e-10));
  }
}

// Gemma's RMSNorm keeps its weight as an offset from 1, starting at zeros; Gemma 3's QK-norm
// is that norm with the config's eps.
TEST(RopeModules, GemmaNormsScaleByOnePlusTheirWeights) {
  torch::manual_seed(4);
  attnkit::RMSNorm norm(attnkit::RMSNormOptions(8).eps(1e-3).unit_offset(true));
  norm->to(torch::kFloat64);
  EXPECT_TRUE(norm->weight.eq(0).all().item<bool>());
  const auto x = torch::randn({3, 8}, torch::kFloat64);
  EXPECT_TRUE(
      tensors_close("zeros", norm(x), x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-3), 1e-12));
  {
    torch::NoGradGuard no_grad;
    norm->weight.uniform_(-0.5, 0.5);
  }
  EXPECT_TRUE(tensors_close("offset", norm(x),
                            x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-3) * (norm->weight + 1),
                            1e-12));
  norm->reset_parameters();
  EXPECT_TRUE(norm->weight.eq(0).all().item<bool>());
  std::ostringstream printed;
  norm->pretty_print(printed);
  EXPECT_EQ(printed.str(), "attnkit::RMSNorm(dim=8, eps=0.001, unit_offset=true)");

  attnkit::GroupedQueryAttention gqa(attnkit::GroupedQueryAttentionOptions(12, 16, 0.0, 4, 2)
                                         .qk_norm(true)
                                         .qk_norm_eps(1e-3)
                                         .qk_norm_unit_offset(true));
  for (const auto* each : {&gqa->q_norm, &gqa->k_norm}) {
    EXPECT_EQ((*each)->options.dim(), 4);
    EXPECT_EQ((*each)->options.eps(), 1e-3);
    EXPECT_TRUE((*each)->options.unit_offset());
    EXPECT_TRUE((*each)->weight.eq(0).all().item<bool>());
  }
  std::ostringstream gqa_printed;
  gqa->pretty_print(gqa_printed);
  EXPECT_NE(gqa_printed.str().find("qk_norm=true, qk_norm_eps=0.001, qk_norm_unit_offset=true"),
            std::string::npos)
      << gqa_printed.str();
  expect_error_containing(
      [] {
        attnkit::GroupedQueryAttention(
            attnkit::GroupedQueryAttentionOptions(12, 16, 0.0, 4, 2).qk_norm(true).qk_norm_eps(0));
      },
      "[GroupedQueryAttention] option qk_norm_eps must be > 0, got 0");
}

// Without a gradient to record, RMSNorm runs its one-pass CPU loop: the formula's values, for
// both dtypes, both weight forms, and inputs that are not contiguous.
TEST(RopeModules, RMSNormWithoutAutogradIsTheFormula) {
  torch::manual_seed(5);
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const bool unit_offset : {false, true}) {
      attnkit::RMSNorm norm(attnkit::RMSNormOptions(12).eps(1e-4).unit_offset(unit_offset));
      norm->to(dtype);
      {
        torch::NoGradGuard no_grad;
        norm->weight.uniform_(-1.0, 2.0);
      }
      const auto x = torch::randn({5, 12, 3}, torch::dtype(dtype)).transpose(1, 2);  // strided
      const auto with_autograd = norm(x);  // the weight wants a gradient: the formula's ops
      ASSERT_TRUE(with_autograd.requires_grad());
      torch::Tensor without;
      {
        torch::NoGradGuard no_grad;
        without = norm(x);
      }
      EXPECT_TRUE(tensors_close(c10::str(dtype, " unit_offset ", unit_offset), without,
                                with_autograd.detach(), dtype == torch::kFloat32 ? 1e-6 : 1e-14));
    }
  }
}

TEST(RopeModules, QkNormWeightsTrainAndRopeMakesAttentionShiftInvariant) {
  torch::manual_seed(3);
  attnkit::GroupedQueryAttention gqa(
      attnkit::GroupedQueryAttentionOptions(8, 16, 0.0, 4, 1).rope(RopeOptions(64)).qk_norm(true));
  gqa->to(torch::kFloat64);
  const auto x = torch::randn({1, 6, 8}, torch::kFloat64);
  gqa(x).pow(2).sum().backward();
  for (const auto* name : {"q_norm.weight", "k_norm.weight"}) {
    const auto grad = gqa->named_parameters()[name].grad();
    ASSERT_TRUE(grad.defined()) << name;
    EXPECT_GT(grad.abs().sum().item<double>(), 0.0) << name;
  }
  // With RoPE and no position embedding, what a token sees depends on distances only: the same
  // tokens after 9 others (whose keys a causal query sees, so compare through the cache with
  // those 9 keys dropped) give the same outputs. Here: tokens at positions 9.. of a cache whose
  // first 9 entries are masked out equal the tokens at positions 0..
  gqa->eval();
  auto shifted = gqa->make_kv_cache(1, 32);
  torch::NoGradGuard no_grad;
  gqa->forward_with_cache(torch::randn({1, 9, 8}, torch::kFloat64), shifted);
  const auto lengths_hidden = attnkit::Mask::from_function(
      [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
         const torch::Tensor& kv_idx) { return kv_idx >= 9; });
  EXPECT_TRUE(tensors_close("shifted by 9", gqa->forward_with_cache(x, shifted, lengths_hidden),
                            gqa(x), 1e-10));
}

class RopeModulesDevices : public attnkit::testing::DeviceTest {};

TEST_P(RopeModulesDevices, CachedDecodingEqualsForwardForEveryModuleAndBackend) {
  torch::manual_seed(4);
  ModuleConfig config;
  config.d_in = 8;
  config.d_out = 16;
  config.context_length = 24;
  config.num_heads = 4;
  config.num_kv_groups = 2;
  config.rope = RopeOptions(20);
  config.qk_norm = true;
  const auto x = torch::randn({2, 13, 8}, torch::kFloat64).to(device());
  for (const auto& [name, window] :
       {std::pair{"MultiHeadAttention", 0}, std::pair{"MultiHeadAttentionCombinedQKV", 0},
        std::pair{"GroupedQueryAttention", 0}, std::pair{"GroupedQueryAttention", 5},
        std::pair{"MultiHeadAttention", 4}}) {
    config.sliding_window_size = window;
    auto attention = make_cached_attention(name, config);
    attention->as_module()->to(device(), torch::kFloat64);
    attention->as_module()->eval();
    {
      torch::NoGradGuard no_grad;
      for (auto& parameter : attention->as_module()->named_parameters()) {
        if (parameter.key().find("_norm.") != std::string::npos)
          parameter.value().uniform_(0.5, 1.5);
      }
    }
    for (const auto backend : kBackends) {
      attention->set_backend(backend);
      const auto label = c10::str(name, " window ", window, " ", attnkit::backend_name(backend));
      const auto expected = attention->forward(x);
      auto cache = attention->make_kv_cache(2, 20);
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> pieces{attention->forward_with_cache(x.narrow(1, 0, 5), cache),
                                        attention->forward_with_cache(x.narrow(1, 5, 3), cache)};
      for (int64_t t = 8; t < 13; ++t)
        pieces.push_back(attention->forward_with_cache(x.narrow(1, t, 1), cache));
      EXPECT_EQ(expected.device(), x.device()) << label;
      EXPECT_TRUE(tensors_close(label, torch::cat(pieces, 1), expected, 1e-10));
    }
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(RopeModulesDevices);

TEST(RopeModules, StateDictHoldsTheNormWeightsAndNoTables) {
  const auto options = attnkit::MultiHeadAttentionOptions(8, 16, 16, 0.0, 2).rope(RopeOptions(16));
  attnkit::MultiHeadAttention plain(attnkit::MultiHeadAttentionOptions(8, 16, 16, 0.0, 2));
  attnkit::MultiHeadAttention with_rope(options);
  attnkit::MultiHeadAttention with_norm(attnkit::MultiHeadAttentionOptions(options).qk_norm(true));
  EXPECT_EQ(attnkit::state_dict(*with_rope).keys(), attnkit::state_dict(*plain).keys());
  // The parameters, then the Python class's `mask` buffer (made at save time): the norm
  // weights come before it.
  auto keys = attnkit::state_dict(*plain).keys();
  ASSERT_EQ(keys.back(), "mask");
  keys.insert(keys.end() - 1, {"q_norm.weight", "k_norm.weight"});
  const auto normed = attnkit::state_dict(*with_norm);
  EXPECT_EQ(normed.keys(), keys);
  EXPECT_EQ(normed["q_norm.weight"].sizes(), torch::IntArrayRef({8}));
  EXPECT_TRUE(torch::equal(normed["k_norm.weight"], torch::ones({8})));
}

TEST(RopeModules, BadOptionsAndInputsNameTheArgument) {
  using attnkit::GroupedQueryAttentionOptions;
  using attnkit::MultiHeadAttentionOptions;
  expect_error_containing(
      [] { attnkit::MultiHeadAttention(MultiHeadAttentionOptions(6, 6, 8, 0.0, 2).rope(8)); },
      "[MultiHeadAttention] option rope needs an even head width (RoPE rotates pairs), got "
      "d_out / num_heads = 3");
  expect_error_containing(
      [] { attnkit::GroupedQueryAttention(GroupedQueryAttentionOptions(8, 8, 0.0, 2, 1).rope(0)); },
      "[GroupedQueryAttention] option rope: context_length must be >= 1, got 0");
  expect_error_containing(
      [] {
        attnkit::GroupedQueryAttention(
            GroupedQueryAttentionOptions(8, 8, 0.0, 2, 1).rope(RopeOptions(8).theta_base(0)));
      },
      "option rope: theta_base must be > 0, got 0");

  attnkit::GroupedQueryAttention gqa(
      GroupedQueryAttentionOptions(8, 8, 0.0, 2, 1).rope(RopeOptions(6)).qk_norm(true));
  std::ostringstream printed;
  printed << *gqa;
  EXPECT_NE(printed.str().find(
                ", rope=(context_length=6, theta_base=10000, layout=split_half), qk_norm=true)"),
            std::string::npos)
      << printed.str();
  const auto x = torch::randn({1, 4, 8});
  expect_error_containing([&] { gqa(x, x); },
                          "[GroupedQueryAttention::forward] key: RoPE rotates queries and keys by "
                          "their positions in one sequence, so a module with the rope option does "
                          "self-attention only; got key [1, 4, 8]");
  expect_error_containing(
      [&] {
        gqa(torch::randn({1, 7, 8}));
      },
      "[GroupedQueryAttention::forward] query: 7 tokens from position 0 would "
      "reach position 7, past rope.context_length = 6");
  gqa->eval();
  auto cache = gqa->make_kv_cache(1, 32);
  torch::NoGradGuard no_grad;
  gqa->forward_with_cache(x, cache);
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(torch::randn({1, 3, 8}), cache);
      },
      "[GroupedQueryAttention::forward_with_cache] x: 3 tokens from position "
      "4 would reach position 7, past rope.context_length = 6");
  EXPECT_EQ(cache.size(), 4);  // nothing was written
  // Ragged: each row's valid tokens count, not the padding (row 0's 2 fit at 4 and 5).
  auto two_rows = gqa->make_kv_cache(2, 32);
  const auto pair = torch::randn({2, 4, 8});
  gqa->forward_with_cache(pair, two_rows, torch::tensor({4, 1}, torch::kInt64));
  gqa->forward_with_cache(pair.narrow(1, 0, 3), two_rows, torch::tensor({2, 3}, torch::kInt64));
  EXPECT_TRUE(two_rows.lengths().equal(torch::tensor({6, 4}, torch::kInt64)));
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(pair, two_rows, torch::tensor({0, 3}, torch::kInt64));
      },
      "[GroupedQueryAttention::forward_with_cache] row 1: 3 tokens from position 4 would reach "
      "position 7, past rope.context_length = 6");
  attnkit::MultiHeadAttention mha(MultiHeadAttentionOptions(8, 8, 8, 0.0, 2).rope(8));
  expect_error_containing([&] { mha->forward_with_weights(x, x); },
                          "[MultiHeadAttention::forward] key: RoPE rotates");
}

}  // namespace
