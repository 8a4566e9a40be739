// attnkit/self_attention.h: SelfAttentionV1 and SelfAttentionV2 against the notebooks.

#include "attnkit/self_attention.h"

#include "attnkit/functional.h"
#include "test_support.h"

namespace F = attnkit::functional;
using attnkit::SelfAttentionV1;
using attnkit::SelfAttentionV2;
using namespace attnkit::testing;

namespace {

std::vector<std::string> keys_of(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  return dict.keys();
}

}  // namespace

TEST(SelfAttentionV1, Seed123WeightsAndEveryStep) {
  torch::manual_seed(123);
  SelfAttentionV1 sa(/*d_in=*/3, /*d_out=*/2);
  EXPECT_TENSOR_NEAR(sa->W_query, rows({{0.2961, 0.5166}, {0.2517, 0.6886}, {0.0740, 0.8665}}),
                     kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(sa->W_key, rows({{0.1366, 0.1025}, {0.1841, 0.7264}, {0.3153, 0.6871}}),
                     kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(sa->W_value, rows({{0.0756, 0.1966}, {0.3164, 0.4017}, {0.1186, 0.8274}}),
                     kPrinted4Decimals);

  torch::NoGradGuard no_grad;
  const auto inputs = journey_inputs();
  const auto x_2 = inputs[1];
  const auto query_2 = x_2.matmul(sa->W_query);
  EXPECT_TENSOR_NEAR(query_2, vec({0.4306, 1.4551}), kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(x_2.matmul(sa->W_key), vec({0.4433, 1.1419}), kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(x_2.matmul(sa->W_value), vec({0.3951, 1.0037}), kPrinted4Decimals);

  const auto queries = inputs.matmul(sa->W_query);
  const auto keys = inputs.matmul(sa->W_key);
  const auto values = inputs.matmul(sa->W_value);
  EXPECT_NEAR(query_2.dot(keys[1]).item<double>(), 1.8524, kPrinted4Decimals);
  const auto attn_scores_2 = F::attention_scores(query_2, keys);
  EXPECT_TENSOR_NEAR(attn_scores_2, vec({1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440}),
                     kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(F::attention_scores(queries, keys),
                     rows({{0.9231, 1.3545, 1.3241, 0.7910, 0.4032, 1.1330},
                           {1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440},
                           {1.2544, 1.8284, 1.7877, 1.0654, 0.5508, 1.5238},
                           {0.6973, 1.0167, 0.9941, 0.5925, 0.3061, 0.8475},
                           {0.6114, 0.8819, 0.8626, 0.5121, 0.2707, 0.7307},
                           {0.8995, 1.3165, 1.2871, 0.7682, 0.3937, 1.0996}}),
                     kPrinted4Decimals);
  const auto attn_weights_2 = F::softmax_weights(attn_scores_2 / std::sqrt(2.0));
  EXPECT_TENSOR_NEAR(attn_weights_2, vec({0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820}),
                     kPrinted4Decimals);
  const auto context_vec_2 = F::context_vectors(attn_weights_2, values);
  EXPECT_TENSOR_NEAR(context_vec_2, vec({0.3061, 0.8210}), kPrinted4Decimals);

  const auto out = sa(inputs);
  EXPECT_TENSOR_NEAR(out,
                     rows({{0.2996, 0.8053},
                           {0.3061, 0.8210},
                           {0.3058, 0.8203},
                           {0.2948, 0.7939},
                           {0.2927, 0.7891},
                           {0.2990, 0.8040}}),
                     kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(out[1], context_vec_2, kFloat32);
}

TEST(SelfAttentionV2, Seed789Output) {
  torch::manual_seed(789);
  SelfAttentionV2 sa(3, 2);
  EXPECT_TENSOR_NEAR(sa(journey_inputs()),
                     rows({{-0.0739, 0.0713},
                           {-0.0748, 0.0703},
                           {-0.0749, 0.0702},
                           {-0.0760, 0.0685},
                           {-0.0763, 0.0679},
                           {-0.0754, 0.0693}}),
                     kPrinted4Decimals);
}

TEST(SelfAttentionV2, Seed003VariantFromTheSameProjections) {
  // Seed 003 creates its projections in the order key, query, value, computes
  // softmax(K Q^T / sqrt(256)) V, and prints this at seed 123. Our projections are created
  // query, key, value, so our W_query holds its key weights and our W_key its query weights.
  torch::manual_seed(123);
  SelfAttentionV2 sa(3, 2);
  torch::NoGradGuard no_grad;
  const auto inputs = journey_inputs();
  const auto y =
      F::attention(sa->W_query(inputs), sa->W_key(inputs), sa->W_value(inputs),
                   F::AttentionOptions().scale(1.0 / 16).backend(attnkit::AttentionBackend::kMath));
  EXPECT_TENSOR_NEAR(y,
                     rows({{-0.5284, -0.1061},
                           {-0.5283, -0.1063},
                           {-0.5283, -0.1063},
                           {-0.5280, -0.1063},
                           {-0.5281, -0.1062},
                           {-0.5280, -0.1063}}),
                     kPrinted4Decimals);
}

TEST(SelfAttentionV1, CopyWeightsFromV2GivesTheSameOutput) {
  torch::manual_seed(789);
  SelfAttentionV2 v2(3, 2);
  SelfAttentionV1 v1(3, 2);
  const auto inputs = journey_inputs();
  EXPECT_FALSE(tensors_close("before", v1(inputs), v2(inputs), kFloat32));
  v1->copy_weights_from(*v2);
  EXPECT_TENSOR_NEAR(v1(inputs), v2(inputs), kFloat32);

  expect_error_containing([&] { v1->copy_weights_from(*SelfAttentionV2(3, 4)); },
                          "v2: expected d_in = 3, d_out = 2, got d_in = 3, d_out = 4");
  expect_error_containing([&] { v1->copy_weights_from(*SelfAttentionV2(3, 2, /*qkv_bias=*/true)); },
                          "v2: expected qkv_bias = false");
}

TEST(SelfAttention, BatchedInputEqualsEachSequenceAlone) {
  torch::manual_seed(1);
  SelfAttentionV1 v1(3, 4);
  SelfAttentionV2 v2(3, 4, /*qkv_bias=*/true);
  const auto batch = torch::rand({3, 5, 3});
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TENSOR_NEAR(v1(batch)[i], v1(batch[i]), kFloat32);
    EXPECT_TENSOR_NEAR(v2(batch)[i], v2(batch[i]), kFloat32);
  }
}

TEST(SelfAttention, ParameterNamesArePythonStateDictKeys) {
  EXPECT_EQ(keys_of(SelfAttentionV1(3, 2)->named_parameters()),
            (std::vector<std::string>{"W_query", "W_key", "W_value"}));
  EXPECT_EQ(keys_of(SelfAttentionV2(3, 2, true)->named_parameters()),
            (std::vector<std::string>{"W_query.weight", "W_query.bias", "W_key.weight",
                                      "W_key.bias", "W_value.weight", "W_value.bias"}));
  EXPECT_EQ(keys_of(SelfAttentionV2(3, 2)->named_parameters()),
            (std::vector<std::string>{"W_query.weight", "W_key.weight", "W_value.weight"}));
}

TEST(SelfAttention, PrettyPrint) {
  std::ostringstream v1;
  v1 << *SelfAttentionV1(3, 2);
  EXPECT_EQ(v1.str(), "attnkit::SelfAttentionV1(d_in=3, d_out=2)");
  std::ostringstream v2;
  SelfAttentionV2(3, 2)->pretty_print(v2);
  EXPECT_EQ(v2.str(), "attnkit::SelfAttentionV2(d_in=3, d_out=2, qkv_bias=false)");
}

TEST(SelfAttention, CloneIsEqualAndIndependent) {
  SelfAttentionV2 original(3, 2, true);
  auto copy = std::dynamic_pointer_cast<attnkit::SelfAttentionV2Impl>(original->clone());
  ASSERT_TRUE(copy);
  const auto inputs = journey_inputs();
  EXPECT_TENSOR_NEAR(copy->forward(inputs), original(inputs), 0.0);
  {
    torch::NoGradGuard no_grad;
    copy->W_key->weight.add_(1.0);
  }
  EXPECT_FALSE(tensors_close("after edit", copy->forward(inputs), original(inputs), kFloat32));
}

TEST(SelfAttention, GradientsMatchFiniteDifferences) {
  torch::manual_seed(3);
  SelfAttentionV1 v1(3, 4);
  v1->to(torch::kFloat64);
  expect_gradients_match_finite_differences(
      *v1, [&](const torch::Tensor& x) { return v1(x); }, torch::rand({2, 5, 3}));
  SelfAttentionV2 v2(3, 4, /*qkv_bias=*/true);
  v2->to(torch::kFloat64);
  expect_gradients_match_finite_differences(
      *v2, [&](const torch::Tensor& x) { return v2(x); }, torch::rand({5, 3}));
}

TEST(SelfAttention, BadOptionsAndInputsNameWhatIsWrong) {
  expect_error_containing([] { SelfAttentionV1(0, 2); },
                          "[SelfAttentionV1] option d_in must be > 0, got 0");
  expect_error_containing([] { SelfAttentionV2(3, -1); },
                          "[SelfAttentionV2] option d_out must be > 0, got -1");
  SelfAttentionV2 sa(3, 2);
  expect_error_containing(
      [&] {
        sa(torch::rand({6, 4}));
      },
      "[SelfAttentionV2::forward] x: expected last dimension d_in = 3, got 4 "
      "(shape [6, 4])");
  expect_error_containing([&] { sa(torch::rand({3})); },
                          "[SelfAttentionV2::forward] x: expected a 2-D (num_tokens, d_in) or 3-D "
                          "(b, num_tokens, d_in) tensor, got 1-D with shape [3]");
  expect_error_containing(
      [&] {
        sa(torch::rand({6, 3}, torch::kFloat64));
      },
      "[SelfAttentionV2::forward] x: expected dtype Float (the module's "
      "parameters), got Double");
  SelfAttentionV1 v1(3, 2);
  expect_error_containing(
      [&] {
        v1(torch::rand({1, 2, 6, 3}));
      },
      "[SelfAttentionV1::forward] x: expected a 2-D");
}

class SelfAttentionDevices : public DeviceTest {};

TEST_P(SelfAttentionDevices, SameOutputAsCpuInFloat32AndFloat64) {
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    torch::manual_seed(789);
    SelfAttentionV2 cpu(3, 2, /*qkv_bias=*/true);
    cpu->to(dtype);
    auto moved = std::dynamic_pointer_cast<attnkit::SelfAttentionV2Impl>(cpu->clone(device()));
    const auto inputs = journey_batch().to(dtype);
    const auto out = moved->forward(inputs.to(device()));
    EXPECT_EQ(out.device().type(), device().type());  // cuda:0 for cuda
    EXPECT_EQ(out.scalar_type(), dtype);
    EXPECT_TENSOR_NEAR(out, cpu(inputs), dtype == torch::kFloat32 ? kFloat32 : kFloat64);
  }
}

TEST_P(SelfAttentionDevices, InputOnAnotherDeviceIsRefused) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "needs CUDA to have two devices";
  }
  SelfAttentionV1 sa(3, 2);
  sa->to(device());
  const auto other = device().is_cuda() ? torch::kCPU : torch::kCUDA;
  expect_error_containing([&] { sa(journey_inputs().to(other)); },
                          "[SelfAttentionV1::forward] x: expected device");
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(SelfAttentionDevices);
