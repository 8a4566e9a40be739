// attnkit/multi_head_attention.h: the wrapper, MultiHeadAttention and the combined-QKV variant.

#include "attnkit/multi_head_attention.h"

#include "attnkit/functional.h"
#include "test_support.h"

namespace F = attnkit::functional;
using attnkit::MultiHeadAttention;
using attnkit::MultiHeadAttentionCombinedQKV;
using attnkit::MultiHeadAttentionOptions;
using attnkit::MultiHeadAttentionWrapper;
using namespace attnkit::testing;

TEST(MultiHeadAttentionWrapper, BookOutputAtSeed123) {
  // The book's MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2) at seed 123; the first
  // head equals the book's CausalAttention at the same seed.
  torch::manual_seed(123);
  MultiHeadAttentionWrapper mha(3, 2, 6, 0.0, /*num_heads=*/2);
  const auto context_vecs = mha(journey_batch());
  EXPECT_EQ(context_vecs.sizes(), (std::vector<int64_t>{2, 6, 4}));
  EXPECT_TENSOR_NEAR(context_vecs[0],
                     rows({{-0.4519, 0.2216, 0.4772, 0.1063},
                           {-0.5874, 0.0058, 0.5891, 0.3257},
                           {-0.6300, -0.0632, 0.6202, 0.3860},
                           {-0.5675, -0.0843, 0.5478, 0.3589},
                           {-0.5526, -0.0981, 0.5321, 0.3428},
                           {-0.5299, -0.1081, 0.5077, 0.3493}}),
                     kPrinted4Decimals);
}

TEST(MultiHeadAttention, BookOutputAtSeed123) {
  torch::manual_seed(123);
  MultiHeadAttention mha(3, 2, 6, 0.0, /*num_heads=*/2);
  const auto context_vecs = mha(journey_batch());
  EXPECT_EQ(context_vecs.sizes(), (std::vector<int64_t>{2, 6, 2}));
  const auto expected = rows({{0.3190, 0.4858},
                              {0.2943, 0.3897},
                              {0.2856, 0.3593},
                              {0.2693, 0.3873},
                              {0.2639, 0.3928},
                              {0.2575, 0.4028}});
  EXPECT_TENSOR_NEAR(context_vecs[0], expected, kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(context_vecs[1], expected, kPrinted4Decimals);
}

TEST(MultiHeadAttention, NamesArePythonStateDictKeys) {
  MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 2);
  EXPECT_EQ(wrapper->named_parameters().keys(),
            (std::vector<std::string>{"heads.0.W_query.weight", "heads.0.W_key.weight",
                                      "heads.0.W_value.weight", "heads.1.W_query.weight",
                                      "heads.1.W_key.weight", "heads.1.W_value.weight"}));
  EXPECT_EQ(wrapper->named_buffers().keys(),
            (std::vector<std::string>{"heads.0.mask", "heads.1.mask"}));
  MultiHeadAttention mha(3, 4, 6, 0.0, 2, /*qkv_bias=*/true);
  EXPECT_EQ(mha->named_parameters().keys(),
            (std::vector<std::string>{"W_query.weight", "W_query.bias", "W_key.weight",
                                      "W_key.bias", "W_value.weight", "W_value.bias",
                                      "out_proj.weight", "out_proj.bias"}));
  EXPECT_TRUE(mha->named_buffers().is_empty());  // the Python `mask` is not kept
  MultiHeadAttentionCombinedQKV combined(3, 4, 6, 0.0, 2);
  EXPECT_EQ(combined->named_parameters().keys(),
            (std::vector<std::string>{"qkv.weight", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(combined->named_parameters()["qkv.weight"].sizes(), (std::vector<int64_t>{12, 3}));
}

TEST(MultiHeadAttention, PrettyPrint) {
  std::ostringstream wrapper, mha, combined;
  MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)->pretty_print(wrapper);
  EXPECT_EQ(wrapper.str(),
            "attnkit::MultiHeadAttentionWrapper(d_in=3, d_out=2, context_length=6, dropout=0, "
            "num_heads=2, qkv_bias=false)");
  MultiHeadAttention(MultiHeadAttentionOptions(8, 8, 16, 0.1, 4).causal(false))->pretty_print(mha);
  EXPECT_EQ(mha.str(),
            "attnkit::MultiHeadAttention(d_in=8, d_out=8, context_length=16, dropout=0.1, "
            "num_heads=4, qkv_bias=false, causal=false, sliding_window_size=none, backend=math, "
            "query_block_size=128, "
            "key_block_size=1024)");
  MultiHeadAttentionCombinedQKV(3, 4, 6, 0.0, 2, true)->pretty_print(combined);
  EXPECT_EQ(combined.str(),
            "attnkit::MultiHeadAttentionCombinedQKV(d_in=3, d_out=4, context_length=6, "
            "dropout=0, num_heads=2, qkv_bias=true, causal=true, sliding_window_size=none, "
            "backend=math, query_block_size=128, "
            "key_block_size=1024)");
}

TEST(MultiHeadAttention, EncoderModeAppliesNoMask) {
  torch::manual_seed(7);
  MultiHeadAttention encoder(MultiHeadAttentionOptions(4, 6, 5, 0.0, 3).causal(false));
  const auto x = torch::randn({2, 5, 4});
  // Reference: the same projections through the attention core without a mask.
  const auto split = [](const torch::Tensor& t) {
    return t.view({2, 5, 3, 2}).transpose(1, 2);  // (b, n, h * hd) -> (b, h, n, hd)
  };
  const auto context =
      F::attention(split(encoder->W_query(x)), split(encoder->W_key(x)), split(encoder->W_value(x)),
                   F::AttentionOptions().backend(attnkit::AttentionBackend::kMath));
  // (b, h, n, hd) -> (b, n, h * hd)
  const auto expected = encoder->out_proj(context.transpose(1, 2).reshape({2, 5, 6}));
  EXPECT_TENSOR_NEAR(encoder(x), expected, kFloat32);
  // The first token now sees the last one.
  auto changed = x.clone();
  changed.select(1, 4).normal_();
  EXPECT_FALSE(tensors_close("first token", encoder(changed).select(1, 0), encoder(x).select(1, 0),
                             kFloat32));
}

TEST(MultiHeadAttentionCombinedQKV, WeightTransferFromMultiHeadAttention) {
  for (const bool qkv_bias : {false, true}) {
    for (const bool causal : {true, false}) {
      const auto options =
          MultiHeadAttentionOptions(6, 8, 7, 0.0, 4).qkv_bias(qkv_bias).causal(causal);
      MultiHeadAttention mha(options);
      MultiHeadAttentionCombinedQKV combined(options);
      const auto x = torch::randn({3, 7, 6});
      combined->copy_weights_from(*mha);
      EXPECT_TENSOR_NEAR(combined(x), mha(x), kFloat32);
      EXPECT_TENSOR_NEAR(combined->forward_with_weights(x).weights,
                         mha->forward_with_weights(x).weights, kFloat32);
    }
  }
  // The documented layout: head h's query rows come first in its block of 3 * hd rows.
  MultiHeadAttention mha(3, 4, 6, 0.0, 2);
  MultiHeadAttentionCombinedQKV combined(3, 4, 6, 0.0, 2);
  combined->copy_weights_from(*mha);
  EXPECT_TENSOR_NEAR(combined->qkv->weight.slice(0, 6, 8), mha->W_query->weight.slice(0, 2, 4),
                     0.0);
  EXPECT_TENSOR_NEAR(combined->qkv->weight.slice(0, 10, 12), mha->W_value->weight.slice(0, 2, 4),
                     0.0);
  expect_error_containing(
      [&] { combined->copy_weights_from(*MultiHeadAttention(3, 4, 6, 0.0, 4)); },
      "mha: expected d_in = 3, d_out = 4, num_heads = 2, qkv_bias = false; got d_in = 3, d_out = "
      "4, "
      "num_heads = 4");
}

TEST(MultiHeadAttention, CloneIsEqualAndIndependent) {
  MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 3);
  auto copy = std::dynamic_pointer_cast<attnkit::MultiHeadAttentionWrapperImpl>(wrapper->clone());
  ASSERT_TRUE(copy);
  const auto x = journey_batch();
  EXPECT_TENSOR_NEAR(copy->forward(x), wrapper(x), 0.0);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : copy->parameters()) {
      p.zero_();
    }
  }
  EXPECT_TENSOR_NEAR(copy->forward(x), torch::zeros({2, 6, 6}), 0.0);
  EXPECT_FALSE(tensors_close("original", wrapper(x), torch::zeros({2, 6, 6}), kFloat32));
}

TEST(MultiHeadAttention, GradientsMatchFiniteDifferences) {
  torch::manual_seed(8);
  const auto x = torch::randn({2, 4, 3});
  MultiHeadAttentionWrapper wrapper(3, 2, 5, 0.0, 2, /*qkv_bias=*/true);
  wrapper->to(torch::kFloat64);
  expect_gradients_match_finite_differences(
      *wrapper, [&](const torch::Tensor& in) { return wrapper(in); }, x);
  for (const bool causal : {true, false}) {
    const auto options = MultiHeadAttentionOptions(3, 4, 5, 0.0, 2).qkv_bias(true).causal(causal);
    MultiHeadAttention mha(options);
    mha->to(torch::kFloat64);
    expect_gradients_match_finite_differences(
        *mha, [&](const torch::Tensor& in) { return mha(in); }, x);
    MultiHeadAttentionCombinedQKV combined(options);
    combined->to(torch::kFloat64);
    expect_gradients_match_finite_differences(
        *combined, [&](const torch::Tensor& in) { return combined(in); }, x);
  }
}

TEST(MultiHeadAttention, BadOptionsAndInputsNameWhatIsWrong) {
  expect_error_containing([] { MultiHeadAttention(3, 10, 6, 0.0, 3); },
                          "[MultiHeadAttention] option d_out must be divisible by num_heads, got "
                          "d_out = 10, num_heads = 3");
  expect_error_containing([] { MultiHeadAttentionCombinedQKV(3, 4, 6, 0.0, 0); },
                          "[MultiHeadAttentionCombinedQKV] option num_heads must be > 0, got 0");
  expect_error_containing([] { MultiHeadAttentionWrapper(3, 2, 6, 0.0, 0); },
                          "[MultiHeadAttentionWrapper] option num_heads must be > 0, got 0");
  expect_error_containing([] { MultiHeadAttentionWrapper(3, 2, 6, 1.5, 2); },
                          "[CausalAttention] option dropout must be in [0, 1), got 1.5");
  expect_error_containing([] { MultiHeadAttention(3, 4, 6, 1.0, 2); },
                          "[MultiHeadAttention] option dropout must be in [0, 1), got 1");
  MultiHeadAttention mha(3, 4, 6, 0.0, 2);
  expect_error_containing(
      [&] {
        mha(torch::rand({1, 9, 3}));
      },
      "[MultiHeadAttention::forward] query: num_tokens = 9 exceeds context_length "
      "= 6");
  expect_error_containing(
      [&] {
        mha(torch::rand({1, 6, 2}));
      },
      "[MultiHeadAttention::forward] query: expected last dimension d_in = 3, "
      "got 2");
  expect_error_containing(
      [&] {
        mha(torch::rand({1, 6, 3}, torch::kFloat64));
      },
      "expected dtype Float (the module's parameters), got Double");
  MultiHeadAttentionCombinedQKV combined(3, 4, 6, 0.0, 2);
  expect_error_containing(
      [&] {
        combined(torch::rand({6, 3}));
      },
      "[MultiHeadAttentionCombinedQKV::forward] query: expected a 3-D tensor");
  MultiHeadAttentionWrapper wrapper(3, 2, 6, 0.0, 2);
  expect_error_containing(
      [&] {
        wrapper(torch::rand({2, 7, 3}));
      },
      "[CausalAttention::forward] x: num_tokens = 7 exceeds context_length");
}

class MultiHeadAttentionDevices : public DeviceTest {};

TEST_P(MultiHeadAttentionDevices, SameOutputAsCpuAndCausal) {
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    const double tolerance = dtype == torch::kFloat32 ? kFloat32 : kFloat64;
    torch::manual_seed(9);
    const auto x_cpu = torch::randn({2, 8, 6}, dtype);
    const auto x = x_cpu.to(device());
    MultiHeadAttentionWrapper wrapper(6, 4, 8, 0.0, 2);
    MultiHeadAttention mha(6, 8, 8, 0.0, 4);
    MultiHeadAttentionCombinedQKV combined(6, 8, 8, 0.0, 4, /*qkv_bias=*/true);
    const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules{
        {"wrapper", wrapper.ptr()}, {"mha", mha.ptr()}, {"combined", combined.ptr()}};
    const auto run = [&](const std::string& name, const torch::Tensor& in) {
      if (name == "wrapper")
        return wrapper(in);
      if (name == "mha")
        return mha(in);
      return combined(in);
    };
    for (const auto& [name, module] : modules) {
      module->to(dtype);
      const auto expected = run(name, x_cpu);
      module->to(device());
      const auto out = run(name, x);
      EXPECT_EQ(out.device().type(), device().type()) << name;
      EXPECT_TRUE(tensors_close(name, out, expected, tolerance));
      auto changed = x.clone();
      changed.select(1, 7).normal_();  // the last token only
      EXPECT_TRUE(tensors_close(name + " causal", run(name, changed).slice(1, 0, 7),
                                out.slice(1, 0, 7), 0.0));
      module->to(torch::kCPU);
    }
  }
}

TEST_P(MultiHeadAttentionDevices, WeightsSumToOneAndDropoutOnlyInTraining) {
  MultiHeadAttention mha(8, 8, 12, 0.5, 2);
  mha->to(device());
  const auto x = torch::randn({3, 12, 8}, torch::device(device()));
  mha->eval();
  const auto weights = mha->forward_with_weights(x).weights;
  EXPECT_EQ(weights.sizes(), (std::vector<int64_t>{3, 2, 12, 12}));
  EXPECT_TENSOR_NEAR(weights.sum(-1), torch::ones({3, 2, 12}), kFloat32);
  EXPECT_TENSOR_NEAR(mha(x), mha(x), 0.0);
  mha->train();
  EXPECT_FALSE(tensors_close("train", mha(x), mha(x), kFloat32));
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(MultiHeadAttentionDevices);
