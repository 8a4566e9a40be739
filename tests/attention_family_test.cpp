// The modern attention family: GroupedQueryAttention (and multi-query attention),
// sliding windows on MultiHeadAttention and GroupedQueryAttention, MultiHeadLatentAttention.
// Their layout, every backend against math, their KV caches against the uncached forward
// (with the rolling window and the latent cache), their cache sizes, and every refusal.

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "module_factory.h"
#include "test_support.h"

#include <torch/version.h>

using namespace attnkit;
using namespace attnkit::testing;

namespace {

// The modules under test, by a short label, each with small blocks for the chunked backend
// so that 11 tokens cross block edges.
CachedAttention make_family_module(const std::string& label) {
  const int64_t d_in = 6, d_out = 12, heads = 4;
  const auto gqa = [&](int64_t groups) {
    return GroupedQueryAttentionOptions(d_in, d_out, 0.1, heads, groups)
        .qkv_bias(true)
        .query_block_size(3)
        .key_block_size(4);
  };
  if (label == "gqa")
    return GroupedQueryAttention(gqa(2)).ptr();
  if (label == "mqa")
    return GroupedQueryAttention(gqa(1)).ptr();
  if (label == "gqa window 3")
    return GroupedQueryAttention(gqa(2).sliding_window_size(3)).ptr();
  // Gemma 2's attention: a softcap small enough to change every weight, a scale of its own,
  // on a rolling cache.
  if (label == "gqa window 3 softcap scale")
    return GroupedQueryAttention(
               gqa(2).sliding_window_size(3).score_mod(score_mods::softcap(0.5)).scale(0.3))
        .ptr();
  // GPT-OSS's attention: sinks (drawn, so that each head's differs) on a rolling cache.
  if (label == "gqa window 3 sinks") {
    GroupedQueryAttention module(gqa(2).sliding_window_size(3).sinks(true));
    torch::NoGradGuard no_grad;
    module->sinks.uniform_(-1.0, 1.0);
    return module.ptr();
  }
  const auto mha = MultiHeadAttentionOptions(d_in, d_out, 16, 0.1, heads)
                       .qkv_bias(true)
                       .query_block_size(3)
                       .key_block_size(4);
  // A score function that reads positions: cached calls must give it the sequence's (a
  // clamped distance, so that a query offset missed would not cancel in the softmax as
  // ALiBi's would).
  if (label == "mha relative bias")
    return MultiHeadAttention(MultiHeadAttentionOptions(mha).score_mod(
                                  score_mods::relative_position_bias(torch::randn({heads, 5}))))
        .ptr();
  if (label == "mha window 4")
    return MultiHeadAttention(MultiHeadAttentionOptions(mha).sliding_window_size(4)).ptr();
  if (label == "mha-combined window 1")
    return MultiHeadAttentionCombinedQKV(MultiHeadAttentionOptions(mha).sliding_window_size(1))
        .ptr();
  TORCH_CHECK(label == "mla" || label == "mla softcap", "unknown module ", label);
  auto mla = MultiHeadLatentAttentionOptions(d_in, d_out, 0.1, heads)
                 .qkv_bias(true)
                 .latent_dim(5)
                 .query_block_size(3)
                 .key_block_size(4);
  // With a softcap the decode step cannot drop W_UK's bias term, a per-row constant.
  if (label == "mla softcap")
    mla.score_mod(score_mods::softcap(0.5));
  return MultiHeadLatentAttention(mla).ptr();
}

const std::vector<std::string> kFamily{"gqa",
                                       "mqa",
                                       "gqa window 3",
                                       "gqa window 3 softcap scale",
                                       "gqa window 3 sinks",
                                       "mha relative bias",
                                       "mha window 4",
                                       "mha-combined window 1",
                                       "mla",
                                       "mla softcap"};

// Output and the gradient of every parameter and of x for sum(forward(x) * probe).
std::vector<torch::Tensor> output_and_grads(CachedAttention& m, const torch::Tensor& x_in,
                                            const torch::Tensor& probe) {
  m->as_module()->zero_grad();
  auto x = x_in.clone().requires_grad_(true);
  const auto out = m->forward(x);
  (out * probe).sum().backward();
  std::vector<torch::Tensor> result{out.detach(), x.grad()};
  for (const auto& p : m->as_module()->parameters())
    result.push_back(p.grad().clone());
  return result;
}

}  // namespace

TEST(AttentionFamily, ParametersHaveThePythonNamesOrderAndShapes) {
  GroupedQueryAttention gqa(8, 12, 0.0, 6, 2);
  EXPECT_EQ(gqa->named_parameters().keys(),
            (std::vector<std::string>{"W_key.weight", "W_value.weight", "W_query.weight",
                                      "out_proj.weight"}));
  EXPECT_EQ(gqa->W_key->weight.sizes(), (std::vector<int64_t>{4, 8}));  // 2 groups x head_dim 2
  EXPECT_EQ(gqa->W_query->weight.sizes(), (std::vector<int64_t>{12, 8}));
  EXPECT_TRUE(gqa->named_buffers().is_empty());
  // GPT-OSS's sinks: one per query head, starting at zeros; the module's own parameter comes
  // before its children's, as in Python's state_dict.
  GroupedQueryAttention sunk(GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).sinks(true));
  EXPECT_EQ(sunk->named_parameters().keys(),
            (std::vector<std::string>{"sinks", "W_key.weight", "W_value.weight", "W_query.weight",
                                      "out_proj.weight"}));
  EXPECT_EQ(sunk->sinks.sizes(), (std::vector<int64_t>{6}));
  {
    torch::NoGradGuard no_grad;
    sunk->sinks.fill_(1.0);
  }
  sunk->reset_parameters();
  EXPECT_TRUE(sunk->sinks.eq(0).all().item<bool>());
  // Qwen3's shape: heads together (12) wider than the model (8), projected back to 8, also
  // from the cache.
  GroupedQueryAttention wide(GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).output_dim(8));
  EXPECT_EQ(wide->out_proj->weight.sizes(), (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(wide->forward(torch::randn({2, 5, 8})).sizes(), (std::vector<int64_t>{2, 5, 8}));
  wide->eval();
  auto cache = wide->make_kv_cache(2, 5);
  EXPECT_EQ(wide->forward_with_cache(torch::randn({2, 3, 8}), cache).sizes(),
            (std::vector<int64_t>{2, 3, 8}));
  MultiHeadLatentAttention mla(8, 64, 0.0, 4, /*qkv_bias=*/true);
  EXPECT_EQ(mla->latent_dim(), 16);  // max(16, 64 / 8)
  EXPECT_EQ(MultiHeadLatentAttention(8, 256, 0.0, 4)->latent_dim(), 32);
  EXPECT_EQ(mla->named_parameters().keys(),
            (std::vector<std::string>{"W_query.weight", "W_query.bias", "W_DKV.weight",
                                      "W_DKV.bias", "W_UK.weight", "W_UK.bias", "W_UV.weight",
                                      "W_UV.bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(mla->W_DKV->weight.sizes(), (std::vector<int64_t>{16, 8}));
  EXPECT_EQ(mla->W_UK->weight.sizes(), (std::vector<int64_t>{64, 16}));
}

TEST(AttentionFamily, PrettyPrintShowsEveryOption) {
  std::ostringstream gqa, mla, mha;
  GroupedQueryAttention(GroupedQueryAttentionOptions(8, 12, 0.1, 6, 2).sliding_window_size(5))
      ->pretty_print(gqa);
  EXPECT_EQ(gqa.str(),
            "attnkit::GroupedQueryAttention(d_in=8, d_out=12, dropout=0.1, num_heads=6, "
            "num_kv_groups=2, qkv_bias=false, sliding_window_size=5, backend=math, "
            "query_block_size=128, key_block_size=1024)");
  std::ostringstream scored;
  GroupedQueryAttention(GroupedQueryAttentionOptions(8, 12, 0.1, 6, 2)
                            .score_mod(score_mods::softcap(50.0))
                            .scale(0.0625))
      ->pretty_print(scored);
  EXPECT_NE(scored.str().find(", score_mod=softcap(50), scale=0.0625)"), std::string::npos)
      << scored.str();
  std::ostringstream with_sinks;
  GroupedQueryAttention(GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).sinks(true))
      ->pretty_print(with_sinks);
  EXPECT_NE(with_sinks.str().find(", sinks=true)"), std::string::npos) << with_sinks.str();
  std::ostringstream function;
  MultiHeadAttention(MultiHeadAttentionOptions(8, 12, 4, 0.0, 2)
                         .score_mod(score_mods::alibi(score_mods::alibi_slopes(2))))
      ->pretty_print(function);
  EXPECT_NE(function.str().find(", score_mod=function)"), std::string::npos) << function.str();
  MultiHeadLatentAttention(8, 12, 0.0, 2, true, 7)->pretty_print(mla);
  EXPECT_EQ(
      mla.str(),
      "attnkit::MultiHeadLatentAttention(d_in=8, d_out=12, dropout=0, num_heads=2, "
      "qkv_bias=true, latent_dim=7, backend=math, query_block_size=128, key_block_size=1024)");
  MultiHeadAttention(8, 12, 4, 0.0, 2)->pretty_print(mha);
  EXPECT_NE(mha.str().find("causal=true, sliding_window_size=none, backend=math"),
            std::string::npos)
      << mha.str();
}

TEST(AttentionFamily, OneGroupPerHeadIsMultiHeadAttention) {
  torch::manual_seed(51);
  MultiHeadAttention mha(MultiHeadAttentionOptions(6, 12, 10, 0.0, 3).qkv_bias(true));
  GroupedQueryAttention gqa(6, 12, 0.0, 3, /*num_kv_groups=*/3, /*qkv_bias=*/true);
  {
    torch::NoGradGuard no_grad;
    gqa->W_query->weight.copy_(mha->W_query->weight);
    gqa->W_query->bias.copy_(mha->W_query->bias);
    gqa->W_key->weight.copy_(mha->W_key->weight);
    gqa->W_key->bias.copy_(mha->W_key->bias);
    gqa->W_value->weight.copy_(mha->W_value->weight);
    gqa->W_value->bias.copy_(mha->W_value->bias);
    gqa->out_proj->weight.copy_(mha->out_proj->weight);
    mha->out_proj->bias.zero_();  // GQA's out_proj has none
  }
  const auto x = torch::randn({2, 10, 6});
  EXPECT_TENSOR_NEAR(gqa(x), mha(x), 1e-6);
  EXPECT_TENSOR_NEAR(gqa->forward_with_weights(x).weights, mha->forward_with_weights(x).weights,
                     1e-6);
}

TEST(AttentionFamily, EveryBackendMatchesMathOutputsAndGradients) {
  for (const auto& label : kFamily) {
    for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
      for (const int64_t n : {1, 7, 11}) {
        torch::manual_seed(53);
        auto m = make_family_module(label);
        m->as_module()->to(dtype);
        m->as_module()->eval();
        const auto x = torch::randn({2, n, 6}, torch::dtype(dtype));
        const auto probe = torch::randn({2, n, 12}, torch::dtype(dtype));
        m->set_backend(AttentionBackend::kMath);
        const auto math = output_and_grads(m, x, probe);
        for (const auto backend : {AttentionBackend::kFused, AttentionBackend::kChunked}) {
          SCOPED_TRACE(c10::str(label, " ", backend_name(backend), " ", dtype, " n ", n));
          m->set_backend(backend);
          const auto other = output_and_grads(m, x, probe);
          ASSERT_EQ(other.size(), math.size());
          for (size_t i = 0; i < math.size(); ++i) {
            EXPECT_TRUE(tensors_close(i == 0 ? "output" : c10::str("grad ", i), other[i], math[i],
                                      agreement(dtype)));
          }
        }
      }
    }
  }
}

TEST(AttentionFamily, WindowedModulesAttendOnlyInsideTheWindow) {
  torch::manual_seed(55);
  GroupedQueryAttention gqa(GroupedQueryAttentionOptions(4, 8, 0.0, 4, 2).sliding_window_size(3));
  const auto weights = gqa->forward_with_weights(torch::randn({1, 9, 4})).weights;  // (1, 4, 9, 9)
  // Query i sees keys i - 2 .. i.
  const auto outside = functional::causal_mask(9, 9, torch::kCPU, 0, 3);
  EXPECT_TRUE(weights.masked_select(outside.expand_as(weights)).eq(0).all().item<bool>());
  EXPECT_TRUE(
      weights.masked_select(outside.logical_not().expand_as(weights)).gt(0).all().item<bool>());
}

TEST(AttentionFamily, CachedPiecesEqualTheUncachedForward) {
  // Whole prompt, pieces of every size (some longer than the windows), one token at a time.
  const std::vector<std::vector<int64_t>> splits{
      {11}, {4, 1, 1, 5}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {3, 8}, {10, 1}, {2, 2, 5, 2}};
  for (const auto& label : kFamily) {
    for (const auto backend : kBackends) {
      for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
        torch::manual_seed(57);
        auto m = make_family_module(label);
        m->set_backend(backend);
        m->as_module()->to(dtype);
        m->as_module()->eval();
        const auto x = torch::randn({2, 11, 6}, torch::dtype(dtype));
        auto cache = m->make_kv_cache(2, 11);
        expect_cached_pieces_match_forward(m, x, splits, cache,
                                           label + " " + backend_name(backend));
      }
    }
  }
}

TEST(AttentionFamily, TheRollingCacheHoldsAtMostTheWindowHoweverLong) {
  torch::manual_seed(59);
  GroupedQueryAttention gqa(GroupedQueryAttentionOptions(4, 8, 0.0, 4, 2)
                                .sliding_window_size(5)
                                .backend(AttentionBackend::kFused));
  gqa->eval();
  const auto x = torch::randn({1, 40, 4});
  const auto full = gqa(x);
  auto cache = gqa->make_kv_cache(1, /*capacity, ignored by a rolling cache=*/0);
  EXPECT_EQ(cache.capacity(), 5);
  EXPECT_EQ(cache.window_size(), 5);
  const auto* storage = cache.keys().data_ptr<float>();
  std::vector<torch::Tensor> outputs;
  for (int64_t t = 0; t < 40; ++t) {
    outputs.push_back(gqa->forward_with_cache(x.narrow(1, t, 1), cache));
    EXPECT_EQ(cache.held(), std::min<int64_t>(t + 1, 5));
    EXPECT_EQ(cache.keys().data_ptr<float>(), storage) << "reallocated at step " << t;
  }
  EXPECT_EQ(cache.size(), 40);
  EXPECT_TENSOR_NEAR(torch::cat(outputs, 1), full, 1e-5);
  // The slots hold positions 35..39, position p in slot p % 5.
  const auto keys = gqa->W_key(x).view({1, 40, 2, 2}).transpose(1, 2);  // (1, 2, 40, 2)
  for (int64_t p = 35; p < 40; ++p) {
    EXPECT_TENSOR_NEAR(cache.keys().select(2, p % 5), keys.select(2, p), 1e-6);
  }
}

TEST(AttentionFamily, CacheBytesPerTokenFollowTheLayout) {
  // d 768, 12 heads (head_dim 64), float32: MHA keeps 2 x 768 values per token.
  const auto mha = MultiHeadAttention(768, 768, 8, 0.0, 12)->make_kv_cache(1);
  const auto gqa = GroupedQueryAttention(768, 768, 0.0, 12, 4)->make_kv_cache(1, 8);
  const auto mqa = GroupedQueryAttention(768, 768, 0.0, 12, 1)->make_kv_cache(1, 8);
  const auto mla = MultiHeadLatentAttention(768, 768, 0.0, 12, false, 96)->make_kv_cache(1, 8);
  EXPECT_EQ(mha.bytes_per_token(), 2 * 768 * 4);
  EXPECT_EQ(3 * gqa.bytes_per_token(), mha.bytes_per_token());
  EXPECT_EQ(12 * mqa.bytes_per_token(), mha.bytes_per_token());
  EXPECT_EQ(16 * mla.bytes_per_token(), mha.bytes_per_token());
  EXPECT_TRUE(mla.is_latent());
}

TEST(AttentionFamily, EveryCachedModuleIsOneCachedAttentionLayer) {
  // What a model sees through the interface is the module itself: its parameters, its
  // backend, its outputs and its cache, the same as through the module's own holder.
  const auto x = torch::randn({2, 7, 6});
  for (const auto& label : kFamily) {
    SCOPED_TRACE(label);
    torch::manual_seed(5);
    CachedAttention layer = make_family_module(label);
    const auto module = layer->as_module();
    module->eval();
    EXPECT_EQ(module.get(), dynamic_cast<torch::nn::Module*>(layer.get()));
    EXPECT_EQ(module->parameters().size(), module->named_parameters().size());
    for (const auto backend : kBackends) {
      layer->set_backend(backend);
      EXPECT_EQ(layer->backend(), backend);
      const auto through_weights = layer->forward_with_weights(x);
      EXPECT_TRUE(tensors_close("forward", layer->forward(x), through_weights.context, 1e-5));
      EXPECT_EQ(through_weights.weights.sizes(), (std::vector<int64_t>{2, 4, 7, 7}));
      auto cache = layer->make_kv_cache(2, 7);
      const auto first = layer->forward_with_cache(x.narrow(1, 0, 4), cache);
      const auto rest =
          layer->forward_with_cache(x.narrow(1, 4, 3), cache, torch::full({2}, 3, torch::kInt64));
      EXPECT_TRUE(
          tensors_close("cached", torch::cat({first, rest}, 1), through_weights.context, 1e-5));
    }
  }
  // The module holders' own calls reach the same functions.
  torch::manual_seed(5);
  GroupedQueryAttention gqa(GroupedQueryAttentionOptions(6, 12, 0.0, 4, 2));
  std::shared_ptr<CachedAttentionLayer> layer = gqa.ptr();
  layer->set_backend(AttentionBackend::kChunked);
  EXPECT_EQ(gqa->options.backend(), AttentionBackend::kChunked);
  EXPECT_TRUE(tensors_close("holder", gqa(x), layer->forward(x), 0.0));
  EXPECT_EQ(layer->as_module().get(), gqa.ptr().get());
}

TEST(AttentionFamily, ResetParametersRepeatsTheConstructorsDraws) {
  // After the constructor's seed, reset_parameters() draws every projection again in the
  // constructor's order, and QK-norm's weights return to ones.
  const auto check = [](const std::string& label, auto make) {
    SCOPED_TRACE(label);
    torch::manual_seed(8);
    auto fresh = make();
    auto reset = make();
    {
      torch::NoGradGuard no_grad;
      for (auto& parameter : reset->parameters())
        parameter.fill_(0.25);
    }
    torch::manual_seed(8);
    reset->reset_parameters();
    const auto expected = fresh->named_parameters();
    ASSERT_EQ(reset->named_parameters().size(), expected.size());
    for (const auto& parameter : reset->named_parameters())
      EXPECT_TRUE(torch::equal(parameter.value(), expected[parameter.key()])) << parameter.key();
  };
  const auto mha = MultiHeadAttentionOptions(6, 12, 16, 0.0, 4).qkv_bias(true).qk_norm(true);
  check("mha", [&] { return MultiHeadAttention(mha); });
  check("mha-combined", [&] { return MultiHeadAttentionCombinedQKV(mha); });
  check("gqa", [] {
    return GroupedQueryAttention(GroupedQueryAttentionOptions(6, 12, 0.0, 4, 2).qkv_bias(true));
  });
  check("mla", [] {
    return MultiHeadLatentAttention(MultiHeadLatentAttentionOptions(6, 12, 0.0, 4).latent_dim(5));
  });
}

TEST(AttentionFamily, RefusalsNameWhatIsWrong) {
  expect_error_containing(
      [] { GroupedQueryAttention(GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).scale(-1.0)); },
      "[GroupedQueryAttention] option scale must be finite and > 0 (unset: 1 / sqrt(head "
      "width)), got -1");
  expect_error_containing(
      [] { MultiHeadAttention(MultiHeadAttentionOptions(8, 12, 4, 0.0, 2).scale(std::nan(""))); },
      "[MultiHeadAttention] option scale must be finite and > 0");
  expect_error_containing([] { GroupedQueryAttention(8, 12, 0.0, 6, 4); },
                          "[GroupedQueryAttention] option num_heads must be divisible by "
                          "num_kv_groups, got num_heads = 6, num_kv_groups = 4");
  expect_error_containing([] { GroupedQueryAttention(8, 12, 0.0, 5, 5); },
                          "[GroupedQueryAttention] option d_out must be divisible by num_heads");
  expect_error_containing([] { GroupedQueryAttention(8, 12, 0.0, 6, 0); },
                          "[GroupedQueryAttention] option num_kv_groups must be > 0, got 0");
  expect_error_containing(
      [] { GroupedQueryAttention(GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).output_dim(0)); },
      "[GroupedQueryAttention] option output_dim must be > 0, got 0");
  expect_error_containing(
      [] {
        GroupedQueryAttention(
            GroupedQueryAttentionOptions(8, 12, 0.0, 6, 2).sliding_window_size(0));
      },
      "[GroupedQueryAttention] option sliding_window_size must be >= 1, got 0");
  expect_error_containing(
      [] {
        MultiHeadAttention(
            MultiHeadAttentionOptions(8, 12, 4, 0.0, 2).causal(false).sliding_window_size(2));
      },
      "[MultiHeadAttention] option sliding_window_size (2) limits how far back a token "
      "attends, so it needs causal = true");
  expect_error_containing([] { MultiHeadLatentAttention(8, 12, 0.0, 2, false, -1); },
                          "[MultiHeadLatentAttention] option latent_dim must be > 0, got -1");
  expect_error_containing([] { MultiHeadLatentAttention(8, 12, 0.0, 5); },
                          "[MultiHeadLatentAttention] option d_out must be divisible by num_heads");

  GroupedQueryAttention gqa(4, 8, 0.0, 4, 2);
  gqa->eval();
  expect_error_containing([&] { gqa->make_kv_cache(1, 0); },
                          "[GroupedQueryAttention::make_kv_cache] capacity (the most positions the "
                          "cache will hold) must be >= 1, got 0");
  auto cache = gqa->make_kv_cache(1, 4);
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(torch::randn({1, 5, 4}), cache);
      },
      "[GroupedQueryAttention::forward_with_cache] x: 5 tokens after the 0 the cache holds would "
      "pass its capacity 4");
  auto mha_cache = MultiHeadAttention(4, 8, 8, 0.0, 4)->make_kv_cache(1);
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(torch::randn({1, 1, 4}), mha_cache);
      },
      "cache: expected (batch, num_heads, head_dim) = (1, 2, 2), got (1, 4, 2)");
  auto rolling =
      GroupedQueryAttention(GroupedQueryAttentionOptions(4, 8, 0.0, 4, 2).sliding_window_size(3))
          ->make_kv_cache(1, 0);
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(torch::randn({1, 1, 4}), rolling);
      },
      "cache: expected a key/value cache, got a rolling cache of "
      "window_size 3; make it with make_kv_cache");
  MultiHeadLatentAttention mla(4, 8, 0.0, 2, false, 3);
  mla->eval();
  expect_error_containing(
      [&] {
        mla->forward_with_cache(torch::randn({1, 1, 4}), cache);
      },
      "[MultiHeadLatentAttention::forward_with_cache] cache: expected a latent "
      "cache, got a key/value cache");
  auto latent = mla->make_kv_cache(1, 4);
  expect_error_containing(
      [&] {
        latent.append(torch::zeros({1, 1, 1, 3}), torch::zeros({1, 1, 1, 3}));
      },
      "[KVCache::append] this is a latent cache; use append_latent");
  expect_error_containing(
      [&] {
        cache.append_latent(torch::zeros({1, 1, 2}));
      },
      "[KVCache::append_latent] this cache holds keys and values; use append");
  expect_error_containing(
      [&] {
        latent.append_latent(torch::zeros({1, 1, 2}));
      },
      "[KVCache::append_latent] latents: expected (1, 1, n, 3), got [1, 1, 1, 2]");
  expect_error_containing([] { KVCache::sliding_window(1, 2, 3, 0); },
                          "[KVCache::sliding_window] window_size must be >= 1, got 0");
  mla->train();
  expect_error_containing(
      [&] {
        mla->forward_with_cache(torch::randn({1, 1, 4}), latent);
      },
      "the KV cache is for inference, but the module is in training mode");
  EXPECT_EQ(latent.size(), 0) << "a refused call changed the cache";
}

// Every module with backends and a KV cache, with each backend, on each device: the CPU
// math backend's outputs and gradients (float32, to 1e-4: other kernels, other summation
// orders), and cached decoding on the device equal to its own full forward.
class AttentionFamilyDevices : public DeviceTest {};

TEST_P(AttentionFamilyDevices, EveryModuleAndBackendMatchesTheCpu) {
  constexpr double kAcrossDevices = 1e-4;
  ModuleConfig base;
  base.d_in = 6;
  base.d_out = 8;
  base.context_length = 16;
  base.num_heads = 4;
  base.qkv_bias = true;
  auto windowed = base, grouped = base, latent = base;
  windowed.sliding_window_size = 5;
  grouped.num_kv_groups = 2;
  grouped.sliding_window_size = 5;
  latent.latent_dim = 4;
  const std::vector<std::pair<std::string, ModuleConfig>> cases{
      {"MultiHeadAttention", base},
      {"MultiHeadAttention", windowed},
      {"MultiHeadAttentionCombinedQKV", base},
      {"GroupedQueryAttention", grouped},
      {"MultiHeadLatentAttention", latent}};
  for (const auto& [name, config] : cases) {
    for (const auto backend : kBackends) {
      SCOPED_TRACE(name + " " + config.json() + " " + backend_name(backend));
      torch::manual_seed(5);
      auto reference = make_cached_attention(name, config);
      torch::manual_seed(5);  // the same initial parameters
      auto on_device = make_cached_attention(name, config);
      on_device->as_module()->to(device());
      on_device->set_backend(backend);
      const auto x = torch::randn({2, 13, 6});
      const auto probe = torch::randn({2, 13, 8});
      const auto run = [&](CachedAttention& m, const torch::Device& where) {
        auto input = x.to(where).detach().requires_grad_();  // a leaf on each device
        const auto out = m->forward(input);
        EXPECT_EQ(out.device().type(), where.type());
        (out * probe.to(where)).sum().backward();
        return std::make_pair(out.detach(), input.grad());
      };
      const auto [expected, expected_grad] = run(reference, torch::kCPU);
      const auto [out, grad] = run(on_device, device());
      EXPECT_TRUE(tensors_close("output", out, expected, kAcrossDevices));
      EXPECT_TRUE(tensors_close("input grad", grad, expected_grad, kAcrossDevices));
      const auto expected_params = reference->as_module()->named_parameters();
      for (const auto& p : on_device->as_module()->named_parameters()) {
        EXPECT_TRUE(tensors_close("grad " + p.key(), p.value().grad(),
                                  expected_params[p.key()].grad(), kAcrossDevices));
      }
      // Prefill 9 tokens, then one at a time: the full forward's rows.
      on_device->as_module()->eval();
      torch::NoGradGuard no_grad;
      const auto x_device = x.to(device());
      auto cache = on_device->make_kv_cache(2, 16);
      std::vector<torch::Tensor> pieces{
          on_device->forward_with_cache(x_device.slice(1, 0, 9), cache)};
      for (int64_t t = 9; t < 13; ++t)
        pieces.push_back(on_device->forward_with_cache(x_device.slice(1, t, t + 1), cache));
      EXPECT_TRUE(tensors_close("cached decoding", torch::cat(pieces, 1),
                                on_device->forward(x_device), kAcrossDevices));
    }
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(AttentionFamilyDevices);

// The modules with 16-bit parameters and caches: forward, backward and cached decoding in
// bfloat16 (and float16 where LibTorch has 16-bit CPU matrix products: 2.x), on every backend.
// The 16-bit module is compared with a float32 copy of its own (rounded) weights on the same
// rounded inputs: the projections round each result to the 8 (bfloat16) or 11 (float16)
// mantissa bits, so outputs and gradients may differ by several of those roundings, 2^-8 or
// 2^-11 relative each; the bound is 8 of them (measured: up to 6), relative to the tensor's
// largest value. The key bias's gradient is zero in exact arithmetic (a bias on every key
// shifts each query's scores by a constant), so it (any tensor under 1e-4 of x's gradient) is
// measured against x's gradient instead.
TEST(AttentionFamily, SixteenBitModulesTrainAndDecodeAsTheirFloat32Copies) {
  std::vector<torch::ScalarType> dtypes{torch::kBFloat16};
  // 1.13 has no float16 matrix product on the CPU: its float16 modules are refused by name.
  EXPECT_EQ(attnkit::cpu_multiplies_float16(), TORCH_VERSION_MAJOR >= 2);
  if (attnkit::cpu_multiplies_float16()) {
    dtypes.push_back(torch::kHalf);
  } else {
    auto m = make_family_module("gqa");
    m->as_module()->to(torch::kHalf);
    expect_error_containing(
        [&] {
          m->forward(torch::randn({2, 11, 6}).to(torch::kHalf));
        },
        "[GroupedQueryAttention::forward] query: float16 on the CPU needs a LibTorch with "
        "float16 matrix products (2.x; this one has none); use bfloat16 or float32, or a GPU");
  }
  const std::vector<std::vector<int64_t>> splits{{11}, {4, 1, 1, 5}, {3, 8}};
  for (const auto dtype : dtypes) {
    const double bound = 8.0 * (dtype == torch::kBFloat16 ? 1.0 / 256 : 1.0 / 2048);
    for (const auto& label : kFamily) {
      for (const auto backend : kBackends) {
        SCOPED_TRACE(c10::str(label, " ", backend_name(backend), " ", dtype));
        torch::manual_seed(61);
        auto low = make_family_module(label);
        torch::manual_seed(61);
        auto wide = make_family_module(label);
        for (const auto& m : {low, wide}) {
          m->set_backend(backend);
          m->as_module()->to(dtype);
          m->as_module()->eval();
        }
        wide->as_module()->to(torch::kFloat);
        const auto x = torch::randn({2, 11, 6}).to(dtype);
        const auto probe = torch::randn({2, 11, 12}).to(dtype);
        const auto got = output_and_grads(low, x, probe);
        const auto expected = output_and_grads(wide, x.to(torch::kFloat), probe.to(torch::kFloat));
        ASSERT_EQ(got.size(), expected.size());
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].scalar_type(), dtype) << "tensor " << i;
          const double own = expected[i].abs().max().item<double>();
          const double of_x = expected[1].abs().max().item<double>();
          const double scale = own > 1e-4 * of_x ? own : of_x;  // zero in exact arithmetic
          const auto error =
              (got[i].to(torch::kFloat) - expected[i]).abs().max().item<double>() / scale;
          EXPECT_LE(error, bound) << "tensor " << i << " (0: output, 1: x's gradient, then the "
                                  << "parameters' gradients)";
        }
        // The cache holds 16-bit keys and values; pieces agree with the uncached forward.
        const torch::NoGradGuard no_grad;
        auto cache = low->make_kv_cache(2, 11);
        EXPECT_EQ(cache.keys().scalar_type(), dtype);
        const auto full = low->forward(x).to(torch::kFloat);
        for (const auto& pieces : splits) {
          cache.reset();
          const auto cached = forward_in_pieces(low, x, pieces, cache).to(torch::kFloat);
          EXPECT_LE(((cached - full).abs().max() / full.abs().max()).item<double>(), bound)
              << "pieces " << c10::IntArrayRef(pieces);
        }
      }
    }
  }
}

// Under LibTorch's autocast a float32 module runs its projections in bfloat16 and answers in
// bfloat16, within the bound of a bfloat16 copy of it (SixteenBitModules... above); its
// gradients, taken after the guard, are float32. It takes inputs in bfloat16 there too (not
// outside), and its float32 KV cache serves a decode in pieces.
TEST(AttentionFamily, UnderAutocastFloat32ModulesRunInBfloat16) {
  const double bound = 8.0 / 256;
  for (const auto& label : kFamily) {
    for (const auto backend : kBackends) {
      SCOPED_TRACE(c10::str(label, " ", backend_name(backend)));
      torch::manual_seed(63);
      auto m = make_family_module(label);
      m->set_backend(backend);
      m->as_module()->eval();
      const auto x = torch::randn({2, 11, 6});
      const auto probe = torch::randn({2, 11, 12});
      const auto expected = output_and_grads(m, x, probe);
      m->as_module()->zero_grad();
      auto x_grad = x.clone().requires_grad_(true);
      torch::Tensor out;
      {
        attnkit::Autocast autocast(torch::kCPU, torch::kBFloat16);
        out = m->forward(x_grad);
        const torch::NoGradGuard no_grad;
        EXPECT_EQ(m->forward(x.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
        auto cache = m->make_kv_cache(2, 11);
        const auto cached = forward_in_pieces(m, x, {4, 1, 6}, cache).to(torch::kFloat);
        const auto full = m->forward(x).to(torch::kFloat);
        EXPECT_LE(((cached - full).abs().max() / full.abs().max()).item<double>(), bound);
      }
      EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
      (out.to(torch::kFloat) * probe).sum().backward();
      std::vector<torch::Tensor> got{out.detach(), x_grad.grad()};
      for (const auto& p : m->as_module()->parameters())
        got.push_back(p.grad());
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].scalar_type(), i == 0 ? torch::kBFloat16 : torch::kFloat) << i;
        const double own = expected[i].abs().max().item<double>();
        const double of_x = expected[1].abs().max().item<double>();
        const double scale = own > 1e-4 * of_x ? own : of_x;  // zero in exact arithmetic
        EXPECT_LE((got[i].to(torch::kFloat) - expected[i]).abs().max().item<double>() / scale,
                  bound)
            << "tensor " << i << " (0: output, 1: x's gradient, then the parameters')";
      }
      expect_error_containing([&] { m->forward(x.to(torch::kBFloat16)); }, "expected dtype Float");
    }
  }
}
