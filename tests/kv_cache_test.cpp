// Inference: the KV cache of the multi-head modules (prefill, chunked prefill and decode
// against the uncached forward, on every backend; the Python reference's cached outputs;
// every refusal) and attnkit::generate over attnkit-train's model.

#include <algorithm>
#include <array>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "attnkit/attnkit.h"
#include "core/kernels/decode_attention.h"
#include "module_factory.h"
#include "modules/few_rows_linear.h"
#include "source_paths.h"
#include "test_support.h"
#include "train/model.h"

using namespace attnkit;
using namespace attnkit::testing;

namespace {

CachedAttention make_module(const std::string& name, const MultiHeadAttentionOptions& options) {
  if (name == "MultiHeadAttention")
    return MultiHeadAttention(options).ptr();
  TORCH_CHECK(name == "MultiHeadAttentionCombinedQKV", "unknown module ", name);
  return MultiHeadAttentionCombinedQKV(options).ptr();
}

const std::vector<std::string> kCachedModules{"MultiHeadAttention",
                                              "MultiHeadAttentionCombinedQKV"};

}  // namespace

TEST(KVCache, PrefillChunkedPrefillAndDecodeEqualTheUncachedForward) {
  // Whole prompt, pieces of every size, one token at a time; 11 tokens against chunked blocks
  // of 3 x 4, so pieces cross block edges.
  const std::vector<std::vector<int64_t>> splits{
      {11}, {4, 1, 1, 5}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}, {3, 8}, {10, 1}};
  for (const auto& name : kCachedModules) {
    for (const auto backend : kBackends) {
      for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
        torch::manual_seed(31);
        auto m = make_module(name, MultiHeadAttentionOptions(6, 12, 16, 0.1, 3)
                                       .qkv_bias(true)
                                       .backend(backend)
                                       .query_block_size(3)
                                       .key_block_size(4));
        m->as_module()->to(dtype);
        m->as_module()->eval();
        const auto x = torch::randn({2, 11, 6}, torch::dtype(dtype));
        auto cache = m->make_kv_cache(2, 0);
        expect_cached_pieces_match_forward(m, x, splits, cache, name + " " + backend_name(backend));
      }
    }
  }
}

TEST(KVCache, StorageIsAllocatedOnceAndItsBytesAreKnown) {
  torch::manual_seed(37);
  MultiHeadAttention mha(MultiHeadAttentionOptions(8, 12, 10, 0.0, 3));
  mha->eval();
  auto cache = mha->make_kv_cache(/*batch=*/2, /*capacity=*/7);
  EXPECT_EQ(cache.capacity(), 7);
  EXPECT_EQ(cache.batch(), 2);
  EXPECT_EQ(cache.num_heads(), 3);
  EXPECT_EQ(cache.head_dim(), 4);
  EXPECT_EQ(cache.nbytes(), 2 * 2 * 3 * 7 * 4 * 4);  // keys and values, float32
  EXPECT_EQ(mha->make_kv_cache(1).capacity(), 10) << "capacity 0 means context_length";
  const auto* storage = cache.keys().data_ptr<float>();
  const auto x = torch::randn({2, 7, 8});
  for (int64_t i = 0; i < 7; ++i) {
    mha->forward_with_cache(x.narrow(1, i, 1), cache);
    EXPECT_EQ(cache.keys().data_ptr<float>(), storage) << "reallocated at step " << i;
  }
  EXPECT_EQ(cache.keys().sizes(), (std::vector<int64_t>{2, 3, 7, 4}));
  // What the cache holds is what the module's key projection gives, split into heads.
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_NEAR(cache.keys(), mha->W_key(x).view({2, 7, 3, 4}).transpose(1, 2), 1e-6);
  cache.reset();
  EXPECT_EQ(cache.size(), 0);
  EXPECT_TENSOR_NEAR(mha->forward_with_cache(x, cache), mha(x), 1e-5);
  EXPECT_EQ(cache.keys().data_ptr<float>(), storage);
}

TEST(KVCache, NeverTakesPartInAutograd) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(4, 4, 8, 0.0, 2));
  mha->eval();
  auto cache = mha->make_kv_cache(1);
  const auto x = torch::randn({1, 3, 4}, torch::requires_grad());
  const auto out = mha->forward_with_cache(x, cache);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_FALSE(cache.keys().requires_grad());
  EXPECT_FALSE(cache.values().requires_grad());
}

TEST(KVCache, RefusalsNameWhatIsWrongAndLeaveTheCacheAsItWas) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(4, 6, 8, 0.0, 2));
  mha->eval();
  auto cache = mha->make_kv_cache(2, 5);
  mha->forward_with_cache(torch::randn({2, 4, 4}), cache);
  const auto held = cache.keys().clone();
  const auto expect_refused = [&](const std::function<void()>& call, const std::string& message) {
    expect_error_containing(call, message);
    EXPECT_EQ(cache.size(), 4) << "a refused call changed the cache";
    EXPECT_TRUE(cache.keys().equal(held));
  };
  expect_refused(
      [&] {
        mha->forward_with_cache(torch::randn({2, 2, 4}), cache);
      },
      "[MultiHeadAttention::forward_with_cache] x: 2 tokens after the 4 the cache "
      "holds would pass its capacity 5; make a larger one with make_kv_cache");
  expect_refused(
      [&] {
        mha->forward_with_cache(torch::randn({3, 1, 4}), cache);
      },
      "cache: expected (batch, num_heads, head_dim) = (3, 2, 3), got (2, 2, 3)");
  expect_refused(
      [&] {
        mha->forward_with_cache(torch::randn({2, 1, 5}), cache);
      },
      "x: expected last dimension d_in = 4, got 5");
  expect_refused(
      [&] {
        mha->forward_with_cache(torch::randn({2, 1, 4}, torch::kFloat64), cache);
      },
      "x: expected dtype Float (the module's parameters), got Double");
  mha->train();
  expect_refused(
      [&] {
        mha->forward_with_cache(torch::randn({2, 1, 4}), cache);
      },
      "[MultiHeadAttention::forward_with_cache] the KV cache is for inference, but "
      "the module is in training mode: call eval() first");
  mha->eval();

  auto full = mha->make_kv_cache(1, 8);
  mha->forward_with_cache(torch::randn({1, 8, 4}), full);
  expect_error_containing(
      [&] {
        mha->forward_with_cache(torch::randn({1, 1, 4}), full);
      },
      "x: 1 tokens after the 8 the cache holds would reach position 9, past "
      "context_length = 8");
  expect_error_containing([&] { mha->make_kv_cache(1, 9); },
                          "[MultiHeadAttention::make_kv_cache] capacity must be in [1, "
                          "context_length = 8] (0: context_length), got 9");
  expect_error_containing([&] { mha->make_kv_cache(0); },
                          "[MultiHeadAttention::make_kv_cache] batch must be >= 1, got 0");

  MultiHeadAttentionCombinedQKV encoder(MultiHeadAttentionOptions(4, 6, 8, 0.0, 2).causal(false));
  encoder->eval();
  auto encoder_cache = encoder->make_kv_cache(1);
  expect_error_containing(
      [&] {
        encoder->forward_with_cache(torch::randn({1, 2, 4}), encoder_cache);
      },
      "[MultiHeadAttentionCombinedQKV::forward_with_cache] needs causal attention");

  KVCache empty;
  expect_error_containing(
      [&] {
        mha->forward_with_cache(torch::randn({1, 1, 4}), empty);
      },
      "the cache has no storage; make one with make_kv_cache");
  expect_error_containing(
      [&] {
        empty.append(torch::zeros({1, 1, 1, 1}), torch::zeros({1, 1, 1, 1}));
      },
      "[KVCache::append] this cache has no storage");
  expect_error_containing([] { KVCache(1, 2, 3, 0); }, "[KVCache] capacity must be >= 1, got 0");
  expect_error_containing([] { KVCache(1, 2, 3, 4, torch::kInt64); },
                          "[KVCache] keys and values need a floating dtype");
  KVCache small(1, 2, 3, 4);
  expect_error_containing(
      [&] {
        small.append(torch::zeros({1, 2, 5, 3}), torch::zeros({1, 2, 5, 3}));
      },
      "[KVCache::append] 5 more positions do not fit: the cache holds 0 of its capacity 4");
  expect_error_containing(
      [&] {
        small.append(torch::zeros({1, 3, 1, 3}), torch::zeros({1, 3, 1, 3}));
      },
      "[KVCache::append] keys: expected (1, 2, n, 3), got [1, 3, 1, 3]");
}

namespace {

// data/golden/kv/ and data/golden/family/kv/: the Python reference classes (the bonus
// material's cache inside the module, kept whole: windows are masked, never rolled) fed the
// same pieces; `expected_cases` is what make_golden.py writes there.
void expect_python_cached_outputs(const std::string& directory, int expected_cases) {
  const std::string dir = std::string(kSourceDir) + "/data/golden/" + directory;
  std::ifstream manifest(dir + "/MANIFEST");
  ASSERT_TRUE(manifest.good()) << dir
                               << "/MANIFEST is missing; regenerate with: python3 "
                                  "scripts/make_golden.py";
  int cases = 0;
  for (std::string name; std::getline(manifest, name);) {
    if (name.empty() || name[0] == '#')
      continue;
    SCOPED_TRACE(name);
    std::ifstream file(dir + "/" + name + ".pt", std::ios::binary);
    ASSERT_TRUE(file.good()) << name << ".pt is missing";
    const std::vector<char> bytes((std::istreambuf_iterator<char>(file)),
                                  std::istreambuf_iterator<char>());
    const auto golden = torch::pickle_load(bytes).toGenericDict();
    const auto meta = golden.at("meta").toGenericDict();
    const auto dtype =
        meta.at("dtype").toStringRef() == "float32" ? torch::kFloat32 : torch::kFloat64;
    auto m =
        make_cached_attention(meta.at("module").toStringRef(), module_config_of(meta.at("config")));
    m->as_module()->to(dtype);
    m->as_module()->eval();
    load_state_dict(*m->as_module(), dir + "/" + name + ".state.pt");
    const auto x = golden.at("input").toTensor();
    const auto split_tensor = golden.at("splits").toTensor();
    const std::vector<int64_t> splits(split_tensor.data_ptr<int64_t>(),
                                      split_tensor.data_ptr<int64_t>() + split_tensor.numel());
    // Same LibTorch kernels as Python: rounding only (the golden tests' 1e-6 / 1e-12).
    const double atol = dtype == torch::kFloat32 ? 1e-6 : 1e-12;
    for (const auto backend : kBackends) {
      m->set_backend(backend);
      auto cache = m->make_kv_cache(x.size(0), /*capacity=*/x.size(1));
      EXPECT_TRUE(tensors_close(name + " " + backend_name(backend),
                                forward_in_pieces(m, x, splits, cache),
                                golden.at("output").toTensor(),
                                backend == AttentionBackend::kMath ? atol : agreement(dtype)));
    }
    ++cases;
  }
  EXPECT_EQ(cases, expected_cases)
      << dir << "/MANIFEST lists another number of cases than make_golden.py writes";
}

}  // namespace

TEST(KVCache, PythonReferenceCachedOutputsMatch) {
  expect_python_cached_outputs("kv", 16);
}

TEST(KVCache, PythonReferenceCachedOutputsMatchForTheAttentionFamily) {
  expect_python_cached_outputs("family/kv", 12);
}

namespace {

train::ModelConfig text_model_config(const std::string& module, const std::string& backend) {
  train::ModelConfig c;
  c.module = module;
  c.backend = backend;
  c.vocab_size = 40;
  c.context_length = 24;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;
  c.ffn = true;
  return c;
}

}  // namespace

namespace {

// A cached attention layer under test, with its label.
struct RaggedModule {
  std::string label;
  CachedAttention layer;
};

// The layer in float64 on `device`, its QK-norm weights (where it has them) away from 1.
RaggedModule prepare_ragged(std::string label, CachedAttention layer, torch::Device device) {
  const auto module = layer->as_module();
  module->to(device, torch::kFloat64);
  module->eval();
  {
    torch::NoGradGuard no_grad;
    for (auto& parameter : module->named_parameters()) {
      if (parameter.key().find("_norm.") != std::string::npos)
        parameter.value().uniform_(0.5, 1.5);  // so QK-norm's weights matter
    }
  }
  return {std::move(label), std::move(layer)};
}

std::vector<RaggedModule> ragged_modules(torch::Device device) {
  torch::manual_seed(11);
  std::vector<RaggedModule> modules;
  for (const bool positional : {false, true}) {
    const auto rope = positional ? c10::optional<RopeOptions>(RopeOptions(32)) : c10::nullopt;
    const std::string with = positional ? " with rope and qk_norm" : "";
    const auto mha = MultiHeadAttentionOptions(6, 8, 24, 0.0, 2).rope(rope).qk_norm(positional);
    modules.push_back(
        prepare_ragged("MultiHeadAttention" + with, MultiHeadAttention(mha).ptr(), device));
    modules.push_back(prepare_ragged("MultiHeadAttentionCombinedQKV" + with,
                                     MultiHeadAttentionCombinedQKV(mha).ptr(), device));
    modules.push_back(prepare_ragged(
        "GroupedQueryAttention" + with,
        GroupedQueryAttention(
            GroupedQueryAttentionOptions(6, 16, 0.0, 4, 2).rope(rope).qk_norm(positional))
            .ptr(),
        device));
    // Rolling caches of window 3: the rows pass it, the prefill of 7 by more than a window.
    modules.push_back(prepare_ragged(
        "MultiHeadAttention window 3" + with,
        MultiHeadAttention(MultiHeadAttentionOptions(mha).sliding_window_size(3)).ptr(), device));
    modules.push_back(
        prepare_ragged("GroupedQueryAttention window 3" + with,
                       GroupedQueryAttention(GroupedQueryAttentionOptions(6, 16, 0.0, 4, 2)
                                                 .rope(rope)
                                                 .qk_norm(positional)
                                                 .sliding_window_size(3))
                           .ptr(),
                       device));
  }
  // Score functions: a softcap with a scale on a rolling cache (Gemma 2's local layers), and
  // a clamped relative bias, which reads each row's positions.
  modules.push_back(
      prepare_ragged("GroupedQueryAttention window 3 softcap scale",
                     GroupedQueryAttention(GroupedQueryAttentionOptions(6, 16, 0.0, 4, 2)
                                               .sliding_window_size(3)
                                               .score_mod(score_mods::softcap(0.5))
                                               .scale(0.3))
                         .ptr(),
                     device));
  modules.push_back(prepare_ragged(
      "MultiHeadAttention relative bias",
      MultiHeadAttention(MultiHeadAttentionOptions(6, 8, 24, 0.0, 2)
                             .score_mod(score_mods::relative_position_bias(torch::randn({2, 5}))))
          .ptr(),
      device));
  GroupedQueryAttention with_sinks(GroupedQueryAttentionOptions(6, 16, 0.0, 4, 2).sinks(true));
  {
    torch::NoGradGuard no_grad;
    with_sinks->sinks.uniform_(-1.0, 1.0);
  }
  modules.push_back(prepare_ragged("GroupedQueryAttention sinks", with_sinks.ptr(), device));
  modules.push_back(prepare_ragged(
      "MultiHeadLatentAttention",
      MultiHeadLatentAttention(MultiHeadLatentAttentionOptions(6, 8, 0.0, 2).latent_dim(3)).ptr(),
      device));
  return modules;
}

}  // namespace

// Three sequences decoded together: prefill of prompts of lengths 5, 2 and 7, a second
// chunk of 2, 3 and 0 tokens, then three decode steps. Every valid output of each row equals
// that row's own forward over its whole sequence; the padding holds random values. On each
// device (CUDA where there is one).
class RaggedKVCacheDevices : public attnkit::testing::DeviceTest {};

TEST_P(RaggedKVCacheDevices, EachRowEqualsThatRowAloneThroughPrefillChunksAndDecode) {
  // {4, 1, 0} is mostly padding (5 of 12 tokens), like a refill step of generation: the
  // projections run on the valid tokens alone (detail::project).
  const std::vector<std::vector<int64_t>> steps{{5, 2, 7}, {2, 3, 0}, {1, 1, 1},
                                                {4, 1, 0}, {1, 1, 1}, {1, 1, 1}};
  std::vector<int64_t> totals(3, 0);
  for (const auto& step : steps)
    for (int64_t r = 0; r < 3; ++r)
      totals[r] += step[r];
  torch::manual_seed(12);
  std::vector<torch::Tensor> sequences;  // row r's tokens, (1, totals[r], 6)
  for (int64_t r = 0; r < 3; ++r)
    sequences.push_back(torch::randn({1, totals[r], 6}, torch::kFloat64).to(device()));
  for (auto& attention : ragged_modules(device())) {
    std::vector<torch::Tensor> alone;
    for (const auto& sequence : sequences)
      alone.push_back(attention.layer->forward(sequence));
    for (const auto backend : kBackends) {
      attention.layer->set_backend(backend);
      const auto label = attention.label + " " + backend_name(backend);
      auto cache = attention.layer->make_kv_cache(3, /*capacity=*/24);
      std::vector<int64_t> done(3, 0);
      for (size_t s = 0; s < steps.size(); ++s) {
        const auto& step = steps[s];
        const int64_t n = *std::max_element(step.begin(), step.end());
        auto x = torch::randn({3, n, 6}, torch::kFloat64).to(device());  // padding: random
        for (int64_t r = 0; r < 3; ++r)
          x[r].narrow(0, 0, step[r]).copy_(sequences[r][0].narrow(0, done[r], step[r]));
        const auto out =
            attention.layer->forward_with_cache(x, cache, torch::tensor(step, torch::kInt64));
        ASSERT_EQ(out.size(1), n) << label;
        EXPECT_EQ(out.device().type(), device().type()) << label;
        EXPECT_TRUE(torch::isfinite(out).all().item<bool>()) << label;
        for (int64_t r = 0; r < 3; ++r) {
          EXPECT_TRUE(tensors_close(c10::str(label, " step ", s, " row ", r),
                                    out[r].narrow(0, 0, step[r]),
                                    alone[r][0].narrow(0, done[r], step[r]), 1e-10));
          done[r] += step[r];
        }
        EXPECT_TRUE(torch::equal(cache.lengths(), torch::tensor(done, torch::kInt64))) << label;
      }
    }
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(RaggedKVCacheDevices);

TEST(RaggedKVCache, BadLengthsAreNamedAndNothingIsWritten) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(6, 8, 10, 0.0, 2));
  mha->eval();
  auto cache = mha->make_kv_cache(2, 8);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 4, 6});
  mha->forward_with_cache(x, cache, torch::tensor({4, 1}, torch::kInt64));
  const auto before = cache.keys().clone();
  const auto refused = [&](const torch::Tensor& input, const torch::Tensor& lengths,
                           const std::string& message) {
    expect_error_containing([&] { mha->forward_with_cache(input, cache, lengths); }, message);
    EXPECT_TRUE(torch::equal(cache.lengths(), torch::tensor({4, 1}, torch::kInt64))) << message;
    EXPECT_TRUE(torch::equal(cache.keys(), before)) << message;
  };
  refused(x, torch::tensor({1.0, 2.0}),
          "[MultiHeadAttention::forward_with_cache] lengths must be a (2) int64 tensor (each "
          "row's valid new tokens), got [2] Float");
  refused(x, torch::tensor({1, 2, 3}, torch::kInt64), "lengths must be a (2) int64 tensor");
  refused(x, torch::tensor({1, 5}, torch::kInt64),
          "lengths[1] must be in [0, 4] (x's tokens), got 5");
  refused(x, torch::tensor({-1, 0}, torch::kInt64), "lengths[0] must be in [0, 4]");
  refused(torch::randn({2, 6, 6}), torch::tensor({5, 6}, torch::kInt64),
          "row 0: 5 tokens would reach position 9, past the cache's capacity 8");
  refused(torch::randn({2, 10, 6}), torch::tensor({0, 10}, torch::kInt64),
          "row 1: 10 tokens would reach position 11, past context_length = 10");
  expect_error_containing([&] { mha->forward_with_cache(x, cache); },
                          "[KVCache::append] the rows hold different numbers of positions");
  // A mask that does not fit the positions the step reads ([0, 4)) is refused before
  // anything is written, on a rolling cache too.
  MultiHeadAttention windowed(MultiHeadAttentionOptions(6, 8, 10, 0.0, 2).sliding_window_size(3));
  windowed->eval();
  auto rolling = windowed->make_kv_cache(2);
  expect_error_containing(
      [&] {
        windowed->forward_with_cache(x, rolling, torch::tensor({4, 1}, torch::kInt64),
                                     Mask::documents(torch::zeros({2, 3}, torch::kInt64)));
      },
      "[MultiHeadAttention::forward_with_cache]");
  EXPECT_EQ(rolling.size(), 0);
  MultiHeadLatentAttention latent(MultiHeadLatentAttentionOptions(6, 8, 0.0, 2));
  latent->eval();
  auto latents = latent->make_kv_cache(2, 5);
  latent->forward_with_cache(x, latents, torch::tensor({3, 2}, torch::kInt64));
  expect_error_containing(
      [&] {
        latent->forward_with_cache(x, latents, torch::tensor({3, 1}, torch::kInt64));
      },
      "[MultiHeadLatentAttention::forward_with_cache] row 0: 3 tokens would reach position 6, "
      "past the cache's capacity 5");
  expect_error_containing(
      [&] {
        latent->forward_with_cache(x, latents, torch::tensor({1.0, 1.0}));
      },
      "[MultiHeadLatentAttention::forward_with_cache] lengths must be a (2) int64 tensor");
  EXPECT_TRUE(torch::equal(latents.lengths(), torch::tensor({3, 2}, torch::kInt64)));
}

TEST(Generate, GreedyTokensAreTheSameWithAndWithoutTheCache) {
  for (const std::string module : {"mha", "mha-combined"}) {
    for (const std::string backend : {"math", "fused", "chunked"}) {
      SCOPED_TRACE(module + " " + backend);
      torch::manual_seed(41);
      train::AttentionModel model(text_model_config(module, backend));
      model->eval();
      const auto prompt = torch::randint(0, 40, {3, 5}, torch::kInt64);
      // 5 + 19 = the whole context of 24.
      const auto cached = generate(*model, prompt, GenerateOptions(19));
      const auto uncached = generate(*model, prompt, GenerateOptions(19).use_kv_cache(false));
      EXPECT_EQ(cached.sizes(), (std::vector<int64_t>{3, 24}));
      EXPECT_TRUE(cached.narrow(1, 0, 5).equal(prompt));
      EXPECT_TRUE(cached.equal(uncached)) << "cached\n" << cached << "\nuncached\n" << uncached;
      // An untrained model still picks several tokens, so equality is not trivial.
      const auto generated = cached.narrow(1, 5, 19).contiguous();
      const std::set<int64_t> distinct(generated.data_ptr<int64_t>(),
                                       generated.data_ptr<int64_t>() + generated.numel());
      EXPECT_GT(distinct.size(), 2u);
    }
  }
}

TEST(PackedDocuments, EachDocumentOfAPackedRowIsComputedAsIfAlone) {
  // attnkit-train --pack: document ids give Mask::documents and positions that restart at
  // each document, so a packed row's logits are those of its documents run one by one.
  const std::vector<std::vector<int64_t>> lengths{{5, 7, 4}, {9, 7}};  // two rows of 16
  for (const std::string module : {"mha", "mha-combined", "gqa", "mqa", "mla"}) {
    for (const std::string backend : {"math", "fused", "chunked"}) {
      SCOPED_TRACE(module + " " + backend);
      torch::manual_seed(47);
      train::AttentionModel model(text_model_config(module, backend));
      model->eval();
      const auto tokens = torch::randint(0, 40, {2, 16}, torch::kInt64);
      auto ids = torch::empty({2, 16}, torch::kInt64);
      for (size_t row = 0; row < lengths.size(); ++row) {
        int64_t start = 0;
        for (size_t d = 0; d < lengths[row].size(); ++d) {
          ids[row].narrow(0, start, lengths[row][d]).fill_(static_cast<int64_t>(d));
          start += lengths[row][d];
        }
      }
      const auto packed = model->forward(tokens, ids);  // (2, 16, vocab)
      for (size_t row = 0; row < lengths.size(); ++row) {
        int64_t start = 0;
        for (const auto length : lengths[row]) {
          const auto alone = model->forward(tokens[row].narrow(0, start, length).unsqueeze(0));
          EXPECT_TRUE(tensors_close("row " + std::to_string(row) + " at " + std::to_string(start),
                                    packed[row].narrow(0, start, length), alone[0], 1e-5));
          start += length;
        }
      }
      // Without the ids, documents see each other: the check above can fail.
      EXPECT_FALSE(torch::allclose(model->forward(tokens)[0].narrow(0, 5, 7),
                                   packed[0].narrow(0, 5, 7), 1e-3, 1e-3));
    }
  }
}

TEST(Generate, SamplingIsSeededAndTopKOneIsGreedy) {
  torch::manual_seed(43);
  train::AttentionModel model(text_model_config("mha", "fused"));
  model->eval();
  const auto prompt = torch::randint(0, 40, {2, 4}, torch::kInt64);
  const auto sampled = [&](uint64_t seed, bool cache) {
    return generate(*model, prompt,
                    GenerateOptions(12).temperature(1.5).top_k(10).seed(seed).use_kv_cache(cache));
  };
  EXPECT_TRUE(sampled(7, true).equal(sampled(7, true)));
  EXPECT_FALSE(sampled(7, true).equal(sampled(8, true)));
  EXPECT_TRUE(sampled(7, true).equal(sampled(7, false)));
  EXPECT_TRUE(generate(*model, prompt, GenerateOptions(12).temperature(1.0).top_k(1))
                  .equal(generate(*model, prompt, GenerateOptions(12))));
}

TEST(Generate, PastTheContextTheCacheIsRefilled) {
  torch::manual_seed(47);
  train::AttentionModel model(text_model_config("mha", "fused"));
  model->eval();
  // A prompt longer than the context and 60 new tokens: the uncached path crops, the cached
  // one prefills the last 24 tokens and refills from the last 12 whenever full.
  const auto prompt = torch::randint(0, 40, {1, 30}, torch::kInt64);
  const auto cached = generate(*model, prompt, GenerateOptions(60));
  const auto uncached = generate(*model, prompt, GenerateOptions(60).use_kv_cache(false));
  EXPECT_EQ(cached.size(1), 90);
  EXPECT_EQ(uncached.size(1), 90);
  EXPECT_TRUE(cached.narrow(1, 0, 30).equal(prompt));
  // Until the first refill both see the same context.
  EXPECT_TRUE(cached.narrow(1, 30, 1).equal(uncached.narrow(1, 30, 1)));
}

namespace {

// Forwards to a model and records the batch of every cached call, to see finished rows leave,
// and the shape of every paged call; a paged call on `failing_sequence` throws once the model
// has written its pages.
class RecordingModel : public CausalLanguageModel {
 public:
  explicit RecordingModel(train::AttentionModel model) : model_(std::move(model)) {}
  torch::Tensor logits(const torch::Tensor& tokens) override { return model_->logits(tokens); }
  torch::Tensor logits_with_cache(const torch::Tensor& tokens,
                                  std::vector<KVCache>& caches) override {
    batches.push_back(tokens.size(0));
    return model_->logits_with_cache(tokens, caches);
  }
  torch::Tensor ragged_logits_with_cache(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                         std::vector<KVCache>& caches) override {
    batches.push_back(tokens.size(0));
    return model_->ragged_logits_with_cache(tokens, lengths, caches);
  }
  std::vector<KVCache> make_kv_caches(int64_t batch, int64_t capacity) override {
    return model_->make_kv_caches(batch, capacity);
  }
  std::vector<PagedKVCache> make_paged_kv_caches(int64_t num_pages, int64_t page_size) override {
    return model_->make_paged_kv_caches(num_pages, page_size);
  }
  torch::Tensor paged_logits(const torch::Tensor& tokens, std::vector<PagedKVCache>& pools,
                             const std::vector<int64_t>& sequences) override {
    paged_calls.emplace_back(tokens.size(0), tokens.size(1));
    auto logits = model_->paged_logits(tokens, pools, sequences);
    if (std::find(sequences.begin(), sequences.end(), failing_sequence) != sequences.end())
      TORCH_CHECK(false, "the test's failing sequence");
    return logits;
  }
  int64_t context_length() const override { return model_->context_length(); }

  std::vector<int64_t> batches;
  std::vector<std::pair<int64_t, int64_t>> paged_calls;  // (rows, tokens per row) of each call
  int64_t failing_sequence = -1;

 private:
  train::AttentionModel model_;
};

// `prompt` (n) continued alone by `max_new` greedy tokens, cut after the first `stop`.
torch::Tensor generated_alone(train::AttentionModel& model, const torch::Tensor& prompt,
                              int64_t max_new, int64_t stop = -1) {
  const auto alone = generate(*model, prompt.view({1, -1}), GenerateOptions(max_new))[0];
  for (int64_t i = prompt.size(0); i < alone.size(0); ++i)
    if (alone[i].item<int64_t>() == stop)
      return alone.narrow(0, 0, i + 1);
  return alone;
}

}  // namespace

// Prompts of 4, 1, 7 and 3 tokens decoded together: row 2 has its own limit (5), row 3 stops
// at a token it produces on its way, row 1 at GenerateOptions::stop_tokens. Each row equals
// its prompt generated alone (greedy), and the batch shrinks as rows finish.
TEST(RaggedGenerate, EachPromptGetsTheTokensItGetsAloneWithLimitsAndStops) {
  for (const std::string module : {"mha", "mha-combined", "gqa"}) {
    for (const std::string backend : {"math", "fused", "chunked"}) {
      SCOPED_TRACE(module + " " + backend);
      torch::manual_seed(43);
      train::AttentionModel model(text_model_config(module, backend));
      model->eval();
      std::vector<torch::Tensor> prompts;
      for (const int64_t n : {4, 1, 7, 3})
        prompts.push_back(torch::randint(0, 40, {n}, torch::kInt64));
      const auto free_row_3 = generated_alone(model, prompts[3], 12);
      const auto free_row_1 = generated_alone(model, prompts[1], 12);
      const int64_t stop_3 = free_row_3[3 + 4].item<int64_t>();  // its 5th new token
      const int64_t stop_1 = free_row_1[1 + 8].item<int64_t>();  // its 9th
      const std::vector<torch::Tensor> expected{
          generated_alone(model, prompts[0], 12, stop_1),
          generated_alone(model, prompts[1], 12, stop_1),
          generated_alone(model, prompts[2], 5, stop_1),
          generated_alone(model, prompts[3], 12, stop_3) /* stop_1 too, below */};
      RecordingModel recording(model);
      const auto rows =
          generate(recording,
                   {prompts[0], prompts[1], GenerationRequest(prompts[2]).max_new_tokens(5),
                    GenerationRequest(prompts[3]).stop_tokens({stop_3})},
                   GenerateOptions(12).stop_tokens({stop_1}));
      ASSERT_EQ(rows.size(), 4u);
      for (size_t r = 0; r < 4; ++r) {
        auto want = expected[r];
        if (r == 3) {  // the shared stop token ends row 3 too
          const auto shared = generated_alone(model, prompts[3], 12, stop_1);
          if (shared.size(0) < want.size(0))
            want = shared;
        }
        EXPECT_TRUE(rows[r].equal(want))
            << "row " << r << "\nbatched " << rows[r] << "\nalone " << want;
      }
      EXPECT_LE(rows[2].size(0), 7 + 5);
      EXPECT_EQ(recording.batches.front(), 4);  // the prefill
      EXPECT_LT(recording.batches.back(), 4) << "finished rows stayed in the batch";
      EXPECT_TRUE(std::is_sorted(recording.batches.rbegin(), recording.batches.rend()));
    }
  }
}

// The rolling caches (sliding window) and the latent one: prompts of one length (the uniform
// path) and of different lengths (ragged), rows leaving at different steps, one row running
// past the context of 24 (its caches refill while the others go on).
TEST(RaggedGenerate, RollingAndLatentCachesGiveEachPromptItsTokensAlone) {
  for (const std::string module : {"gqa", "mla", "mha"}) {
    for (const bool one_length : {true, false}) {
      SCOPED_TRACE(module + (one_length ? " one length" : " different lengths"));
      auto config = text_model_config(module, "chunked");
      if (module != "mla")
        config.window = 5;
      torch::manual_seed(44);
      train::AttentionModel model(config);
      model->eval();
      const std::vector<int64_t> lengths =
          one_length ? std::vector<int64_t>{4, 4, 4} : std::vector<int64_t>{4, 9, 1};
      std::vector<GenerationRequest> requests;
      for (const int64_t n : lengths)
        requests.emplace_back(torch::randint(0, 40, {n}, torch::kInt64));
      requests[0].max_new_tokens(3);
      requests[2].max_new_tokens(30);
      const auto rows = generate(*model, requests, GenerateOptions(6));
      for (size_t r = 0; r < 3; ++r) {
        const int64_t max_new = requests[r].max_new_tokens().value_or(6);
        EXPECT_EQ(rows[r].size(0), lengths[r] + max_new);
        EXPECT_TRUE(rows[r].equal(generated_alone(model, requests[r].prompt(), max_new)))
            << "row " << r;
      }
    }
  }
}

// Past the context (24) each row refills its caches when it reaches it, as it does alone: a
// prompt longer than the context, one that runs past it, and one that stays inside.
TEST(RaggedGenerate, RowsPastTheContextRefillAsEachPromptAlone) {
  for (const std::string module : {"mha", "gqa"}) {
    SCOPED_TRACE(module);
    torch::manual_seed(45);
    train::AttentionModel model(text_model_config(module, "chunked"));
    model->eval();
    const std::vector<std::pair<int64_t, int64_t>> shapes{{30, 9}, {5, 40}, {2, 8}, {5, 31}};
    std::vector<GenerationRequest> requests;
    for (const auto& [n, max_new] : shapes)
      requests.push_back(
          GenerationRequest(torch::randint(0, 40, {n}, torch::kInt64)).max_new_tokens(max_new));
    const auto rows = generate(*model, requests, GenerateOptions(0));
    for (size_t r = 0; r < shapes.size(); ++r) {
      const auto alone = generated_alone(model, requests[r].prompt(), shapes[r].second);
      EXPECT_EQ(rows[r].size(0), shapes[r].first + shapes[r].second);
      EXPECT_TRUE(rows[r].equal(alone))
          << "row " << r << "\nbatched " << rows[r] << "\nalone " << alone;
    }
  }
}

// The model's ragged step (attention, feed-forward and head), also where padding is most of
// the batch and only the valid tokens are multiplied: each row's logits equal the training
// forward of that row's tokens so far.
TEST(RaggedGenerate, MostlyPaddedStepsGiveEachRowItsOwnLogits) {
  torch::manual_seed(47);
  train::AttentionModel model(text_model_config("mha", "fused"));
  model->eval();
  model->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  const std::vector<std::vector<int64_t>> steps{{3, 2, 4}, {6, 1, 1}, {1, 5, 0}};
  std::vector<torch::Tensor> sequences;  // each row's tokens, (1, total)
  for (int64_t total : {10, 8, 5})
    sequences.push_back(torch::randint(0, 40, {1, total}, torch::kInt64));
  auto caches = model->make_kv_caches(3, 24);
  std::vector<int64_t> done(3, 0);
  for (size_t s = 0; s < steps.size(); ++s) {
    const int64_t n = *std::max_element(steps[s].begin(), steps[s].end());
    auto tokens = torch::zeros({3, n}, torch::kInt64);  // right-padded with token 0
    for (int64_t r = 0; r < 3; ++r)
      tokens[r].narrow(0, 0, steps[s][r]).copy_(sequences[r][0].narrow(0, done[r], steps[s][r]));
    const auto logits =
        model->ragged_logits_with_cache(tokens, torch::tensor(steps[s], torch::kInt64), caches);
    for (int64_t r = 0; r < 3; ++r) {
      const int64_t end = done[r] + steps[s][r];
      const auto alone =
          model->logits(sequences[r].narrow(1, 0, end))[0].narrow(0, done[r], steps[s][r]);
      EXPECT_TRUE(tensors_close(c10::str("step ", s, " row ", r),
                                logits[r].narrow(0, 0, steps[s][r]), alone, 1e-10));
      done[r] = end;
    }
  }
}

// attnkit-train's --rope --qk-norm model: no position table; cached, uncached and batched
// greedy decoding agree.
TEST(RaggedGenerate, RopeAndQkNormModelsDecodeAlikeEveryWay) {
  for (const std::string module : {"mha", "mha-combined", "gqa"}) {
    SCOPED_TRACE(module);
    auto config = text_model_config(module, "chunked");
    config.rope = true;
    config.qk_norm = true;
    torch::manual_seed(46);
    train::AttentionModel model(config);
    model->eval();
    EXPECT_FALSE(model->named_parameters().contains("position_embedding.weight"));
    EXPECT_TRUE(model->named_parameters().contains("blocks.0.attention.q_norm.weight"));
    const auto prompt = torch::randint(0, 40, {2, 5}, torch::kInt64);
    const auto cached = generate(*model, prompt, GenerateOptions(15));
    EXPECT_TRUE(cached.equal(generate(*model, prompt, GenerateOptions(15).use_kv_cache(false))));
    const auto rows = generate(*model, {prompt[0], prompt[1].narrow(0, 0, 2)}, GenerateOptions(15));
    EXPECT_TRUE(rows[0].equal(cached[0]));
    EXPECT_TRUE(rows[1].equal(generated_alone(model, prompt[1].narrow(0, 0, 2), 15)));
    // Past the context of 24 the rows refill at different steps, a refill of 12 tokens
    // padding the other row's one token past the RoPE tables.
    const auto long_rows =
        generate(*model, {prompt[0], prompt[1].narrow(0, 0, 2)}, GenerateOptions(40));
    EXPECT_TRUE(long_rows[0].equal(generated_alone(model, prompt[0], 40)));
    EXPECT_TRUE(long_rows[1].equal(generated_alone(model, prompt[1].narrow(0, 0, 2), 40)));
  }
}

TEST(RaggedGenerate, BadRequestsAreNamed) {
  train::AttentionModel model(text_model_config("mha", "math"));
  model->eval();
  const auto prompt = torch::zeros({3}, torch::kInt64);
  const GenerateOptions options(2);
  expect_error_containing([&] { generate(*model, std::vector<GenerationRequest>{}, options); },
                          "[generate] requests: expected at least one prompt, got none");
  expect_error_containing(
      [&] {
        generate(*model, {prompt, prompt.view({1, 3})}, options);
      },
      "[generate] requests[1].prompt: expected (n) int64 token ids with n >= 1, got [1, 3] Long");
  expect_error_containing(
      [&] { generate(*model, std::vector<GenerationRequest>{prompt.to(torch::kFloat)}, options); },
      "[generate] requests[0].prompt: expected (n) int64 token ids");
  expect_error_containing(
      [&] {
        generate(*model, {prompt, GenerationRequest(prompt).max_new_tokens(-3)}, options);
      },
      "[generate] requests[1].max_new_tokens must be >= 0, got -3");
  expect_error_containing(
      [&] {
        generate(*model, std::vector<GenerationRequest>{prompt},
                 GenerateOptions(2).use_kv_cache(false));
      },
      "use_kv_cache must be true");
  expect_error_containing(
      [&] {
        generate(*model, prompt.view({1, 3}), GenerateOptions(2).stop_tokens({1}));
      },
      "[generate] stop_tokens: rows that stop early do not fit one (b, n) tensor");
  expect_error_containing(
      [&] {
        generate(*model, std::vector<GenerationRequest>{prompt}, GenerateOptions(2).top_k(-1));
      },
      "[generate] top_k must be >= 0");
  // A model that does not implement ragged_logits_with_cache says so.
  struct Plain : CausalLanguageModel {
    explicit Plain(train::AttentionModel m) : model(std::move(m)) {}
    torch::Tensor logits(const torch::Tensor& t) override { return model->logits(t); }
    torch::Tensor logits_with_cache(const torch::Tensor& t, std::vector<KVCache>& c) override {
      return model->logits_with_cache(t, c);
    }
    std::vector<KVCache> make_kv_caches(int64_t b, int64_t n) override {
      return model->make_kv_caches(b, n);
    }
    int64_t context_length() const override { return model->context_length(); }
    train::AttentionModel model;
  } plain(model);
  expect_error_containing(
      [&] {
        generate(plain, {prompt, prompt.narrow(0, 0, 2)}, options);
      },
      "need the model's ragged_logits_with_cache(tokens, lengths, caches)");
  EXPECT_EQ(generate(plain, {prompt, prompt}, options)[1].size(0), 5);
  // KVCache::keep_rows
  KVCache cache(3, 1, 2, 4);
  expect_error_containing(
      [&] {
        cache.keep_rows({0, 3});
      },
      "[KVCache::keep_rows] rows[1] must be in [0, 3), got 3");
  expect_error_containing(
      [&] {
        cache.keep_rows({2, 1});
      },
      "[KVCache::keep_rows] rows must be distinct and ascending, got 2 before 1");
  EXPECT_EQ(cache.batch(), 3) << "a refused call changed the cache";
  // Rows of 1, 3 and 2 positions; keeping rows 1 and 2 moves them (keys and lengths) up.
  const auto keys = torch::randn({3, 1, 3, 2}), values = torch::randn({3, 1, 3, 2});
  cache.append_ragged(keys, values, {1, 3, 2});
  const auto storage = cache.keys().data_ptr();
  cache.keep_rows({1, 2});
  EXPECT_EQ(cache.batch(), 2);
  EXPECT_EQ(cache.keys().data_ptr(), storage) << "keep_rows allocated";
  EXPECT_TRUE(cache.lengths().equal(torch::tensor({3, 2}, torch::kInt64)));
  EXPECT_TRUE(cache.keys()[0].narrow(1, 0, 3).equal(keys[1]));
  EXPECT_TRUE(cache.values()[1].narrow(1, 0, 2).equal(values[2].narrow(1, 0, 2)));
  cache.keep_rows({1});
  EXPECT_FALSE(cache.is_ragged());
  EXPECT_EQ(cache.size(), 2);
  // KVCache::reset_rows: some rows start over (the cache turns ragged), or all (reset()).
  KVCache three(3, 1, 2, 4);
  three.append(torch::randn({3, 1, 2, 2}), torch::randn({3, 1, 2, 2}));
  expect_error_containing(
      [&] {
        three.reset_rows({0, 5});
      },
      "[KVCache::reset_rows] rows[1] must be in [0, 3), got 5");
  three.reset_rows({1});
  EXPECT_TRUE(three.lengths().equal(torch::tensor({2, 0, 2}, torch::kInt64)));
  three.reset_rows({0, 1, 2});
  EXPECT_FALSE(three.is_ragged());
  EXPECT_EQ(three.size(), 0);
}

// A rolling cache (window 3) with rows of different lengths: each row's span is its own held
// keys, oldest first, then its new ones, and it keeps each row's last 3 positions.
TEST(RaggedKVCache, RollingCacheGivesEachRowItsLastWindowInOrder) {
  auto rolling = KVCache::sliding_window(2, 1, 2, 3, torch::kFloat64);
  const auto first = torch::randn({2, 1, 1, 2}, torch::kFloat64);
  rolling.append(first, first);
  rolling.reset_rows({0});  // row 0 starts over; row 1 keeps its position 0
  EXPECT_TRUE(rolling.lengths().equal(torch::tensor({0, 1}, torch::kInt64)));
  const auto next = torch::randn({2, 1, 4, 2}, torch::kFloat64);
  auto span = rolling.append_ragged(next, next * 2, {4, 1});
  EXPECT_TRUE(span.starts.equal(torch::tensor({0, 1}, torch::kInt64)));
  EXPECT_TRUE(span.ends.equal(torch::tensor({4, 2}, torch::kInt64)));
  EXPECT_TRUE(span.keys[0].narrow(1, 0, 4).equal(next[0]));  // 4 new keys, past the window
  EXPECT_TRUE(span.values[0].narrow(1, 0, 4).equal(next[0] * 2));
  EXPECT_TRUE(span.keys[1].narrow(1, 0, 1).equal(first[1]));  // held, then new
  EXPECT_TRUE(span.keys[1].narrow(1, 1, 1).equal(next[1].narrow(1, 0, 1)));
  EXPECT_TRUE(rolling.lengths().equal(torch::tensor({4, 2}, torch::kInt64)));
  // One token each: row 0 holds positions 1-3 (the storage has wrapped), row 1 positions 0-1.
  const auto step = torch::randn({2, 1, 1, 2}, torch::kFloat64);
  span = rolling.append_ragged(step, step, {1, 1});
  EXPECT_TRUE(span.starts.equal(torch::tensor({3, 2}, torch::kInt64)));
  EXPECT_TRUE(span.keys[0].narrow(1, 0, 3).equal(next[0].narrow(1, 1, 3)));
  EXPECT_TRUE(span.keys[0].narrow(1, 3, 1).equal(step[0]));
  EXPECT_TRUE(
      span.keys[1].narrow(1, 0, 2).equal(torch::cat({first[1], next[1].narrow(1, 0, 1)}, 1)));
  EXPECT_TRUE(span.keys[1].narrow(1, 2, 1).equal(step[1]));
  EXPECT_EQ(rolling.nbytes(), 2 * 2 * 1 * 3 * 2 * 8) << "the storage stays the window";
}

// Masks and score functions in cached steps read positions in the sequence, as in training,
// on every cache kind: a key/value cache, a rolling one (whose keys lie in storage order) and
// a latent one, in uniform steps (a prefill of 5 past the window of 3, a chunk, one-token
// steps) and ragged ones (the rows chunked differently). Packed documents and a mask_mod that
// leaves some queries no key (zeros, as in training); ALiBi and a random relative bias inside
// the window. Each row's outputs against the training forward over its whole sequence with the
// same mask (float64, 1e-10).
TEST(CachedMasks, MasksAndScoresReadTheSequencesPositionsOnEveryCacheKind) {
  torch::manual_seed(61);
  torch::NoGradGuard no_grad;
  // Each over the positions [0, end) a step reads.
  auto masks = masks_over_two_sequences();
  masks.insert(masks.begin(), {"no mask", [](int64_t) { return Mask(); }});
  const auto rope = RopeOptions(16);
  const auto alibi = score_mods::alibi(score_mods::alibi_slopes(4));
  const auto relative = score_mods::relative_position_bias(torch::randn({4, 5}, torch::kDouble));
  const std::vector<std::pair<std::string, std::function<std::shared_ptr<CachedAttentionLayer>()>>>
      layers{
          {"mha",
           [&] {
             return MultiHeadAttention(
                        MultiHeadAttentionOptions(16, 16, 16, 0.0, 4).rope(rope).score_mod(alibi))
                 .ptr();
           }},
          {"mha, window 3",
           [&] {
             return MultiHeadAttention(MultiHeadAttentionOptions(16, 16, 16, 0.0, 4)
                                           .rope(rope)
                                           .sliding_window_size(3))
                 .ptr();
           }},
          {"gqa, window 3, alibi",
           [&] {
             return GroupedQueryAttention(GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2)
                                              .sliding_window_size(3)
                                              .score_mod(alibi))
                 .ptr();
           }},
          {"gqa, window 3, relative bias",
           [&] {
             return GroupedQueryAttention(GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2)
                                              .rope(rope)
                                              .sliding_window_size(3)
                                              .score_mod(relative))
                 .ptr();
           }},
          {"mla", [&] {
             return MultiHeadLatentAttention(
                        MultiHeadLatentAttentionOptions(16, 16, 0.0, 4).latent_dim(8))
                 .ptr();
           }}};
  for (const auto& [layer_label, make_layer] : layers) {
    for (const auto& [mask_label, mask_at] : masks) {
      SCOPED_TRACE(c10::str(layer_label, ", ", mask_label));
      const auto layer = make_layer();
      layer->as_module()->to(torch::kDouble);
      layer->as_module()->eval();
      const auto sequence = torch::randn({2, 12, 16}, torch::kDouble);
      const auto whole = layer->forward(sequence, {}, {}, mask_at(12));  // (2, 12, 16)
      auto cache = layer->make_kv_cache(2, 16);
      int64_t position = 0;
      for (const int64_t n : {5, 2, 1, 1, 1, 1, 1}) {
        EXPECT_TENSOR_NEAR(layer->forward_with_cache(sequence.narrow(1, position, n), cache,
                                                     mask_at(position + n)),
                           whole.narrow(1, position, n), 1e-10)
            << "uniform step at " << position;
        position += n;
      }
      // Ragged: row 0 in chunks of 7, 1, 1, 1, 1, 1; row 1 of 4, 3, 1, 1, 1, 1, 1.
      auto ragged = layer->make_kv_cache(2, 16);
      const std::vector<std::array<int64_t, 2>> chunks{{7, 4}, {1, 3}, {1, 1}, {1, 1},
                                                       {1, 1}, {1, 1}, {0, 1}};
      std::array<int64_t, 2> at{0, 0};
      for (const auto& chunk : chunks) {
        const int64_t n = std::max(chunk[0], chunk[1]);
        auto x = torch::zeros({2, n, 16}, torch::kDouble);
        for (int64_t r = 0; r < 2; ++r)
          x[r].narrow(0, 0, chunk[r]).copy_(sequence[r].narrow(0, at[r], chunk[r]));
        const int64_t end = std::max(at[0] + chunk[0], at[1] + chunk[1]);
        const auto out = layer->forward_with_cache(
            x, ragged, torch::tensor({chunk[0], chunk[1]}, torch::kInt64), mask_at(end));
        for (int64_t r = 0; r < 2; ++r) {
          EXPECT_TENSOR_NEAR(out[r].narrow(0, 0, chunk[r]), whole[r].narrow(0, at[r], chunk[r]),
                             1e-10)
              << "ragged row " << r << " at " << at[r];
          at[r] += chunk[r];
        }
      }
    }
  }
}

TEST(Generate, BadArgumentsNameWhatIsWrong) {
  train::AttentionModel model(text_model_config("mha", "math"));
  model->eval();
  const auto prompt = torch::zeros({1, 3}, torch::kInt64);
  expect_error_containing([&] { generate(*model, prompt.to(torch::kFloat), GenerateOptions(1)); },
                          "[generate] prompt: expected (batch, num_tokens) int64 token ids, got "
                          "[1, 3] Float");
  expect_error_containing([&] { generate(*model, prompt.view({3}), GenerateOptions(1)); },
                          "[generate] prompt: expected (batch, num_tokens) int64 token ids");
  // {prompt} picks this overload too: the message says what to write instead.
  expect_error_containing([&] { generate(*model, {prompt.view({3})}, GenerateOptions(1)); },
                          "; one prompt of (n) tokens: prompt.unsqueeze(0), or several of "
                          "different lengths: a std::vector<GenerationRequest>");
  expect_error_containing([&] { generate(*model, prompt, GenerateOptions(-1)); },
                          "[generate] max_new_tokens must be >= 0, got -1");
  expect_error_containing([&] { generate(*model, prompt, GenerateOptions(1).temperature(-1)); },
                          "[generate] temperature must be >= 0 (0: greedy), got -1");
  expect_error_containing([&] { generate(*model, prompt, GenerateOptions(1).top_k(-2)); },
                          "[generate] top_k must be >= 0 (0: all tokens), got -2");
  model->train();
  expect_error_containing([&] { generate(*model, prompt, GenerateOptions(1)); },
                          "the KV cache is for inference, but the module is in training mode");
  train::AttentionModel causal(text_model_config("causal", ""));
  causal->eval();
  expect_error_containing(
      [&] { generate(*causal, prompt, GenerateOptions(1)); },
      "--module causal has no KV cache (mha, mha-combined, gqa, mqa and mla have one)");
  EXPECT_EQ(generate(*causal, prompt, GenerateOptions(2).use_kv_cache(false)).size(1), 5);
}

// The fused decode step's kernel against the math definition: every head layout (MHA, GQA,
// MQA), strided keys as a cache holds them, a range of keys per row (a window's start, a
// ragged row's end, a row that sees none), head widths whole and partial AVX registers,
// key ranges of whole and partial blocks of 8 keys, and both dtypes.
TEST(DecodeAttention, EqualsTheMathDefinitionForEveryHeadLayoutAndRowRange) {
  torch::manual_seed(7);
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    const double tolerance = dtype == torch::kFloat ? 1e-5 : 1e-10;
    // Widths of 16 and more with values of 64 or 128 take the AVX-512 group paths
    // (decode_avx512.h) in float32 where the CPU has them, with groups of 1, 3 and 6 heads.
    for (const auto& [kv_heads, hd, hd_v] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {6, 8, 5}, {2, 13, 5}, {1, 16, 5}, {2, 64, 64}, {6, 16, 128}, {1, 128, 64}}) {
      const int64_t b = 3, h = 6, m = 19;
      const auto options = torch::TensorOptions().dtype(dtype);
      const auto query = torch::randn({b, h, 1, hd}, options);
      // Views of a larger storage, as a cache's keys are: (b, kv_heads, m, .) of capacity 24.
      const auto keys = torch::randn({b, kv_heads, 24, hd}, options).narrow(2, 0, m);
      const auto values = torch::randn({b, kv_heads, 24, hd_v}, options).narrow(2, 0, m);
      const std::vector<int64_t> begin{0, 3, 4}, end{19, 12, 4};
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      const auto got = attnkit::detail::decode_attention(query, keys, values, scale, begin, end);
      ASSERT_EQ(got.sizes(), (std::vector<int64_t>{b, h, 1, hd_v}));
      const auto all_keys = keys.repeat_interleave(h / kv_heads, 1);
      const auto all_values = values.repeat_interleave(h / kv_heads, 1);
      for (int64_t r = 0; r < b; ++r) {
        auto want = torch::zeros({h, 1, hd_v}, options);  // a row that sees no key: zeros
        if (end[r] > begin[r]) {
          const auto k = all_keys[r].slice(1, begin[r], end[r]);
          const auto v = all_values[r].slice(1, begin[r], end[r]);
          want = torch::softmax(torch::matmul(query[r], k.transpose(1, 2)) * scale, -1).matmul(v);
        }
        EXPECT_LT((got[r] - want).abs().max().item<double>(), tolerance)
            << dtype << ", " << kv_heads << " key heads, widths " << hd << " and " << hd_v
            << ", row " << r;
      }
      // Gemma 2's capped scores.
      const auto capped = attnkit::detail::decode_attention(query, keys, values, scale, begin, end,
                                                            /*softcap=*/0.7);
      for (int64_t r = 0; r < b; ++r) {
        if (end[r] <= begin[r])
          continue;
        const auto k = all_keys[r].slice(1, begin[r], end[r]);
        const auto v = all_values[r].slice(1, begin[r], end[r]);
        const auto scores = torch::matmul(query[r], k.transpose(1, 2)) * scale;
        const auto want = torch::softmax(torch::tanh(scores / 0.7) * 0.7, -1).matmul(v);
        EXPECT_LT((capped[r] - want).abs().max().item<double>(), tolerance)
            << dtype << ", softcap, row " << r;
      }
      const auto every_key = attnkit::detail::decode_attention(query, keys, values, scale);
      const auto want_all =
          torch::softmax(torch::matmul(query, all_keys.transpose(2, 3)) * scale, -1)
              .matmul(all_values);
      EXPECT_LT((every_key - want_all).abs().max().item<double>(), tolerance);
    }
  }
}

// A 16-bit cache is read in place, its arithmetic in float32 and the result rounded once:
// against the float64 math on the same 16-bit values, no further off than the float32 math
// rounded once (the floor), for every head layout, partial blocks of 8 keys and of 8 features,
// softcaps and sinks; the result keeps the cache's dtype. Widths of 64 and 128 take the
// AVX-512 BF16 group paths (decode_avx512.h) for bfloat16 where the CPU has them, with groups of
// 1, 3 and 6 query heads.
TEST(DecodeAttention, ReadsA16BitCacheInPlaceAtTheFloat32Floor) {
  torch::manual_seed(9);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& [kv_heads, hd, hd_v] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {6, 16, 21}, {2, 13, 21}, {1, 64, 21}, {2, 64, 64}, {1, 128, 128}, {6, 32, 64}}) {
      const int64_t b = 3, h = 6, m = 37;
      const auto as = torch::TensorOptions().dtype(dtype);
      const auto query = (2 * torch::randn({b, h, 1, hd})).to(as);
      const auto keys = (2 * torch::randn({b, kv_heads, 40, hd})).to(as).narrow(2, 0, m);
      const auto values = torch::randn({b, kv_heads, 40, hd_v}).to(as).narrow(2, 0, m);
      const auto sinks = torch::randn({h});
      const std::vector<int64_t> begin{0, 5, 9}, end{37, 30, 9};
      const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
      for (const double softcap : {0.0, 3.0}) {
        for (const bool with_sinks : {false, true}) {
          SCOPED_TRACE(c10::str(dtype, ", ", kv_heads, " key heads, widths ", hd, " and ", hd_v,
                                ", softcap ", softcap, with_sinks ? ", sinks" : ""));
          const auto decode = [&](torch::ScalarType as_dtype) {
            return attnkit::detail::decode_attention(query.to(as_dtype), keys.to(as_dtype),
                                                     values.to(as_dtype), scale, begin, end,
                                                     softcap, with_sinks ? sinks : torch::Tensor());
          };
          const auto got = decode(dtype);
          ASSERT_EQ(got.scalar_type(), dtype);
          const auto exact = decode(torch::kDouble);
          const double error = (got.to(torch::kDouble) - exact).abs().max().item<double>();
          const double floor = (decode(torch::kFloat).to(dtype).to(torch::kDouble) - exact)
                                   .abs()
                                   .max()
                                   .item<double>();
          EXPECT_GT(floor, 0.0);
          EXPECT_LE(error, 1.5 * floor) << "the float32 floor is " << floor;
        }
      }
    }
  }
}

// A softcapped module (Gemma 2's attention) decodes on the decode kernel, rolling cache and
// all; a score function that reads positions goes to the kernels that evaluate any.
TEST(DecodeAttention, ASoftcappedModulesStepRunsOnTheDecodeKernel) {
  torch::manual_seed(8);
  const torch::NoGradGuard no_grad;
  for (const bool softcap : {true, false}) {
    GroupedQueryAttention gqa(
        GroupedQueryAttentionOptions(4, 8, 0.0, 2, 1)
            .sliding_window_size(softcap ? c10::optional<int64_t>(3) : c10::nullopt)
            .score_mod(softcap ? score_mods::softcap(1.0)
                               : score_mods::alibi(score_mods::alibi_slopes(2))));
    gqa->eval();
    const auto x = torch::randn({1, 6, 4});
    auto cache = gqa->make_kv_cache(1, 8);
    gqa->forward_with_cache(x.narrow(1, 0, 5), cache);
    functional::KernelRecord record;
    const auto step = gqa->forward_with_cache(x.narrow(1, 5, 1), cache);
    ASSERT_FALSE(record.runs().empty());
    EXPECT_EQ(record.runs().back().kernel == "decode", softcap) << record.runs().back().kernel;
    EXPECT_TRUE(tensors_close("step", step, gqa(x).narrow(1, 5, 1), 1e-5));
  }
}

// A decode step multiplies its one row (or a batch's few) by each weight once: every row
// count it takes, widths with and without a partial block of 8, with and without a bias, against
// LibTorch's linear; what it does not take gives an undefined tensor (the caller's linear).
TEST(FewRowsLinear, EqualsLinearForEveryRowCountItTakes) {
  torch::manual_seed(48);
  for (const int64_t in : {8, 13, 64}) {
    for (const bool with_bias : {true, false}) {
      torch::nn::Linear linear(torch::nn::LinearOptions(in, 37).bias(with_bias));
      torch::NoGradGuard no_grad;
      for (int64_t rows = 1; rows <= attnkit::detail::kFewRowsMax; ++rows) {
        const auto x = torch::randn({rows, 1, in});
        const auto y = attnkit::detail::few_rows_linear_if_fits(x, linear->weight, linear->bias);
        if (!y.defined()) {
          GTEST_SKIP() << "this CPU has no AVX2 and FMA: the kernel is not used";
        }
        EXPECT_EQ(y.sizes(), (std::vector<int64_t>{rows, 1, 37}));
        EXPECT_TRUE(tensors_close(c10::str("in ", in, " rows ", rows, " bias ", with_bias), y,
                                  linear(x), 1e-5));
      }
    }
  }
}

TEST(FewRowsLinear, LeavesToLinearWhatItDoesNotTake) {
  torch::nn::Linear linear(6, 5);
  const auto fits = [&](const torch::Tensor& x) {
    return attnkit::detail::few_rows_linear_if_fits(x, linear->weight, linear->bias).defined();
  };
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(fits(torch::randn({attnkit::detail::kFewRowsMax + 1, 6})));  // the GEMM's
  EXPECT_FALSE(fits(torch::randn({3, 6}, torch::kFloat64)));
  EXPECT_FALSE(fits(torch::randn({3, 7})));  // not the weight's width
  EXPECT_FALSE(attnkit::detail::few_rows_linear_if_fits(torch::randn({3, 6}), linear->weight,
                                                        torch::randn({4}))
                   .defined());  // not the weight's bias
  {
    torch::AutoGradMode grad_mode(true);  // autograd to record
    EXPECT_FALSE(fits(torch::randn({3, 6})));
  }
}

TEST(DecodeAttention, RefusesWhatItCannotTake) {
  const auto query = torch::randn({2, 4, 1, 8});
  const auto keys = torch::randn({2, 2, 5, 8});
  expect_error_containing(
      [&] {
        attnkit::detail::decode_attention(query, keys, keys, 1.0, {0, 0}, {5, 6});
      },
      "[decode_attention] row 1: keys [0, 6) must lie in [0, 5]");
  expect_error_containing(
      [&] { attnkit::detail::decode_attention(query, keys, keys, 1.0, {0}, {5}); },
      "key_begin and key_end must both be empty or have 2 entries, got 1 and 1");
  expect_error_containing(
      [&] {
        attnkit::detail::decode_attention(query, torch::randn({2, 3, 5, 8}), keys, 1.0);
      },
      "heads a multiple of the key heads");
  expect_error_containing(
      [&] {
        attnkit::detail::decode_attention(query, keys, torch::randn({2, 2, 4, 8}), 1.0);
      },
      "keys and values must be (2, kv_heads, m, 8) and (2, kv_heads, m, hd_v)");
  expect_error_containing(
      [&] {
        attnkit::detail::decode_attention(torch::randn({2, 4, 2, 8}), keys, keys, 1.0);
      },
      "expected one CPU floating-point query per row");
  expect_error_containing(
      [&] { attnkit::detail::decode_attention(query.to(torch::kHalf), keys, keys, 1.0); },
      "got query [2, 4, 1, 8] Half on cpu, keys [2, 2, 5, 8] Float, values [2, 2, 5, 8] Float");
  expect_error_containing(
      [&] { attnkit::detail::decode_attention(query, keys, keys, 1.0, {}, {}, -1.0); },
      "[decode_attention] softcap must be >= 0 (0: none), got -1");
  // Autograd to record, or a query in another dtype than the cache: the general path's.
  EXPECT_FALSE(attnkit::detail::decode_attention_fits(query.clone().requires_grad_(), keys, keys));
  EXPECT_FALSE(attnkit::detail::decode_attention_fits(query.to(torch::kBFloat16), keys, keys));
  EXPECT_TRUE(attnkit::detail::decode_attention_fits(query, keys, keys));
  EXPECT_TRUE(attnkit::detail::decode_attention_fits(query.to(torch::kHalf), keys.to(torch::kHalf),
                                                     keys.to(torch::kHalf)));
}

// ---- Scheduler: continuous batching on paged caches ---------------------------------------

// Requests of different lengths join a running batch at different steps, on pages of 3
// positions, at most 3 running and 4 tokens a step (prompts of 7 and 11 are prefilled in
// chunks beside the others' decode steps), in a pool too small for all at once (requests wait
// for pages). Each gets the greedy tokens of its prompt generated alone, cut at its own stop
// token, and logits equal to the training forward's over its whole sequence (float64, 1e-10);
// a sampled request its draws alone; one past the context of 24 its refills alone.
TEST(Scheduler, EachRequestGetsItsTokensAloneJoiningAtDifferentSteps) {
  for (const auto& [module, window] : std::vector<std::pair<std::string, int64_t>>{
           {"mha", 0}, {"mha-combined", 5}, {"gqa", 0}, {"gqa", 4}, {"mla", 0}}) {
    SCOPED_TRACE(c10::str(module, " window ", window));
    torch::manual_seed(51);
    auto config = text_model_config(module, "fused");
    config.window = window;
    config.rope = module == "gqa";
    train::AttentionModel model(config);
    model->to(torch::kFloat64);
    model->eval();
    const std::vector<std::pair<int64_t, int64_t>> shapes{{4, 12}, {1, 12}, {7, 5},
                                                          {3, 12}, {11, 9}, {2, 20}};
    std::vector<torch::Tensor> prompts;
    for (const auto& shape : shapes)
      prompts.push_back(torch::randint(0, 40, {shape.first}, torch::kInt64));
    const int64_t stop = generated_alone(model, prompts[3], 12)[3 + 4].item<int64_t>();
    RecordingModel recording(model);
    Scheduler scheduler(recording, SchedulerOptions(/*num_pages=*/14)
                                       .page_size(3)
                                       .max_running(3)
                                       .max_tokens_per_step(4)
                                       .keep_logits(true));
    const auto options_of = [&](size_t r) {
      auto options = GenerateOptions(shapes[r].second);
      return r == 3 ? options.stop_tokens({stop}) : options;
    };
    // Two at first, then one more after each step; a sampled one and one past the context
    // last.
    const auto sampled_prompt = torch::randint(0, 40, {6}, torch::kInt64);
    const auto sampled = GenerateOptions(10).temperature(0.8).top_k(5).seed(3);
    const auto long_prompt = torch::randint(0, 40, {5}, torch::kInt64);
    std::vector<ServedRequest> served;
    bool waited_for_pages = false, chunk_beside_decode = false;
    size_t submitted = 0;
    for (; submitted < 2; ++submitted)
      EXPECT_EQ(scheduler.submit(prompts[submitted], options_of(submitted)), submitted);
    while (!scheduler.idle() || submitted < prompts.size() + 2) {
      const size_t calls_before = recording.paged_calls.size();
      for (auto& done : scheduler.step())
        served.push_back(std::move(done));
      int64_t step_tokens = 0;
      bool decoded = false, chunked = false;
      for (size_t c = calls_before; c < recording.paged_calls.size(); ++c) {
        const auto [rows, count] = recording.paged_calls[c];
        step_tokens += rows * count;
        (count == 1 ? decoded : chunked) = true;
      }
      EXPECT_LE(step_tokens, 4);
      chunk_beside_decode = chunk_beside_decode || (decoded && chunked);
      waited_for_pages = waited_for_pages || (scheduler.waiting() > 0 && scheduler.running() < 3);
      if (submitted < prompts.size()) {
        scheduler.submit(prompts[submitted], options_of(submitted));
        ++submitted;
      } else if (submitted == prompts.size()) {
        scheduler.submit(sampled_prompt, sampled);
        scheduler.submit(long_prompt, GenerateOptions(30));
        submitted += 2;
      }
    }
    EXPECT_TRUE(waited_for_pages) << "the pool never made a request wait";
    EXPECT_TRUE(chunk_beside_decode) << "no step prefilled a chunk beside decode steps";
    ASSERT_EQ(served.size(), prompts.size() + 2);
    std::sort(served.begin(), served.end(),
              [](const ServedRequest& a, const ServedRequest& b) { return a.id < b.id; });
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto alone = generated_alone(model, prompts[r], shapes[r].second, r == 3 ? stop : -1);
      EXPECT_TRUE(served[r].tokens.equal(alone))
          << "request " << r << "\nserved " << served[r].tokens << "\nalone " << alone;
      const int64_t n = shapes[r].first, generated = served[r].tokens.size(0) - n;
      ASSERT_EQ(served[r].logits.size(0), generated);
      const auto full = model->logits(served[r].tokens.view({1, -1}))[0];  // (n + new, vocab)
      EXPECT_TRUE(tensors_close(c10::str("request ", r, " logits"), served[r].logits,
                                full.narrow(0, n - 1, generated), 1e-10));
      EXPECT_EQ(served[r].prompt_length, n);
      EXPECT_GE(served[r].seconds, served[r].seconds_to_first_token);
    }
    EXPECT_TRUE(served[prompts.size()].tokens.equal(
        generate(*model, sampled_prompt.view({1, -1}), sampled)[0]));
    EXPECT_TRUE(served[prompts.size() + 1].tokens.equal(
        generate(*model, long_prompt.view({1, -1}), GenerateOptions(30))[0]));
    for (const auto& pool : scheduler.pools())
      EXPECT_EQ(pool.free_pages(), 14) << "an ended request kept pages";
  }
}

// A model call that throws, after writing its pages: it fed request 1's prefill chunk alone
// (the three prompts' lengths differ), which ends with the error and gives its pages back;
// the other two get their tokens alone and run() ends. A prefix whose prefill throws is not
// kept, and its pages return.
TEST(Scheduler, AModelCallThatThrowsEndsItsRequestsAndTheOthersGoOn) {
  torch::manual_seed(57);
  train::AttentionModel model(text_model_config("gqa", "fused"));
  model->to(torch::kFloat64);
  model->eval();
  RecordingModel recording(model);
  recording.failing_sequence = 1;  // request 1's, in the order of admission
  Scheduler scheduler(recording, SchedulerOptions(16).page_size(4).max_running(3));
  const std::vector<torch::Tensor> prompts{torch::randint(0, 40, {3}, torch::kInt64),
                                           torch::randint(0, 40, {6}, torch::kInt64),
                                           torch::randint(0, 40, {4}, torch::kInt64)};
  for (const auto& prompt : prompts)
    scheduler.submit(prompt, GenerateOptions(5));
  const auto served = scheduler.run();
  ASSERT_EQ(served.size(), 3u);
  EXPECT_TRUE(served[1].error.find("the model's call on 1 rows of 6 tokens failed: the test's "
                                   "failing sequence") != std::string::npos)
      << served[1].error;
  EXPECT_TRUE(served[1].tokens.equal(prompts[1]));
  for (const size_t r : {size_t{0}, size_t{2}}) {
    EXPECT_TRUE(served[r].error.empty()) << served[r].error;
    EXPECT_TRUE(served[r].tokens.equal(generated_alone(model, prompts[r], 5))) << "request " << r;
  }
  EXPECT_EQ(scheduler.pools().front().free_pages(), 16) << "a failed request kept pages";
  // The next sequence id is 3: a prefix on it fails, and leaves nothing behind.
  recording.failing_sequence = 3;
  expect_error_containing([&] { scheduler.add_prefix(torch::randint(0, 40, {9}, torch::kInt64)); },
                          "the test's failing sequence");
  EXPECT_EQ(scheduler.pools().front().free_pages(), 16);
  expect_error_containing([&] { scheduler.submit(prompts[0], GenerateOptions(2), 0); },
                          "[Scheduler] prefix 0 is not a prefix held (0 were added");
}

TEST(Scheduler, BadArgumentsAreNamedAndQueueNothing) {
  train::AttentionModel model(text_model_config("gqa", "fused"));
  model->eval();
  Scheduler scheduler(*model, SchedulerOptions(8).page_size(2).max_running(2));
  const auto prompt = torch::zeros({3}, torch::kInt64);
  expect_error_containing(
      [&] {
        scheduler.submit(prompt.view({1, 3}), GenerateOptions(2));
      },
      "[Scheduler] prompt: expected (n) int64 token ids with n >= 1, got "
      "[1, 3] Long");
  expect_error_containing([&] { scheduler.submit(prompt.to(torch::kFloat), GenerateOptions(2)); },
                          "[Scheduler] prompt: expected (n) int64 token ids");
  expect_error_containing([&] { scheduler.submit(prompt, GenerateOptions(2).temperature(-1.0)); },
                          "[Scheduler] temperature must be >= 0 (0: greedy), got -1");
  expect_error_containing([&] { scheduler.submit(prompt, GenerateOptions(-1)); },
                          "[Scheduler] max_new_tokens must be >= 0, got -1");
  expect_error_containing([&] { scheduler.submit(prompt, GenerateOptions(2).use_kv_cache(false)); },
                          "[Scheduler] serves from paged KV caches: use_kv_cache must be true");
  // 3 + 20 positions, at most the context of 24: 12 pages of 2, in a pool of 8.
  expect_error_containing(
      [&] { scheduler.submit(prompt, GenerateOptions(20)); },
      "[Scheduler] request 0 can hold 23 positions (prompt 3 + max_new_tokens 20, at most the "
      "context of 24): 12 pages of 2, but the pool has 8");
  EXPECT_TRUE(scheduler.idle()) << "a refused request was queued";
  EXPECT_EQ(scheduler.submit(prompt, GenerateOptions(0)), 0) << "ids count accepted requests";
  const auto ended = scheduler.run();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_TRUE(ended[0].tokens.equal(prompt)) << "max_new_tokens 0 gives the prompt";
  EXPECT_FALSE(ended[0].logits.defined());
  expect_error_containing(
      [&] { Scheduler(*model, SchedulerOptions(8).max_running(4).max_tokens_per_step(3)); },
      "[Scheduler] max_tokens_per_step must be >= max_running (every running request's decode "
      "token fits in one step), got max_tokens_per_step = 3, max_running = 4");
  expect_error_containing([&] { Scheduler(*model, SchedulerOptions(0)); },
                          "[Scheduler] num_pages and page_size must be >= 1, got num_pages = 0");
  // A model that implements none of the paged methods says which it lacks.
  struct Unpaged : CausalLanguageModel {
    torch::Tensor logits(const torch::Tensor& t) override { return t; }
    torch::Tensor logits_with_cache(const torch::Tensor& t, std::vector<KVCache>&) override {
      return t;
    }
    std::vector<KVCache> make_kv_caches(int64_t, int64_t) override { return {}; }
    int64_t context_length() const override { return 8; }
  } unpaged;
  expect_error_containing([&] { Scheduler(unpaged, SchedulerOptions(8)); },
                          "[Scheduler] serving needs the model's make_paged_kv_caches(num_pages, "
                          "page_size) and paged_logits(tokens, pools, sequences)");
}

// A 9-token prefix (a system prompt) prefilled once; four requests on it, joining at
// different steps, and one without it. Each gets the tokens and logits of its whole prompt
// (prefix + its own) generated alone; the pool holds the prefix's two full pages once; its
// pages return when it is released and the last request on it ends.
TEST(Scheduler, RequestsOnAPrefixShareItsPages) {
  for (const std::string module : {"mha", "gqa", "mla"}) {
    SCOPED_TRACE(module);
    torch::manual_seed(53);
    auto config = text_model_config(module, "fused");
    config.rope = module == "gqa";
    config.window = module == "gqa" ? 6 : 0;
    train::AttentionModel model(config);
    model->to(torch::kFloat64);
    model->eval();
    const auto system = torch::randint(0, 40, {9}, torch::kInt64);
    const std::vector<std::pair<int64_t, int64_t>> shapes{{1, 8}, {3, 10}, {5, 6}, {2, 12}};
    std::vector<torch::Tensor> prompts;
    for (const auto& shape : shapes)
      prompts.push_back(torch::randint(0, 40, {shape.first}, torch::kInt64));
    const int64_t page_size = 4, num_pages = 40;
    Scheduler scheduler(*model, SchedulerOptions(num_pages)
                                    .page_size(page_size)
                                    .max_running(5)
                                    .max_tokens_per_step(8)
                                    .keep_logits(true));
    const int64_t prefix = scheduler.add_prefix(system);
    // ceil(9 / 4) pages; a window of 6 has already freed the one of positions 0-3.
    EXPECT_EQ(num_pages - scheduler.pools().front().free_pages(), config.window == 0 ? 3 : 2);
    // The pages held if each request held its whole sequence: the most the pool may hold
    // with the prefix's 2 full pages shared is 2 fewer per request on it.
    int64_t unshared = 3;
    for (const auto& [n, max_new] : shapes)
      unshared += (9 + n + max_new + page_size - 1) / page_size;
    const auto alone_prompt = torch::randint(0, 40, {4}, torch::kInt64);
    std::vector<ServedRequest> served;
    int64_t most_held = 0;
    for (size_t step = 0; step < 40 && (step < 2 * shapes.size() || !scheduler.idle()); ++step) {
      if (step % 2 == 0 && step / 2 < shapes.size())
        scheduler.submit(prompts[step / 2], GenerateOptions(shapes[step / 2].second), prefix);
      if (step == 1)
        scheduler.submit(alone_prompt, GenerateOptions(5));
      if (step == 2 * shapes.size() - 1)
        scheduler.release_prefix(prefix);  // the requests on it keep running
      for (auto& done : scheduler.step())
        served.push_back(std::move(done));
      most_held = std::max(most_held, num_pages - scheduler.pools().front().free_pages());
    }
    ASSERT_EQ(served.size(), shapes.size() + 1);
    std::sort(served.begin(), served.end(),
              [](const ServedRequest& a, const ServedRequest& b) { return a.id < b.id; });
    for (size_t r = 0; r < served.size(); ++r) {
      const bool on_prefix = r != 1;  // id 1 is the request without it
      const size_t shape = r == 0 ? 0 : r - 1;
      const auto prompt = on_prefix ? torch::cat({system, prompts[shape]}) : alone_prompt;
      const int64_t max_new = on_prefix ? shapes[shape].second : 5;
      const auto alone = generated_alone(model, prompt, max_new);
      EXPECT_TRUE(served[r].tokens.equal(alone))
          << "request " << r << "\nserved " << served[r].tokens << "\nalone " << alone;
      EXPECT_EQ(served[r].prompt_length, prompt.size(0));
      const auto full = model->logits(served[r].tokens.view({1, -1}))[0];
      EXPECT_TRUE(tensors_close(c10::str("request ", r, " logits"), served[r].logits,
                                full.narrow(0, prompt.size(0) - 1, max_new), 1e-10));
    }
    EXPECT_LE(most_held, unshared + 2 - 2 * static_cast<int64_t>(shapes.size()))
        << "the prefix's full pages were not shared";
    for (const auto& pool : scheduler.pools())
      EXPECT_EQ(pool.free_pages(), num_pages) << "the prefix's pages were not given back";
    expect_error_containing([&] { scheduler.submit(prompts[0], GenerateOptions(2), prefix); },
                            "[Scheduler] prefix 0 is not a prefix held (1 were added; a "
                            "released one takes no new request)");
    expect_error_containing([&] { scheduler.release_prefix(prefix); },
                            "[Scheduler] release_prefix: 0 is not a prefix held");
    const int64_t second = scheduler.add_prefix(torch::randint(0, 40, {20}, torch::kInt64));
    expect_error_containing(
        [&] { scheduler.submit(torch::zeros({5}, torch::kInt64), GenerateOptions(1), second); },
        "[Scheduler] a request on a prefix keeps its whole prompt: prefix 20 + prompt 5 tokens "
        "must fit in the context of 24");
    expect_error_containing([&] { scheduler.add_prefix(torch::zeros({24}, torch::kInt64)); },
                            "[Scheduler] add_prefix: expected (n) int64 token ids with 1 <= n "
                            "< context_length = 24, got [24] Long");
    EXPECT_TRUE(scheduler.idle());
  }
}
