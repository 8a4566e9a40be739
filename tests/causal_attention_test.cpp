// attnkit/causal_attention.h: CausalAttention against the book and its invariants.

#include "attnkit/causal_attention.h"

#include "test_support.h"

using attnkit::CausalAttention;
using attnkit::CausalAttentionOptions;
using namespace attnkit::testing;

TEST(CausalAttention, BookOutputAtSeed123) {
  // The book's CausalAttention(3, 2, 6, 0.0) at seed 123 on the batch of two (4 decimals,
  // as printed in ch03 and reproduced by the Python reference on this machine).
  torch::manual_seed(123);
  CausalAttention ca(/*d_in=*/3, /*d_out=*/2, /*context_length=*/6, /*dropout=*/0.0);
  const auto context_vecs = ca(journey_batch());
  EXPECT_EQ(context_vecs.sizes(), (std::vector<int64_t>{2, 6, 2}));
  const auto expected = rows({{-0.4519, 0.2216},
                              {-0.5874, 0.0058},
                              {-0.6300, -0.0632},
                              {-0.5675, -0.0843},
                              {-0.5526, -0.0981},
                              {-0.5299, -0.1081}});
  EXPECT_TENSOR_NEAR(context_vecs[0], expected, kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(context_vecs[1], expected, kPrinted4Decimals);
}

TEST(CausalAttention, DropoutAtSeed123OnThisPlatform) {
  // Python reference on this machine: seed 123, CausalAttention(3, 2, 6, 0.5) in training
  // mode; dropout masks are compared on this platform only.
  torch::manual_seed(123);
  CausalAttention ca(3, 2, 6, 0.5);
  EXPECT_TENSOR_NEAR(ca(journey_batch())[0],
                     rows({{-0.9038, 0.4432},
                           {-0.4368, 0.2142},
                           {-0.4849, -0.1341},
                           {-0.5834, 0.0081},
                           {-0.6219, -0.0526},
                           {-0.1417, -0.0505}}),
                     kPrinted4Decimals);
}

TEST(CausalAttention, MaskBufferAndNames) {
  CausalAttention ca(3, 2, 4, 0.0, /*qkv_bias=*/true);
  EXPECT_EQ(ca->named_buffers().keys(), (std::vector<std::string>{"mask"}));
  EXPECT_TENSOR_NEAR(ca->mask, torch::triu(torch::ones({4, 4}), 1), 0.0);
  EXPECT_EQ(ca->named_parameters().keys(),
            (std::vector<std::string>{"W_query.weight", "W_query.bias", "W_key.weight",
                                      "W_key.bias", "W_value.weight", "W_value.bias"}));
  std::ostringstream printed;
  ca->pretty_print(printed);
  EXPECT_EQ(printed.str(),
            "attnkit::CausalAttention(d_in=3, d_out=2, context_length=4, dropout=0, "
            "qkv_bias=true)");
}

// The book's (context_length, context_length) buffer is checked against the memory budget
// before it is made: context 200,000 asked the constructor for 160 GB.
TEST(CausalAttention, AMaskBufferOverTheMemoryBudgetIsRefusedAtConstruction) {
  expect_error_containing(
      [] { CausalAttention(16, 16, 200000, 0.0); },
      "[CausalAttention]: option context_length 200000: the book's (context_length, "
      "context_length) float32 mask buffer needs 160 GB, over attnkit's memory budget of ");
  expect_error_containing([] { CausalAttention(16, 16, 200000, 0.0); },
                          "; MultiHeadAttention keeps no such buffer, and with "
                          ".backend(AttentionBackend::kChunked) tiles its scores");
  CausalAttention fits(16, 16, 4096, 0.0);  // 67 MB
  EXPECT_EQ(fits->mask.sizes(), (std::vector<int64_t>{4096, 4096}));
}

TEST(CausalAttention, CloneIsEqualAndIndependent) {
  CausalAttention ca(CausalAttentionOptions(4, 3, 8, 0.0));
  auto copy = std::dynamic_pointer_cast<attnkit::CausalAttentionImpl>(ca->clone());
  ASSERT_TRUE(copy);
  const auto x = torch::randn({2, 8, 4});
  EXPECT_TENSOR_NEAR(copy->forward(x), ca(x), 0.0);
  {
    torch::NoGradGuard no_grad;
    copy->W_value->weight.zero_();
  }
  EXPECT_TENSOR_NEAR(copy->forward(x), torch::zeros({2, 8, 3}), 0.0);
  EXPECT_FALSE(tensors_close("original", ca(x), torch::zeros({2, 8, 3}), kFloat32));
}

TEST(CausalAttention, GradientsMatchFiniteDifferences) {
  torch::manual_seed(4);
  CausalAttention ca(3, 4, 6, 0.0, /*qkv_bias=*/true);
  ca->to(torch::kFloat64);
  expect_gradients_match_finite_differences(
      *ca, [&](const torch::Tensor& x) { return ca(x); }, torch::randn({2, 5, 3}));
}

TEST(CausalAttention, BadOptionsAndInputsNameWhatIsWrong) {
  expect_error_containing([] { CausalAttention(3, 2, 0, 0.0); },
                          "[CausalAttention] option context_length must be > 0, got 0");
  expect_error_containing([] { CausalAttention(3, 2, 6, 1.0); },
                          "[CausalAttention] option dropout must be in [0, 1), got 1");
  expect_error_containing([] { CausalAttention(3, 2, 6, -0.5); },
                          "[CausalAttention] option dropout must be in [0, 1), got -0.5");
  CausalAttention ca(3, 2, 6, 0.0);
  expect_error_containing(
      [&] {
        ca(torch::rand({2, 7, 3}));
      },
      "[CausalAttention::forward] x: num_tokens = 7 exceeds context_length = 6 "
      "(shape [2, 7, 3])");
  expect_error_containing(
      [&] {
        ca(torch::rand({6, 3}));
      },
      "[CausalAttention::forward] x: expected a 3-D tensor (b, num_tokens, "
      "d_in), got 2-D with shape [6, 3]");
  expect_error_containing(
      [&] {
        ca(torch::rand({2, 6, 5}));
      },
      "expected last dimension d_in = 3, got 5");
  expect_error_containing([&] { ca(torch::Tensor()); }, "x: expected a tensor, got an undefined");
}

class CausalAttentionDevices : public DeviceTest {};

TEST_P(CausalAttentionDevices, FutureTokensNeverChangeEarlierOutputs) {
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    torch::manual_seed(5);
    CausalAttention ca(4, 3, 10, 0.0);
    ca->to(device(), dtype);
    const auto x = torch::randn({2, 10, 4}, torch::dtype(dtype).device(device()));
    const auto before = ca(x);
    for (int64_t t = 0; t < 10; ++t) {
      auto changed = x.clone();
      changed.slice(1, t).normal_();  // tokens t.. replaced
      const auto after = ca(changed);
      EXPECT_TENSOR_NEAR(after.slice(1, 0, t), before.slice(1, 0, t), 0.0);
    }
    const auto weights = ca->forward_with_weights(x).weights;
    EXPECT_TENSOR_NEAR(weights.sum(-1), torch::ones({2, 10}), kFloat32);
    const auto upper = torch::triu(torch::ones({10, 10}, torch::kBool), 1).to(device());
    EXPECT_TRUE(weights.masked_select(upper).eq(0).all().item<bool>());
  }
}

TEST_P(CausalAttentionDevices, TrainUsesDropoutAndEvalDoesNot) {
  torch::manual_seed(6);
  CausalAttention ca(4, 3, 16, 0.5);
  ca->to(device());
  const auto x = torch::randn({4, 16, 4}, torch::device(device()));
  ca->eval();
  const auto eval_1 = ca(x);
  EXPECT_TENSOR_NEAR(ca(x), eval_1, 0.0);
  ca->train();
  const auto weights = ca->forward_with_weights(x).weights;
  // Dropout zeroes some weights on or below the diagonal and scales the rest by 2.
  const auto lower = torch::tril(torch::ones({16, 16}, torch::kBool)).to(device());
  EXPECT_TRUE(weights.masked_select(lower).eq(0).any().item<bool>());
  EXPECT_FALSE(tensors_close("train vs eval", ca(x), eval_1, kFloat32));
}

TEST_P(CausalAttentionDevices, GradientsReachInputAndEveryParameter) {
  CausalAttention ca(3, 2, 6, 0.1, /*qkv_bias=*/true);
  ca->to(device());
  const auto x = torch::randn({2, 6, 3}, torch::device(device())).requires_grad_(true);
  ca(x).pow(2).sum().backward();
  EXPECT_TRUE(x.grad().defined() && x.grad().abs().sum().item<double>() > 0);
  for (const auto& p : ca->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0) << p.key();
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(CausalAttentionDevices);
