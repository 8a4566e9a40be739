// attnkit/functional.h: the notebooks' step-by-step numbers and the attention core.

#include "attnkit/functional.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/multi_head_attention.h"

#include <limits>
#include <type_traits>

#include "test_support.h"

// These tests also hold the deprecated adapters (SdpaOptions, ChunkedOptions, FusedOptions)
// to the core they forward to.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace F = attnkit::functional;
using namespace attnkit::testing;

namespace {

// Seed 001 (numpy legacy seed 42): Q and K as printed; V regenerated with Debian's
// python3-numpy (`np.random.seed(42)`, three `randn(4, 8)` draws), its first row as printed.
torch::Tensor seed001_q() {
  return rows({{0.49671415, -0.1382643, 0.64768854, 1.52302986, -0.23415337, -0.23413696,
                1.57921282, 0.76743473},
               {-0.46947439, 0.54256004, -0.46341769, -0.46572975, 0.24196227, -1.91328024,
                -1.72491783, -0.56228753},
               {-1.01283112, 0.31424733, -0.90802408, -1.4123037, 1.46564877, -0.2257763, 0.0675282,
                -1.42474819},
               {-0.54438272, 0.11092259, -1.15099358, 0.37569802, -0.60063869, -0.29169375,
                -0.60170661, 1.85227818}},
              torch::kFloat64);
}

torch::Tensor seed001_k() {
  return rows({{-0.01349722, -1.05771093, 0.82254491, -1.22084365, 0.2088636, -1.95967012,
                -1.32818605, 0.19686124},
               {0.73846658, 0.17136828, -0.11564828, -0.3011037, -1.47852199, -0.71984421,
                -0.46063877, 1.05712223},
               {0.34361829, -1.76304016, 0.32408397, -0.38508228, -0.676922, 0.61167629, 1.03099952,
                0.93128012},
               {-0.83921752, -0.30921238, 0.33126343, 0.97554513, -0.47917424, -0.18565898,
                -1.10633497, -1.19620662}},
              torch::kFloat64);
}

torch::Tensor seed001_v() {
  return torch::tensor({0.812525822394198,    1.356240028570823,    -0.07201012158033385,
                        1.0035328978920242,   0.36163602504763415,  -0.6451197546051243,
                        0.36139560550841393,  1.5380365664659692,   -0.03582603910995154,
                        1.5646436558140062,   -2.6197451040897444,  0.8219025043752238,
                        0.08704706823817122,  -0.29900735046586746, 0.0917607765355023,
                        -1.9875689146008928,  -0.21967188783751193, 0.3571125715117464,
                        1.477894044741516,    -0.5182702182736474,  -0.8084936028931876,
                        -0.5017570435845365,  0.9154021177020741,   0.32875110965968446,
                        -0.5297602037670388,  0.5132674331133561,   0.09707754934804039,
                        0.9686449905328892,   -0.7020530938773524,  -0.3276621465977682,
                        -0.39210815313215763, -1.4635149481321186},
                       torch::kFloat64)
      .view({4, 8});
}

// Q and K are printed to 8 decimals; computing from the rounded values instead of the exact
// draws moves scores, weights and contexts by at most 2e-8 (measured with numpy), on top of
// the printed outputs' own rounding.
constexpr double kSeed001 = kPrinted8Decimals + 4e-8;

}  // namespace

TEST(SimpleSelfAttention, HelloShinySunContextVector) {
  // Seed 004: "Hello shiny sun!", context vector of "shiny".
  const auto x = rows({{0.34, 0.22, 0.54}, {0.53, 0.34, 0.98}, {0.29, 0.54, 0.93}});
  EXPECT_TENSOR_NEAR(F::attention_scores(x[1], x), vec({0.7842, 1.3569, 1.2487}), 1e-6);
  // The page rounds its weights to 4 decimals before the weighted sum (they add up to
  // 1.0004), so its printed vector is within 4e-4 of the exact one, not 5e-5.
  constexpr double kPageRounding = 4e-4;
  EXPECT_TENSOR_NEAR(F::simple_self_attention(x)[1], vec({0.3992, 0.3858, 0.8610}), kPageRounding);
}

TEST(SimpleSelfAttention, JourneyStepByStep) {
  const auto inputs = journey_inputs();
  const auto attn_scores_2 = F::attention_scores(inputs[1], inputs);
  EXPECT_TENSOR_NEAR(F::normalize_by_sum(attn_scores_2),
                     vec({0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656}), kPrinted4Decimals);
  const auto attn_weights_2 = F::softmax_weights(attn_scores_2);
  EXPECT_TENSOR_NEAR(attn_weights_2, vec({0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581}),
                     kPrinted4Decimals);
  const auto context_vec_2 = F::context_vectors(attn_weights_2, inputs);
  EXPECT_TENSOR_NEAR(context_vec_2, vec({0.4419, 0.6515, 0.5683}), kPrinted4Decimals);
  // The matrix form gives the same row, and a batch gives the same per element.
  EXPECT_TENSOR_NEAR(F::simple_self_attention(inputs)[1], context_vec_2, kFloat32);
  EXPECT_TENSOR_NEAR(F::simple_self_attention(journey_batch())[1][1], context_vec_2, kFloat32);
}

TEST(Softmax, SharpensWhenScoresGrow) {
  const auto scores = vec({0.1, -0.2, 0.3, -0.2, 0.5});
  EXPECT_TENSOR_NEAR(F::softmax_weights(scores), vec({0.1925, 0.1426, 0.2351, 0.1426, 0.2872}),
                     kPrinted4Decimals);
  EXPECT_TENSOR_NEAR(F::softmax_weights(scores * 8), vec({0.0326, 0.0030, 0.1615, 0.0030, 0.8000}),
                     kPrinted4Decimals);
}

TEST(Scaling, DividingBySqrtDimKeepsVarianceNearOne) {
  // The notebooks' experiment: variance of q.k for random N(0, 1) vectors is about dim,
  // and about 1 after dividing by sqrt(dim).
  torch::manual_seed(0);
  constexpr int64_t kTrials = 10000;
  for (const int64_t dim : {5, 100}) {
    const auto q = torch::randn({kTrials, 1, dim});
    const auto k = torch::randn({kTrials, 1, dim});
    const auto dots = F::attention_scores(q, k).flatten();  // (trials, 1, 1) -> (trials)
    const double before = dots.var(/*unbiased=*/false).item<double>();
    const double after = (dots / std::sqrt(static_cast<double>(dim))).var(false).item<double>();
    // Standard error of a variance estimate from 10,000 such products is under 2%; allow 8%.
    EXPECT_NEAR(before / dim, 1.0, 0.08) << "dim " << dim;
    EXPECT_NEAR(after, 1.0, 0.08) << "dim " << dim;
  }
}

TEST(Seed001, ScoresVarianceAttentionAndContext) {
  const auto q = seed001_q();
  const auto k = seed001_k();
  const auto v = seed001_v();
  const auto scores = F::attention_scores(q, k);
  EXPECT_TENSOR_NEAR(scores,
                     rows({{-2.72357421, 0.40818741, 2.39601116, -1.18323729},
                           {5.60012069, 1.1597874, -4.7248515, 2.43859568},
                           {1.03699903, -3.70553788, -3.0399309, 0.04345596},
                           {0.09460324, 2.97027193, 0.43247995, -0.80026704}},
                          torch::kFloat64),
                     kSeed001);
  const auto scaled = scores / std::sqrt(8.0);
  EXPECT_NEAR(scores.var(/*unbiased=*/false).item<double>(), 6.8375652409831655, kSeed001);
  EXPECT_NEAR(scaled.var(/*unbiased=*/false).item<double>(), 0.8546956551228956, kSeed001);

  const auto attention = F::softmax_weights(scaled);
  EXPECT_TENSOR_NEAR(attention,
                     rows({{0.08431243, 0.25513027, 0.51521078, 0.14534652},
                           {0.64059204, 0.1332861, 0.01664257, 0.2094793},
                           {0.47006414, 0.08789379, 0.11121405, 0.33082801},
                           {0.17794451, 0.49185018, 0.20052305, 0.12968226}},
                          torch::kFloat64),
                     kSeed001);
  // Same result from the attention core (its default scale is 1/sqrt(d_k)).
  EXPECT_TENSOR_NEAR(F::scaled_dot_product_attention(q, k, v), F::context_vectors(attention, v),
                     kFloat64);
  EXPECT_TENSOR_NEAR(F::context_vectors(attention, v),
                     rows({{-0.1308104, 0.77212573, 0.10108921, 0.16807328, -0.46588684,
                            -0.43681263, 0.46851458, -0.42075407},
                           {0.40109276, 1.19080398, -0.35037302, 0.94668908, 0.08274232,
                            -0.53010106, 0.17683369, 0.41923385},
                           {0.17910025, 0.98456145, -0.06763014, 0.80678092, -0.14453166,
                            -0.49373081, 0.15002954, 0.10067088},
                           {0.01421368, 1.14907671, -0.99239485, 0.60451701, -0.14600018,
                            -0.40496816, 0.24215067, -0.82777073}},
                          torch::kFloat64),
                     kSeed001);
  // Decoder: -inf above the diagonal before the softmax.
  const auto masked_new_v =
      F::scaled_dot_product_attention(q, k, v, F::SdpaOptions().is_causal(true));
  EXPECT_TENSOR_NEAR(masked_new_v,
                     rows({{0.81252582, 1.35624003, -0.07201012, 1.0035329, 0.36163603, -0.64511975,
                            0.36139561, 1.53803657},
                           {0.66641301, 1.39213367, -0.51081002, 0.97225045, 0.31434319,
                            -0.58550834, 0.31495603, 0.93081668},
                           {0.52954961, 1.21756173, -0.14905901, 0.7267579, 0.1310981, -0.57583252,
                            0.41805381, 0.87397953},
                           {0.01421368, 1.14907671, -0.99239485, 0.60451701, -0.14600018,
                            -0.40496816, 0.24215067, -0.82777073}},
                          torch::kFloat64),
                     kSeed001);
  EXPECT_TENSOR_NEAR(F::causal_weights_by_masking(scores, 8).matmul(v), masked_new_v, kFloat64);
}

TEST(CausalMask, BothRecipesGiveTheSameWeights) {
  torch::manual_seed(123);
  const auto inputs = journey_inputs();
  const auto queries = inputs.matmul(torch::rand({3, 2}));
  const auto keys = inputs.matmul(torch::rand({3, 2}));
  const auto scores = F::attention_scores(queries, keys);
  const auto renormalized =
      F::causal_weights_by_renormalizing(torch::softmax(scores / std::sqrt(2.0), -1));
  const auto masked = F::causal_weights_by_masking(scores, 2);
  EXPECT_TENSOR_NEAR(renormalized, masked, kFloat32);
  // Masked entries are exactly zero and every row sums to one.
  EXPECT_TRUE(masked.masked_select(F::causal_mask(6, 6)).eq(0).all().item<bool>());
  EXPECT_TENSOR_NEAR(masked.sum(-1), torch::ones({6}), kFloat32);
}

TEST(CausalMask, IsTriuOfOnesAboveTheDiagonal) {
  const auto expected = torch::triu(torch::ones({4, 6}), 1).to(torch::kBool);
  EXPECT_TRUE(torch::equal(F::causal_mask(4, 6), expected));
  expect_error_containing([] { F::causal_mask(-1, 3); }, "num_queries = -1");
}

TEST(Dropout, Seed123PatternOnOnes) {
  // Python on this platform: torch.manual_seed(123); nn.Dropout(0.5)(torch.ones(6, 6)).
  torch::manual_seed(123);
  const auto dropped = F::dropout_weights(torch::ones({6, 6}), 0.5, /*training=*/true);
  EXPECT_TENSOR_NEAR(dropped,
                     rows({{2, 2, 0, 2, 2, 0},
                           {0, 0, 0, 2, 0, 2},
                           {2, 2, 2, 2, 0, 2},
                           {0, 2, 2, 0, 0, 2},
                           {0, 2, 0, 2, 0, 2},
                           {0, 2, 2, 2, 2, 0}}),
                     0.0);
}

TEST(Dropout, EvalIsIdentityAndKeptValuesScale) {
  const auto weights = torch::rand({4, 5, 5});
  EXPECT_TRUE(torch::equal(F::dropout_weights(weights, 0.3, /*training=*/false), weights));
  const auto dropped = F::dropout_weights(weights, 0.3, /*training=*/true);
  const auto kept = dropped.ne(0);
  EXPECT_TENSOR_NEAR(dropped.masked_select(kept), weights.masked_select(kept) / 0.7, kFloat32);
  expect_error_containing([&] { F::dropout_weights(weights, 1.0, true); },
                          "p must be in [0, 1), got 1");
}

TEST(ScaledDotProductAttention, GivenCausalMaskEqualsIsCausal) {
  const auto q = torch::randn({2, 3, 5, 4});
  const auto k = torch::randn({2, 3, 5, 4});
  const auto v = torch::randn({2, 3, 5, 7});
  const auto by_flag = F::scaled_dot_product_attention(q, k, v, F::SdpaOptions().is_causal(true));
  const auto by_mask =
      F::scaled_dot_product_attention(q, k, v, F::SdpaOptions().attn_mask(F::causal_mask(5, 5)));
  EXPECT_TENSOR_NEAR(by_flag, by_mask, 0.0);
  EXPECT_EQ(by_flag.sizes(), (std::vector<int64_t>{2, 3, 5, 7}));
}

TEST(ScaledDotProductAttention, FullyMaskedRowAttendsToNothing) {
  const auto q = torch::randn({3, 4});
  const auto kv = torch::randn({5, 4});
  auto mask = torch::zeros({3, 5}, torch::kBool);
  mask[1].fill_(true);
  const auto out =
      F::scaled_dot_product_attention_with_weights(q, kv, kv, F::SdpaOptions().attn_mask(mask));
  EXPECT_FALSE(out.weights.isnan().any().item<bool>());
  EXPECT_TENSOR_NEAR(out.weights[1], torch::zeros({5}), 0.0);
  EXPECT_TENSOR_NEAR(out.context[1], torch::zeros({4}), 0.0);
  EXPECT_TENSOR_NEAR(out.weights.sum(-1), vec({1, 0, 1}), kFloat32);
}

TEST(ScaledDotProductAttention, MaskWithMoreLeadingDimsBroadcastsTheScores) {
  // (n, hd) inputs with a (2, n, m) mask: one output per mask, as softmax over the mask's shape.
  const auto q = torch::randn({3, 4});
  const auto kv = torch::randn({5, 4});
  auto mask = torch::zeros({2, 3, 5}, torch::kBool);
  mask[1].slice(1, 2, 5).fill_(true);
  const auto out = F::scaled_dot_product_attention(q, kv, kv, F::SdpaOptions().attn_mask(mask));
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_TENSOR_NEAR(out[0], F::scaled_dot_product_attention(q, kv, kv), 1e-6);
  EXPECT_TENSOR_NEAR(
      out[1], F::scaled_dot_product_attention(q, kv.slice(0, 0, 2), kv.slice(0, 0, 2)), 1e-6);
}

TEST(ScaledDotProductAttention, ExplicitScale) {
  // Seed 003's variant divides by sqrt(HIDDEN_DIM = 256) = 16 and uses randn weights.
  torch::manual_seed(123);
  const auto inputs = journey_inputs();
  const auto wk = torch::randn({3, 2});
  const auto wq = torch::randn({3, 2});
  const auto wv = torch::randn({3, 2});
  // Seed 003 computes softmax(K Q^T / 16) V: keys play the query role.
  const auto y = F::scaled_dot_product_attention(
      inputs.matmul(wk), inputs.matmul(wq), inputs.matmul(wv), F::SdpaOptions().scale(1.0 / 16));
  EXPECT_TENSOR_NEAR(y,
                     rows({{0.2867, 0.3880},
                           {0.2868, 0.3881},
                           {0.2868, 0.3881},
                           {0.2868, 0.3874},
                           {0.2868, 0.3869},
                           {0.2868, 0.3878}}),
                     kPrinted4Decimals);
}

TEST(ScaledDotProductAttention, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({2, 5, 4});
  const auto v = torch::randn({2, 5, 4});
  expect_error_containing(
      [&] {
        F::scaled_dot_product_attention(q, torch::randn({2, 5, 3}), v);
      },
      "query and key must have the same last dimension (head_dim), got query [2, 5, 4] and key "
      "[2, 5, 3]");
  expect_error_containing(
      [&] {
        F::scaled_dot_product_attention(q, q, torch::randn({2, 6, 4}));
      },
      "key and value must have the same number of tokens (dim -2), got key [2, 5, 4] and value "
      "[2, 6, 4]");
  expect_error_containing([&] { F::scaled_dot_product_attention(torch::randn({4}), q, v); },
                          "must be at least 2-D");
  expect_error_containing(
      [&] { F::scaled_dot_product_attention(q, q, v, F::SdpaOptions().dropout_p(-0.1)); },
      "dropout_p must be in [0, 1), got -0.1");
  expect_error_containing(
      [&] {
        F::scaled_dot_product_attention(q, q, v, F::SdpaOptions().attn_mask(torch::ones({5, 5})));
      },
      "attn_mask must be a bool tensor");
  expect_error_containing(
      [&] {
        F::scaled_dot_product_attention(q, q, v, F::SdpaOptions().attn_mask(F::causal_mask(4, 5)));
      },
      "attn_mask must end in (num_queries, num_keys) = (5, 5), got shape [4, 5]");
  expect_error_containing([&] { F::scaled_dot_product_attention(q, q.to(torch::kFloat64), v); },
                          "must share a dtype");
  expect_error_containing(
      [&] {
        F::attention_scores(q, torch::randn({5, 3}));
      },
      "queries and keys must have the same last dimension");
  expect_error_containing(
      [&] {
        F::context_vectors(torch::rand({5, 5}), torch::rand({4, 3}));
      },
      "attn_weights has 5 keys per row but values has 4 rows");
  expect_error_containing(
      [&] { F::simple_self_attention(torch::rand({3})); },
      "[simple_self_attention] x: expected (num_tokens, d) or (b, num_tokens, d)");
  expect_error_containing(
      [&] {
        F::causal_weights_by_masking(torch::rand({3, 3}), 0);
      },
      "d_k must be > 0, got 0");
}

// ---- the deprecated adapters' own behaviour --------------------------------------------------
// (the kernels behind them are held to the math core in backends_test.cpp and
// planner_test.cpp, through attention())

// The adapters take (..., n, hd) inputs of any rank, where attention() takes ranks 2 to 4:
// a 5-D problem answers as the core on its leading dimensions folded into one.
TEST(DeprecatedAdapters, TakeInputsOfAnyRank) {
  torch::manual_seed(13);
  const auto q = torch::randn({2, 1, 3, 7, 3}, torch::kFloat64);
  const auto k = q.flip(-2), v = q * 2;
  // (2, 1, 3, n, hd) -> (6, n, hd)
  const auto fold = [](const torch::Tensor& t) { return t.reshape({-1, 7, 3}); };
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(c10::str("causal ", causal));
    const auto reference =
        F::attention(fold(q), fold(k), fold(v),
                     F::AttentionOptions()
                         .mask(causal ? attnkit::Mask::causal() : attnkit::Mask())
                         .backend(attnkit::AttentionBackend::kMath))
            .view(q.sizes());
    EXPECT_TENSOR_NEAR(F::scaled_dot_product_attention(q, k, v, F::SdpaOptions().is_causal(causal)),
                       reference, 1e-12);
    EXPECT_TENSOR_NEAR(
        F::chunked_attention(q, k, v,
                             F::ChunkedOptions().is_causal(causal).block_size(2).key_block_size(3)),
        reference, 1e-10);
    EXPECT_TENSOR_NEAR(F::fused_attention(q, k, v, F::FusedOptions().is_causal(causal)), reference,
                       1e-10);
    EXPECT_TENSOR_NEAR(F::fused_backend_attention(q, k, v, F::FusedOptions().is_causal(causal)),
                       reference, 1e-10);
  }
}

TEST(ChunkedAttention, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({2, 5, 4});
  expect_error_containing(
      [&] {
        F::chunked_attention(q, torch::randn({2, 5, 3}), q);
      },
      "[chunked_attention] expected query (..., n, hd), key (..., m, hd)");
  expect_error_containing([&] { F::chunked_attention(q, q, q, F::ChunkedOptions().block_size(0)); },
                          "block_size must be >= 1, got 0");
  expect_error_containing(
      [&] { F::chunked_attention(q, q, q, F::ChunkedOptions().key_block_size(-2)); },
      "key_block_size must be >= 1, got -2");
  expect_error_containing(
      [&] {
        F::chunked_attention(q, torch::randn({3, 5, 4}), torch::randn({3, 5, 4}));
      },
      "[chunked_attention] expected query (..., n, hd), key (..., m, hd)");
  expect_error_containing(
      [&] { F::chunked_attention(q, q, q, F::ChunkedOptions().dropout_p(1.0)); },
      "dropout_p must be in [0, 1), got 1");
  expect_error_containing([&] { F::chunked_attention(torch::randn({4}), q, q); },
                          "must have the same rank >= 2");
}

TEST(FusedAttention, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({2, 5, 4});
  expect_error_containing(
      [&] {
        F::fused_attention(q, torch::randn({2, 5, 3}), q);
      },
      "[fused_attention] expected query (..., n, hd), key (..., m, hd)");
  expect_error_containing([&] { F::fused_attention(torch::randn({4}), q, q); },
                          "must have the same rank >= 2");
  expect_error_containing(
      [&] {
        F::fused_attention(q, torch::randn({2, 0, 4}), q.narrow(1, 0, 0));
      },
      "[fused_attention] key must hold at least one token");
  const auto half = q.to(torch::kHalf);
  expect_error_containing(
      [&] { F::fused_attention(half, half, half); },
      "[fused_attention] expected query, key and value to be float32 or float64 (one dtype), "
      "got Half, Half, Half");
  expect_error_containing([&] { F::fused_attention(q, q.to(torch::kDouble), q); },
                          "float32 or float64 (one dtype), got Float, Double, Float");
  expect_error_containing([&] { F::fused_attention(q, q, q, F::FusedOptions().dropout_p(-0.1)); },
                          "[fused_attention] dropout_p must be in [0, 1), got -0.1");
  expect_error_containing(
      [] {
        F::fused_packed_attention(torch::randn({2, 5}), 1);
      },
      "[fused_packed_attention] qkv: expected (b, n, 3 * d), got [2, 5]");
  expect_error_containing(
      [] {
        F::fused_packed_attention(torch::randn({2, 5, 12}), 3);
      },
      "qkv's last dimension 12 must be 3 * num_heads * head_dim, with num_heads = 3");
  expect_error_containing(
      [] {
        F::fused_packed_attention(torch::randn({2, 5, 12}), 0);
      },
      "with num_heads = 0");
  expect_error_containing(
      [] {
        F::fused_packed_attention(torch::randn({2, 0, 12}), 2);
      },
      "[fused_packed_attention] qkv must hold at least one token");
  expect_error_containing(
      [] {
        F::fused_packed_attention(torch::randn({2, 5, 12}).to(torch::kHalf), 2);
      },
      "[fused_packed_attention] expected qkv to be float32 or float64 (one dtype), got Half");
  // The modules' fused backend takes the kernel only where it is fast.
  EXPECT_TRUE(F::fused_attention_fits(5, 5, q.options()));
  EXPECT_TRUE(F::fused_attention_fits(64, 64, q.options().dtype(torch::kDouble)));
  EXPECT_FALSE(F::fused_attention_fits(64, 65, q.options()));
  EXPECT_FALSE(F::fused_attention_fits(5, 5, half.options()));
}

TEST(FusedBackend, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({2, 2, 5, 4});
  expect_error_containing(
      [&] { F::fused_backend_attention(q, q, q, F::FusedOptions().dropout_p(1.0)); },
      "[fused_backend_attention] dropout_p must be in [0, 1), got 1");
  expect_error_containing(
      [&] { F::fused_backend_attention(q, q.narrow(-1, 0, 3), q); },
      "[fused_backend_attention] expected query (..., n, hd), key (..., m, hd)");
}

TEST(DecodeShapedAttention, NegativeOffsetsAreRefusedEverywhere) {
  const auto q = torch::randn({1, 2, 3, 4});
  const char* expected = "query_offset must be >= 0 (the key position of query 0), got -1";
  expect_error_containing(
      [&] { F::scaled_dot_product_attention(q, q, q, F::SdpaOptions().query_offset(-1)); },
      std::string("[scaled_dot_product_attention] ") + expected);
  expect_error_containing(
      [&] { F::chunked_attention(q, q, q, F::ChunkedOptions().query_offset(-1)); },
      std::string("[chunked_attention] ") + expected);
  expect_error_containing([&] { F::fused_attention(q, q, q, F::FusedOptions().query_offset(-1)); },
                          std::string("[fused_attention] ") + expected);
  expect_error_containing(
      [&] { F::fused_backend_attention(q, q, q, F::FusedOptions().query_offset(-1)); },
      std::string("[fused_backend_attention] ") + expected);
  expect_error_containing([&] { F::causal_mask(2, 2, torch::kCPU, -1); },
                          std::string("[causal_mask] ") + expected);
  expect_error_containing(
      [&] {
        F::fused_packed_attention(torch::randn({1, 3, 12}), 2, F::FusedOptions().query_offset(1));
      },
      "[fused_packed_attention] queries and keys are the same tokens, so query_offset must be "
      "0, got 1");
}

TEST(GroupedAndWindowedAttention, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({1, 6, 3, 4});
  const auto k4 = torch::randn({1, 4, 3, 4});
  const auto k8 = torch::randn({1, 8, 3, 4});
  expect_error_containing([&] { F::scaled_dot_product_attention(q, k4, k4); },
                          "[scaled_dot_product_attention] key and value heads (dim -3) must "
                          "divide the query heads (grouped-query attention), got 4 key/value "
                          "heads for 6 query heads");
  expect_error_containing([&] { F::chunked_attention(q, k4, k4); },
                          "[chunked_attention] key and value heads (dim -3) must divide");
  expect_error_containing([&] { F::fused_attention(q, k4, k4); },
                          "[fused_attention] key and value heads (dim -3) must divide");
  expect_error_containing([&] { F::fused_backend_attention(q, k8, k8); },
                          "[fused_backend_attention] key and value may have fewer heads (dim -3) "
                          "than query, not more");
  const auto window_zero = [](auto options) { return options.is_causal(true).window_size(0); };
  expect_error_containing(
      [&] { F::scaled_dot_product_attention(q, q, q, window_zero(F::SdpaOptions())); },
      "[scaled_dot_product_attention] window_size must be >= 1, got 0");
  expect_error_containing([&] { F::chunked_attention(q, q, q, window_zero(F::ChunkedOptions())); },
                          "[chunked_attention] window_size must be >= 1, got 0");
  expect_error_containing([&] { F::fused_attention(q, q, q, window_zero(F::FusedOptions())); },
                          "[fused_attention] window_size must be >= 1, got 0");
  expect_error_containing(
      [&] { F::fused_backend_attention(q, q, q, window_zero(F::FusedOptions())); },
      "[fused_backend_attention] window_size must be >= 1, got 0");
  expect_error_containing(
      [&] { F::chunked_attention(q, q, q, F::ChunkedOptions().window_size(2)); },
      "[chunked_attention] window_size (2) restricts the causal mask, so it needs is_causal = "
      "true");
  expect_error_containing([&] { F::causal_mask(2, 2, torch::kCPU, 0, -3); },
                          "[causal_mask] window_size must be >= 1, got -3");
}

TEST(DeprecatedAdapters, ModuleOptionsKeepTheirOldBlockSizeNames) {
  // chunk_size and key_chunk_size name query_block_size and key_block_size for one release,
  // and chain with the module's own setters either way round.
  auto mha = attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2).chunk_size(5).causal(false);
  static_assert(std::is_same<decltype(mha), attnkit::MultiHeadAttentionOptions>::value,
                "the old setters return the module's options");
  mha.key_chunk_size(7);
  EXPECT_EQ(mha.query_block_size(), 5);
  EXPECT_EQ(mha.key_block_size(), 7);
  EXPECT_EQ(mha.chunk_size(), 5);
  EXPECT_EQ(mha.key_chunk_size(), 7);
  EXPECT_FALSE(mha.causal());
  const auto gqa = attnkit::GroupedQueryAttentionOptions(8, 8, 0.0, 2, 1)
                       .backend(attnkit::AttentionBackend::kChunked)
                       .sliding_window_size(3)
                       .key_chunk_size(9);
  EXPECT_EQ(gqa.key_block_size(), 9);
  EXPECT_EQ(gqa.sliding_window_size(), c10::optional<int64_t>(3));
  EXPECT_EQ(gqa.backend(), attnkit::AttentionBackend::kChunked);
  // The module reads the new names: a bad old-name value is refused under the new name.
  expect_error_containing(
      [] {
        attnkit::MultiHeadLatentAttention(
            attnkit::MultiHeadLatentAttentionOptions(8, 8, 0.0, 2).chunk_size(0));
      },
      "[MultiHeadLatentAttention] option query_block_size must be > 0, got 0");
}

TEST(DeprecatedAdapters, RunThroughThePlannerWhichRecordsEachCall) {
  torch::manual_seed(4);
  const auto q = torch::randn({2, 3, 6, 4}), k = torch::randn({2, 3, 6, 4}),
             v = torch::randn({2, 3, 6, 4});
  const auto expected = F::attention(q, k, v,
                                     F::AttentionOptions()
                                         .mask(attnkit::Mask::causal())
                                         .backend(attnkit::AttentionBackend::kMath));
  F::KernelRecord record;
  const auto sdpa =
      F::scaled_dot_product_attention_with_weights(q, k, v, F::SdpaOptions().is_causal(true));
  EXPECT_EQ(record.runs().back().kernel, "math");
  EXPECT_TRUE(tensors_close("sdpa", sdpa.context, expected, 0.0));
  EXPECT_EQ(sdpa.weights.sizes(), (std::vector<int64_t>{2, 3, 6, 6}));
  EXPECT_TRUE(tensors_close("fused", F::fused_attention(q, k, v, F::FusedOptions().is_causal(true)),
                            expected, 1e-5));
  EXPECT_EQ(record.runs().back().kernel, "loop_nest");
  // (b, n, 3 * h * hd): queries, keys and values, heads side by side.
  const auto merge = [](const torch::Tensor& t) { return t.transpose(1, 2).reshape({2, 6, 12}); };
  const auto qkv = torch::cat({merge(q), merge(k), merge(v)}, -1);
  EXPECT_TRUE(tensors_close("packed",
                            F::fused_packed_attention(qkv, 3, F::FusedOptions().is_causal(true)),
                            merge(expected), 1e-5));
  EXPECT_EQ(record.runs().back().kernel, "packed_loop_nest");
  ASSERT_EQ(record.runs().size(), 3u);
  // attn_mask's leading dimensions broadcast with the inputs', or it is refused naming them.
  expect_error_containing(
      [&] {
        F::scaled_dot_product_attention(
            q, k, v, F::SdpaOptions().attn_mask(torch::zeros({4, 6, 6}, torch::kBool)));
      },
      "[scaled_dot_product_attention] the leading dimensions of query [2, 3, 6, 4], key [2, 3, "
      "6, 4], value [2, 3, 6, 4] and attn_mask [4, 6, 6] must broadcast together");
}

// Block sizes longer than the sequence are clamped to it before anything is allocated: the
// tiled kernels give the default blocks' answer (key_block_size(1 << 40) failed in the
// allocator; a block of 2^30 on 32 tokens grew to 24 GB), forward and backward, in float32
// and in bfloat16 (where the matrix units' even blocks still hold).
TEST(Attention, BlockSizesLongerThanTheSequenceAreClampedToIt) {
  torch::manual_seed(61);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto q = torch::randn({1, 2, 33, 8}).to(dtype).requires_grad_();
    for (const char* kernel : {"fused_tiles", "chunked"}) {
      SCOPED_TRACE(c10::str(kernel, ", ", dtype));
      const auto run = [&](int64_t block) {
        const auto options = F::AttentionOptions()
                                 .mask(attnkit::Mask::causal().sliding_window(5))
                                 .kernel(kernel)
                                 .query_block_size(block)
                                 .key_block_size(block);
        const auto out = F::attention(q, q, q, options);
        const auto grad = torch::autograd::grad({out.sum()}, {q})[0];
        return std::make_pair(out, grad);
      };
      const auto [out, grad] = run(int64_t{1} << 40);
      const auto [want, want_grad] = run(8);
      EXPECT_TRUE(tensors_close("out", out, want, dtype == torch::kFloat ? 1e-6 : 2e-2));
      EXPECT_TRUE(tensors_close("grad", grad, want_grad, dtype == torch::kFloat ? 1e-5 : 5e-2));
    }
  }
}

// Backward after a NaN (docs/masks.md, "NaN and infinity"), on the kernels that train: a row
// whose output is NaN gets a NaN query gradient, never a finite one; a NaN query leaves the
// other rows' gradients as they were. Blocks of 4 tokens: keys in tiles apart.
TEST(Attention, ANaNReachesTheGradientsOfTheRowsThatSeeIt) {
  torch::manual_seed(67);
  const int64_t n = 24, nan_key = 5, nan_query = 20;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto ids = torch::arange(n).div(8, "floor");  // three documents of 8
  for (const auto& [name, mask] : std::vector<std::pair<std::string, attnkit::Mask>>{
           {"causal", attnkit::Mask::causal()},
           {"window 3", attnkit::Mask::causal().sliding_window(3)},
           {"documents", attnkit::Mask::documents(ids, /*causal=*/true)}}) {
    const auto sees_key = mask.dense(1, 1, n, n, torch::kCPU)
                              .select(-1, nan_key)
                              .reshape({n});  // the rows that see the NaN key
    for (const char* kernel : {"fused_tiles", "chunked", "math"}) {
      SCOPED_TRACE(name + ", " + kernel);
      const auto options =
          F::AttentionOptions().mask(mask).kernel(kernel).query_block_size(4).key_block_size(4);
      const auto q = torch::randn({1, 2, n, 8}), k = torch::randn({1, 2, n, 8}),
                 v = torch::randn({1, 2, n, 8});
      const auto run = [&](const torch::Tensor& query, const torch::Tensor& key) {
        const auto qg = query.clone().requires_grad_(), kg = key.clone().requires_grad_();
        const auto out = F::attention(qg, kg, v, options);
        const auto dq = torch::autograd::grad({out}, {qg}, {torch::ones_like(out)})[0];
        return std::make_pair(out.detach(), dq);
      };
      // A NaN key: exactly the rows that see it are NaN, and so are their gradients. (A NaN
      // value also reaches the rows whose weights multiply it by 0, as in the math core.)
      auto k_nan = k.clone();
      k_nan.select(2, nan_key).fill_(nan);
      const auto [out, dq] = run(q, k_nan);
      const auto nan_rows = out.isnan().all(-1);  // (1, 2, n)
      EXPECT_TRUE(torch::equal(nan_rows, sees_key.expand_as(nan_rows)))
          << nan_rows.sum().item<int64_t>() << " NaN rows, " << sees_key.sum().item<int64_t>()
          << " rows see the key";
      EXPECT_TRUE(dq.isnan().all(-1).masked_select(nan_rows).all().item<bool>());
      // A NaN query: its row only; the other rows' query gradients unchanged.
      auto q_nan = q.clone();
      q_nan.select(2, nan_query).fill_(nan);
      const auto [out_q, dq_q] = run(q_nan, k);
      const auto [clean_out, clean_dq] = run(q, k);
      const auto others = torch::arange(n).ne(nan_query);
      EXPECT_TRUE(out_q.select(2, nan_query).isnan().all().item<bool>());
      EXPECT_TRUE(dq_q.select(2, nan_query).isnan().all().item<bool>());
      EXPECT_TRUE(tensors_close("other rows",
                                out_q.index({"...", others, torch::indexing::Slice()}),
                                clean_out.index({"...", others, torch::indexing::Slice()}), 1e-5));
      EXPECT_TRUE(tensors_close("their dq", dq_q.index({"...", others, torch::indexing::Slice()}),
                                clean_dq.index({"...", others, torch::indexing::Slice()}), 1e-5));
      // A NaN score: head 0's ALiBi slope. That head's rows and gradients are NaN, head 1's
      // as without it.
      const auto with_slopes = [&](double first) {
        const auto qg = q.clone().requires_grad_();
        const auto scored =
            F::attention(qg, k, v,
                         F::AttentionOptions(options).score_mod(
                             attnkit::score_mods::alibi(torch::tensor({first, 0.5}))));
        const auto grad = torch::autograd::grad({scored}, {qg}, {torch::ones_like(scored)})[0];
        return std::make_pair(scored.detach(), grad);
      };
      const auto [out_s, dq_s] = with_slopes(nan);
      const auto [clean_s, clean_dq_s] = with_slopes(0.25);
      EXPECT_TRUE(out_s.select(1, 0).isnan().all().item<bool>());
      EXPECT_TRUE(dq_s.select(1, 0).isnan().all().item<bool>());
      EXPECT_TRUE(tensors_close("head 1", out_s.select(1, 1), clean_s.select(1, 1), 1e-5));
      EXPECT_TRUE(tensors_close("head 1's dq", dq_s.select(1, 1), clean_dq_s.select(1, 1), 1e-5));
    }
  }
}

// Whatever a C++ score function or mask function throws reaches the caller as an error, on
// every backend and with worker threads: an exception that is no std::exception (throw 42)
// ended the process from a worker (std::terminate).
TEST(Attention, AnythingAUserFunctionThrowsReachesTheCaller) {
  ASSERT_GE(torch::get_num_threads(), 1);
  const auto q = torch::randn({2, 4, 64, 8});
  const attnkit::ScoreMod throws_int = [](const torch::Tensor& score, const torch::Tensor&,
                                          const torch::Tensor&, const torch::Tensor&,
                                          const torch::Tensor&) -> torch::Tensor {
    if (score.numel() > 0)
      throw 42;
    return score;
  };
  for (const auto backend : {attnkit::AttentionBackend::kAuto, attnkit::AttentionBackend::kChunked,
                             attnkit::AttentionBackend::kMath}) {
    SCOPED_TRACE(attnkit::backend_name(backend));
    const auto mask_throws = attnkit::Mask::from_function(
        [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q_idx,
           const torch::Tensor&) -> torch::Tensor {
          if (q_idx.numel() > 0)
            throw 42;
          return q_idx;
        });
    for (const auto& options : {F::AttentionOptions().backend(backend).score_mod(throws_int),
                                F::AttentionOptions().backend(backend).mask(mask_throws)}) {
      bool caught = false;
      try {
        F::attention(q, q, q, options);
      } catch (...) {
        caught = true;
      }
      EXPECT_TRUE(caught);
    }
  }
}
