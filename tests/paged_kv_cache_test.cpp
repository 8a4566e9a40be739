// The paged KV cache (PagedKVCache) and the decode step that reads its pages in place
// (paged_decode_attention): contents across pages, shared prefixes and copy on write, the pool's
// bounds and refusals, and the step against the dense math.

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attnkit/block_mask.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/memory_budget.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/paged_attention.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/score_mods.h"
#include "module_factory.h"
#include "test_support.h"

namespace {

using attnkit::PagedAttentionOptions;
using attnkit::PagedKV;
using attnkit::PagedKVCache;
using attnkit::testing::expect_error_containing;
using attnkit::testing::kFloat64;

// Row r of `view` as (kv_heads, lengths[r], head_dim) keys and values, gathered from its pages
// (the test's own reading of the layout).
std::pair<torch::Tensor, torch::Tensor> gathered_row(const PagedKV& view, int64_t r) {
  const int64_t length = view.lengths[r].item<int64_t>(), page_size = view.key_pages.size(2);
  std::vector<torch::Tensor> keys, values;
  for (int64_t j = 0; j < length; ++j) {
    const int64_t page = view.page_table[r][j / page_size].item<int64_t>();
    keys.push_back(view.key_pages[page].select(1, j % page_size));
    values.push_back(view.value_pages[page].select(1, j % page_size));
  }
  return {torch::stack(keys, 1), torch::stack(values, 1)};
}

// The dense math of one decode step for row r: query (heads, hd) against keys and values
// (kv_heads, m, hd) with the last `window` positions (0: all), a softcap and sinks (heads).
torch::Tensor dense_step(const torch::Tensor& query, const torch::Tensor& keys,
                         const torch::Tensor& values, int64_t window, double softcap,
                         const torch::Tensor& sinks) {
  const int64_t heads = query.size(0), group = heads / keys.size(0), m = keys.size(1);
  const auto k = keys.repeat_interleave(group, 0), v = values.repeat_interleave(group, 0);
  auto scores = torch::matmul(query.unsqueeze(1), k.transpose(1, 2)).squeeze(1) /
                std::sqrt(static_cast<double>(query.size(1)));  // (heads, m)
  if (softcap > 0.0)
    scores = softcap * torch::tanh(scores / softcap);
  if (window > 0 && m > window)
    scores.narrow(1, 0, m - window).fill_(-INFINITY);
  if (sinks.defined())
    scores = torch::cat({scores, sinks.unsqueeze(1)}, 1);
  auto weights = torch::softmax(scores, 1).narrow(1, 0, m);
  return torch::matmul(weights.unsqueeze(1), v).squeeze(1);  // (heads, hd)
}

torch::Tensor random_tokens(int64_t heads, int64_t n, int64_t hd, torch::Dtype dtype) {
  return torch::randn({heads, n, hd}, torch::kDouble).to(dtype);
}

// A cache with sequences of `lengths` positions, appended in pieces of 1, 3 and the rest.
std::vector<int64_t> filled(PagedKVCache& cache, const std::vector<int64_t>& lengths,
                            torch::Dtype dtype) {
  std::vector<int64_t> ids;
  for (const int64_t length : lengths) {
    const auto id = cache.add_sequence();
    for (int64_t done = 0; done < length;) {
      const int64_t n = std::min<int64_t>(length - done, done == 0 ? 1 : 3 + done);
      cache.append(id, random_tokens(cache.num_heads(), n, cache.head_dim(), dtype),
                   random_tokens(cache.num_heads(), n, cache.head_dim(), dtype));
      done += n;
    }
    ids.push_back(id);
  }
  return ids;
}

TEST(PagedDecode, EqualsTheDenseMathForEveryPageSizeWindowAndScore) {
  torch::manual_seed(7);
  torch::NoGradGuard no_grad;
  for (const int64_t page_size : {1, 3, 16}) {
    for (const int64_t window : {0, 5}) {
      for (const bool capped_with_sinks : {false, true}) {
        PagedKVCache cache(64, page_size, /*num_heads=*/2, /*head_dim=*/8,
                           torch::TensorOptions(torch::kDouble));
        const auto ids = filled(cache, {1, 17, 40}, torch::kDouble);
        const auto view = cache.view(ids);
        const auto query = torch::randn({3, 4, 1, 8}, torch::kDouble);  // 4 heads on 2 key heads
        const double softcap = capped_with_sinks ? 2.0 : 0.0;
        const auto sinks = capped_with_sinks ? torch::randn({4}, torch::kDouble) : torch::Tensor();
        const auto out = attnkit::paged_attention(
            query, view, PagedAttentionOptions().window(window).softcap(softcap).sinks(sinks));
        ASSERT_EQ(out.sizes(), (std::vector<int64_t>{3, 4, 1, 8}));
        for (int64_t r = 0; r < 3; ++r) {
          const auto [keys, values] = gathered_row(view, r);
          EXPECT_TENSOR_NEAR(out[r].squeeze(1),
                             dense_step(query[r].squeeze(1), keys, values, window, softcap, sinks),
                             kFloat64)
              << "page_size " << page_size << " window " << window << " row " << r;
        }
      }
    }
  }
}

TEST(PagedDecode, APrefillChunksQueriesSeeTheirCausalPrefix) {
  torch::manual_seed(8);
  torch::NoGradGuard no_grad;
  for (const int64_t window : {0, 4}) {
    PagedKVCache cache(32, 3, /*num_heads=*/1, /*head_dim=*/4,
                       torch::TensorOptions(torch::kDouble));
    const auto ids = filled(cache, {5, 17}, torch::kDouble);
    const auto view = cache.view(ids);
    const int64_t n = 5;  // the rows' last 5 positions are the chunk's queries
    const auto query = torch::randn({2, 2, n, 4}, torch::kDouble);
    const auto out = attnkit::paged_attention(query, view, PagedAttentionOptions().window(window));
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{2, 2, n, 4}));
    for (int64_t r = 0; r < 2; ++r) {
      const auto [keys, values] = gathered_row(view, r);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t seen = keys.size(1) - n + i + 1;  // causal: positions [0, seen)
        EXPECT_TENSOR_NEAR(out[r].select(1, i),
                           dense_step(query[r].select(1, i), keys.narrow(1, 0, seen),
                                      values.narrow(1, 0, seen), window, 0.0, {}),
                           kFloat64)
            << "window " << window << " row " << r << " query " << i;
      }
    }
  }
}

// Prefill chunks of 8 and 70 queries per row (two blocks of a tile task), which run in tiles
// (paged_prefill.h): each query against the dense math of its causal prefix, with grouped
// heads, pages of 3 and 16 positions, a window, a softcap and sinks, in float64 and float32.
TEST(PagedDecode, PrefillChunksInTilesEqualTheDenseMath) {
  torch::manual_seed(9);
  torch::NoGradGuard no_grad;
  for (const auto dtype : {torch::kDouble, torch::kFloat}) {
    for (const int64_t page_size : {3, 16}) {
      for (const int64_t n : {8, 70}) {
        for (const int64_t window : {0, 5}) {
          const double softcap = window > 0 ? 2.0 : 0.0;
          const auto sinks = window > 0 ? torch::randn({4}, torch::kDouble) : torch::Tensor();
          SCOPED_TRACE(
              c10::str(dtype, ", pages of ", page_size, ", ", n, " queries, window ", window));
          PagedKVCache cache(64, page_size, /*num_heads=*/2, /*head_dim=*/8,
                             torch::TensorOptions(dtype));
          const auto ids = filled(cache, {n, n + 21}, dtype);
          const auto view = cache.view(ids);
          const auto query = random_tokens(8, n, 8, dtype).view({2, 4, n, 8});
          const auto out = attnkit::paged_attention(
              query, view, PagedAttentionOptions().window(window).softcap(softcap).sinks(sinks));
          for (int64_t r = 0; r < 2; ++r) {
            const auto [keys, values] = gathered_row(view, r);
            for (const int64_t i : {int64_t{0}, n / 2, n - 1}) {
              const int64_t seen = keys.size(1) - n + i + 1;  // causal: positions [0, seen)
              EXPECT_TENSOR_NEAR(
                  out[r].select(1, i).to(torch::kDouble),
                  dense_step(query[r].select(1, i).to(torch::kDouble),
                             keys.narrow(1, 0, seen).to(torch::kDouble),
                             values.narrow(1, 0, seen).to(torch::kDouble), window, softcap, sinks),
                  dtype == torch::kDouble ? kFloat64 : 1e-5)
                  << "row " << r << " query " << i;
            }
          }
        }
      }
    }
  }
}

// A BlockMask's lists bound the keys each query reads: two documents of 32 positions in
// blocks of 16, on pages of 16, the first document's pages poisoned with NaN. Queries of the
// second read none of them (a decode step, a chunk of 2 a query at a time, a chunk of 8 in
// tiles) and equal the dense math over their document's keys; the inner mask alone would
// read the poisoned pages and give NaN.
TEST(PagedDecode, ABlockMasksListsSkipThePagesItMasks) {
  torch::manual_seed(10);
  torch::NoGradGuard no_grad;
  PagedKVCache cache(8, 16, /*num_heads=*/2, /*head_dim=*/8, torch::TensorOptions(torch::kDouble));
  const auto ids = filled(cache, {64}, torch::kDouble);
  const auto view = cache.view(ids);
  const auto [keys, values] = gathered_row(view, 0);  // before the poison
  for (int64_t page = 0; page < 2; ++page) {
    const int64_t index = view.page_table[0][page].item<int64_t>();
    cache.key_pages()[index].fill_(NAN);
    cache.value_pages()[index].fill_(NAN);
  }
  const auto documents = attnkit::Mask::documents(
      torch::cat({torch::zeros({1, 32}, torch::kInt64), torch::ones({1, 32}, torch::kInt64)}, 1));
  const auto blocks = attnkit::Mask::from_block_mask(attnkit::create_block_mask(
      documents, 1, 1, 64, 64, attnkit::BlockMaskOptions().block_size(16)));
  for (const int64_t n : {1, 2, 8}) {
    const auto query = torch::randn({1, 4, n, 8}, torch::kDouble);
    const auto out = attnkit::paged_attention(query, view, PagedAttentionOptions().mask(blocks));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t seen = 64 - n + i + 1;  // causal within the second document: [32, seen)
      EXPECT_TENSOR_NEAR(out[0].select(1, i),
                         dense_step(query[0].select(1, i), keys.narrow(1, 32, seen - 32),
                                    values.narrow(1, 32, seen - 32), 0, 0.0, {}),
                         kFloat64)
          << n << " queries, query " << i;
    }
    EXPECT_TRUE(
        torch::isnan(attnkit::paged_attention(query, view, PagedAttentionOptions().mask(documents)))
            .any()
            .item<bool>())
        << "the poison is not read without the lists: this test would prove nothing";
  }
}

// Decode steps and prefill chunks: a chunk of 8 queries or more runs in tiles on the matrix
// units where LibTorch has brgemm and the CPU the instructions (2.6 on, AVX-512 BF16 or AMX),
// else a query at a time like a decode step.
TEST(PagedDecode, SixteenBitPagesAgreeWithFloat32) {
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    // Heads of 64, two query heads per key head: bfloat16 takes the AVX-512 BF16 group paths
    // where the CPU has them.
    PagedKVCache cache(32, 16, 2, 64, torch::TensorOptions(dtype));
    const auto ids = filled(cache, {90, 75}, dtype);
    const auto view = cache.view(ids);
    // The same pages widened to float32: the arithmetic is float32 either way, so only the
    // roundings differ: the output's, and in tiles the weights' before their product.
    const PagedKV wide{view.key_pages.to(torch::kFloat), view.value_pages.to(torch::kFloat),
                       view.page_table, view.lengths};
    for (const int64_t n : {1, 16, 70}) {  // 70: a block of 64 queries and one of 6
      const auto query = torch::randn({2, 4, n, 64}).to(dtype);
      for (const double softcap : {0.0, 5.0}) {
        const auto options = PagedAttentionOptions().softcap(softcap);
        const auto out = attnkit::paged_attention(query, view, options);
        EXPECT_EQ(out.scalar_type(), dtype);
        const auto expected = attnkit::paged_attention(query.to(torch::kFloat), wide, options);
        EXPECT_TENSOR_NEAR(out.to(torch::kFloat), expected, dtype == torch::kHalf ? 2e-3 : 1e-2)
            << c10::toString(dtype) << ", " << n << " queries, softcap " << softcap;
      }
    }
  }
}

TEST(PagedKVCacheTest, HoldsWhatWasAppendedAcrossPages) {
  torch::manual_seed(1);
  PagedKVCache cache(8, 4, 2, 3, torch::TensorOptions(torch::kDouble));
  const auto id = cache.add_sequence();
  const auto keys = random_tokens(2, 11, 3, torch::kDouble);
  const auto values = random_tokens(2, 11, 3, torch::kDouble);
  cache.append(id, keys.narrow(1, 0, 2), values.narrow(1, 0, 2));
  cache.append(id, keys.narrow(1, 2, 9), values.narrow(1, 2, 9));
  EXPECT_EQ(cache.length(id), 11);
  EXPECT_EQ(cache.free_pages(), 8 - 3);  // ceil(11 / 4) pages
  const auto [held_keys, held_values] = gathered_row(cache.view({id}), 0);
  EXPECT_TRUE(torch::equal(held_keys, keys));
  EXPECT_TRUE(torch::equal(held_values, values));
}

TEST(PagedKVCacheTest, ForkSharesPagesAndCopiesAPartlyFilledOneOnWrite) {
  torch::manual_seed(2);
  PagedKVCache cache(16, 4, 1, 2, torch::TensorOptions(torch::kDouble));
  const auto prefix = cache.add_sequence();
  const auto prefix_keys = random_tokens(1, 6, 2, torch::kDouble);  // pages: 4 full + 2
  cache.append(prefix, prefix_keys, prefix_keys * 2);
  const auto a = cache.fork(prefix), b = cache.fork(prefix);
  EXPECT_EQ(cache.free_pages(), 16 - 2);  // nothing copied yet
  const auto shared = cache.view({prefix}).page_table;
  EXPECT_EQ(cache.references(shared[0][0].item<int64_t>()), 3);
  const auto a_keys = random_tokens(1, 3, 2, torch::kDouble);
  cache.append(a, a_keys, a_keys * 2);  // copies page 1, then fills a new page
  EXPECT_EQ(cache.free_pages(), 16 - 4);
  const auto b_keys = random_tokens(1, 1, 2, torch::kDouble);
  cache.append(b, b_keys, b_keys * 2);  // copies page 1
  EXPECT_EQ(cache.free_pages(), 16 - 5);
  const auto view = cache.view({prefix, a, b});
  EXPECT_EQ(view.page_table[1][0].item<int64_t>(), shared[0][0].item<int64_t>());
  EXPECT_NE(view.page_table[1][1].item<int64_t>(), shared[0][1].item<int64_t>());
  EXPECT_TRUE(torch::equal(gathered_row(view, 0).first, prefix_keys));
  EXPECT_TRUE(torch::equal(gathered_row(view, 1).first, torch::cat({prefix_keys, a_keys}, 1)));
  EXPECT_TRUE(torch::equal(gathered_row(view, 2).first, torch::cat({prefix_keys, b_keys}, 1)));
  EXPECT_TRUE(torch::equal(gathered_row(view, 2).second, torch::cat({prefix_keys, b_keys}, 1) * 2));
  // Every sequence released: every page back in the pool.
  for (const auto id : {prefix, a, b})
    cache.release(id);
  EXPECT_EQ(cache.free_pages(), 16);
  EXPECT_EQ(cache.held_bytes(), 0);
}

TEST(PagedKVCacheTest, SixteenRequestsHoldTheirSharedPrefixOnce) {
  // 16 requests share a 1,024-token prefix and add 64 tokens each; pages of 16 positions.
  const int64_t page_size = 16, heads = 2, hd = 8, prefix = 1024, own = 64, requests = 16;
  PagedKVCache cache(256, page_size, heads, hd);
  const auto prompt = cache.add_sequence();
  cache.append(prompt, torch::zeros({heads, prefix, hd}), torch::zeros({heads, prefix, hd}));
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < requests; ++i) {
    ids.push_back(cache.fork(prompt));
    for (int64_t t = 0; t < own; ++t)  // decode steps, one position each
      cache.append(ids.back(), torch::ones({heads, 1, hd}), torch::ones({heads, 1, hd}));
  }
  cache.release(prompt);
  const int64_t page_bytes = 2 * (page_size * heads * hd * 4 + 64);  // a cache line of padding
  EXPECT_EQ(cache.held_bytes(), (prefix / page_size + requests * own / page_size) * page_bytes);
  // A contiguous cache per request holds the prefix 16 times: 8x the bytes.
  const int64_t contiguous_bytes = requests * (prefix + own) * 2 * heads * hd * 4;
  EXPECT_EQ(contiguous_bytes, cache.held_bytes() * 8);
}

// A pool of latents: one tensor read as keys and values, half the bytes, appended once; a fork
// copies a shared, partly filled page of latents on write as a key/value pool does.
TEST(PagedKVCacheTest, APoolOfLatentsHoldsEachLatentOnce) {
  torch::NoGradGuard no_grad;
  auto latents = PagedKVCache::latents(8, 4, 6, torch::TensorOptions(torch::kDouble));
  PagedKVCache pairs(8, 4, 1, 6, torch::TensorOptions(torch::kDouble));
  EXPECT_TRUE(latents.holds_latents());
  EXPECT_FALSE(pairs.holds_latents());
  EXPECT_TRUE(latents.value_pages().is_same(latents.key_pages()));
  EXPECT_EQ(2 * latents.nbytes(), pairs.nbytes());
  EXPECT_EQ(PagedKVCache::pages_within(latents.nbytes(), 4, 1, 6, torch::kDouble, true), 8);
  const auto first = torch::randn({1, 6, 6}, torch::kDouble);
  const auto prompt = latents.add_sequence();
  latents.append(prompt, first);
  const auto child = latents.fork(prompt);
  const auto more = torch::randn({1, 3, 6}, torch::kDouble);
  latents.append(child, more);  // copies page 1 (positions 4-5), then fills it
  const auto gathered = [&](int64_t sequence) {
    const auto view = latents.view({sequence});
    return gathered_row(view, 0).first;  // (1, length, 6)
  };
  EXPECT_TRUE(torch::equal(gathered(prompt), first));
  EXPECT_TRUE(torch::equal(gathered(child), torch::cat({first, more}, 1)));
  EXPECT_EQ(latents.num_pages() - latents.free_pages(), 2 + 2);
  expect_error_containing([&] { latents.append(prompt, first, first); },
                          "[PagedKVCache::append] this pool holds latents, each its position's "
                          "key and value: append(sequence, latents)");
  expect_error_containing([&] { pairs.append(pairs.add_sequence(), first); },
                          "[PagedKVCache::append] this pool holds keys and values: "
                          "append(sequence, keys, values)");
  expect_error_containing(
      [&] {
        latents.append(prompt, torch::randn({2, 1, 6}, torch::kDouble));
      },
      "[PagedKVCache::append] latents: expected (1, n, 6), got [2, 1, 6]");
  expect_error_containing([&] { PagedKVCache::latents(4, 4, 0); },
                          "[PagedKVCache::latents] option latent_dim must be > 0, got 0");
  expect_error_containing(
      [&] { PagedKVCache::pages_within(1 << 20, 4, 2, 6, torch::kDouble, true); },
      "[PagedKVCache::pages_within] a pool of latents has num_heads 1, got 2");
}

TEST(PagedKVCacheTest, AFullPoolRefusesAndWritesNothing) {
  PagedKVCache cache(4, 4, 1, 2, torch::TensorOptions(torch::kDouble));
  const auto a = cache.add_sequence();
  cache.append(a, torch::ones({1, 10, 2}, torch::kDouble), torch::ones({1, 10, 2}, torch::kDouble));
  const auto b = cache.fork(a);
  EXPECT_TRUE(cache.can_append(a, 2));   // the last page's free slots, after one copy
  EXPECT_FALSE(cache.can_append(a, 3));  // a copy and one more page
  const auto before = cache.key_pages().clone();
  expect_error_containing(
      [&] {
        cache.append(a, torch::full({1, 3, 2}, 5.0, torch::kDouble),
                     torch::full({1, 3, 2}, 5.0, torch::kDouble));
      },
      "[PagedKVCache::append] the pool is full: 3 more positions of sequence 0 need 2 free "
      "pages, and 1 of 4 are free");
  EXPECT_TRUE(torch::equal(cache.key_pages(), before));
  EXPECT_EQ(cache.length(a), 10);
  EXPECT_EQ(cache.free_pages(), 1);
  cache.release(b);  // the last page is a's alone again: no copy needed
  EXPECT_TRUE(cache.can_append(a, 6));
}

TEST(PagedKVCacheTest, DropBeforeFreesTheWindowsOldPages) {
  torch::manual_seed(4);
  torch::NoGradGuard no_grad;
  PagedKVCache cache(8, 4, 1, 4, torch::TensorOptions(torch::kDouble));
  const auto id = filled(cache, {18}, torch::kDouble).front();
  const auto full_view = cache.view({id});
  const auto query = torch::randn({1, 1, 1, 4}, torch::kDouble);
  const auto expected =
      attnkit::paged_attention(query, full_view, PagedAttentionOptions().window(6));
  cache.drop_before(id, 18 - 6);  // pages [0, 4), [4, 8) and [8, 12) hold no windowed key
  EXPECT_EQ(cache.free_pages(), 8 - 2);
  const auto view = cache.view({id});
  EXPECT_EQ(view.page_table[0][2].item<int64_t>(), -1);
  EXPECT_TRUE(torch::equal(attnkit::paged_attention(query, view, PagedAttentionOptions().window(6)),
                           expected));
  // Without the window the step would read a freed page: refused by name.
  expect_error_containing([&] { attnkit::paged_attention(query, view); },
                          "page_table[0][0] = -1 points outside the pool of 8 pages");
  expect_error_containing([&] { cache.drop_before(id, 19); },
                          "[PagedKVCache::drop_before] position must be in [0, 18]");
}

TEST(PagedKVCacheTest, RefusesBadTablesSequencesAndShapesByName) {
  torch::NoGradGuard no_grad;
  PagedKVCache cache(4, 2, 1, 2, torch::TensorOptions(torch::kDouble));
  const auto a = cache.add_sequence();
  cache.append(a, torch::ones({1, 3, 2}, torch::kDouble), torch::ones({1, 3, 2}, torch::kDouble));
  auto view = cache.view({a});
  const auto query = torch::ones({1, 1, 1, 2}, torch::kDouble);
  auto outside = view;
  outside.page_table = view.page_table.clone();
  outside.page_table[0][1] = 9;
  expect_error_containing([&] { attnkit::paged_attention(query, outside); },
                          "[attnkit::paged_attention] page_table[0][1] = 9 points outside "
                          "the pool of 4 pages");
  auto too_long = view;
  too_long.lengths = torch::full({1}, 5, torch::kInt64);
  expect_error_containing([&] { attnkit::paged_attention(query, too_long); },
                          "lengths[0] must be in [1, 4]");
  expect_error_containing(
      [&] {
        attnkit::paged_attention(torch::ones({1, 1, 4, 2}, torch::kDouble), view);
      },
      "lengths[0] must be in [4, 4] (the 4 queries' positions");
  expect_error_containing(
      [&] {
        attnkit::paged_attention(torch::ones({1, 2, 2}, torch::kDouble), view);
      },
      "query: expected (batch, heads, n, head_dim) with n >= 1, got [1, 2, 2]");
  expect_error_containing([&] { attnkit::paged_attention(query.to(torch::kFloat), view); },
                          "need one dtype of float32, float64, bfloat16 or float16, got Float, "
                          "Double and Double");
  auto int32_table = view;
  int32_table.page_table = view.page_table.to(torch::kInt32);
  expect_error_containing([&] { attnkit::paged_attention(query, int32_table); },
                          "page_table must be int64 on the CPU, got Int");
  expect_error_containing(
      [&] { attnkit::paged_attention(query, view, PagedAttentionOptions().window(-1)); },
      "window must be >= 0 (0: none), got -1");
  {
    torch::AutoGradMode grad(true);
    const auto tracked = query.clone().requires_grad_();
    expect_error_containing([&] { attnkit::paged_attention(tracked, view); },
                            "records no autograd");
  }
  // A view taken before a release reads a free page.
  cache.release(a);
  expect_error_containing([&] { cache.check_view(view); },
                          "[PagedKVCache::check_view] page_table[0][0] = 0 is a free page");
  expect_error_containing([&] { cache.length(a); },
                          "[PagedKVCache::length] sequence 0 was released");
  expect_error_containing([&] { cache.fork(7); },
                          "[PagedKVCache::fork] sequence 7 does not exist (ids are [0, 1))");
  const auto b = cache.add_sequence();
  expect_error_containing(
      [&] {
        cache.append(b, torch::ones({2, 1, 2}, torch::kDouble), torch::ones({2, 1, 2}));
      },
      "[PagedKVCache::append] keys: expected (1, n, 2), got [2, 1, 2]");
  expect_error_containing(
      [&] {
        cache.append(b, torch::ones({1, 1, 2}, torch::kDouble), torch::ones({1, 1, 2}));
      },
      "values must match the pool's dtype and device (Double on cpu), got Float on cpu");
  expect_error_containing([&] { PagedKVCache(0, 2, 1, 2); },
                          "[PagedKVCache] option num_pages must be > 0, got 0");
  expect_error_containing([&] { PagedKVCache::pages_within(100, 16, 2, 8, torch::kFloat); },
                          "bytes must hold at least one page (2176 bytes), got 100");
  EXPECT_EQ(PagedKVCache::pages_within(10 * 2176 + 5, 16, 2, 8, torch::kFloat), 10);
}

TEST(PagedKVCacheTest, APoolOverTheMemoryBudgetIsRefused) {
  attnkit::set_memory_budget(int64_t{1} << 20);
  expect_error_containing([&] { PagedKVCache(1024, 16, 8, 64); },
                          "[PagedKVCache]: a pool of 1024 pages needs 67.2 MB, over attnkit's "
                          "memory budget of 1.05 MB");
  attnkit::set_memory_budget(0);
  PagedKVCache fits(8, 16, 8, 64);
  EXPECT_EQ(fits.nbytes(), 8 * 2 * (16 * 8 * 64 * 4 + 64));
}

// A prefill of 11 tokens (in tiles: paged_prefill.h), then 5 decode steps, of two sequences:
// through a KVCache and through a paged pool of 3-position pages, the same rows.
void expect_paged_steps_equal_the_contiguous_cache(attnkit::CachedAttentionLayer& layer,
                                                   int64_t d_in, const std::string& label) {
  torch::NoGradGuard no_grad;
  layer.as_module()->to(torch::kDouble);
  layer.as_module()->eval();
  auto cache = layer.make_kv_cache(2, 32);
  auto pool = layer.make_paged_kv_cache(32, 3);
  const std::vector<int64_t> sequences{pool.add_sequence(), pool.add_sequence()};
  const auto prompt = torch::randn({2, 11, d_in}, torch::kDouble);
  EXPECT_TENSOR_NEAR(layer.forward_with_cache(prompt, pool, sequences),
                     layer.forward_with_cache(prompt, cache), 1e-10)
      << label << " prefill";
  for (int step = 0; step < 5; ++step) {
    const auto token = torch::randn({2, 1, d_in}, torch::kDouble);
    EXPECT_TENSOR_NEAR(layer.forward_with_cache(token, pool, sequences),
                       layer.forward_with_cache(token, cache), 1e-10)
        << label << " step " << step;
  }
  EXPECT_EQ(pool.length(sequences[1]), 16);
}

TEST(PagedModules, StepsOnPagesEqualTheContiguousCache) {
  torch::manual_seed(11);
  const auto rope = attnkit::RopeOptions(64);
  attnkit::MultiHeadAttention mha(
      attnkit::MultiHeadAttentionOptions(16, 16, 64, 0.0, 4).rope(rope).qk_norm(true));
  expect_paged_steps_equal_the_contiguous_cache(*mha.ptr(), 16, "mha, rope, qk_norm");
  attnkit::MultiHeadAttentionCombinedQKV combined(
      attnkit::MultiHeadAttentionOptions(16, 16, 64, 0.0, 4).sliding_window_size(4));
  expect_paged_steps_equal_the_contiguous_cache(*combined.ptr(), 16, "combined qkv, window 4");
  // Gemma 2's local layer in small: a window, a softcap, grouped heads, RoPE and sinks.
  attnkit::GroupedQueryAttention gqa(attnkit::GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2)
                                         .sliding_window_size(5)
                                         .score_mod(attnkit::score_mods::softcap(3.0))
                                         .rope(rope)
                                         .sinks(true));
  torch::NoGradGuard no_grad;
  gqa->sinks.normal_();
  expect_paged_steps_equal_the_contiguous_cache(*gqa.ptr(), 16, "gqa, window, softcap, sinks");
  // ALiBi, row by row at each sequence's positions.
  attnkit::MultiHeadAttention alibi(
      attnkit::MultiHeadAttentionOptions(16, 16, 64, 0.0, 4)
          .score_mod(attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(4))));
  expect_paged_steps_equal_the_contiguous_cache(*alibi.ptr(), 16, "mha, alibi");
  // Latent attention: the latents paged, read in place with the up-projections absorbed, in
  // prefill chunks too (the contiguous cache's prefill up-projects every latent); with
  // qkv_bias the pages carry a column of ones for the biases, which a softcap would not leave
  // out of the softmax.
  const auto mla_options = attnkit::MultiHeadLatentAttentionOptions(16, 16, 0.0, 4).latent_dim(8);
  attnkit::MultiHeadLatentAttention mla(mla_options);
  expect_paged_steps_equal_the_contiguous_cache(*mla.ptr(), 16, "mla");
  auto biased_options = mla_options;
  attnkit::MultiHeadLatentAttention mla_softcap(
      biased_options.qkv_bias(true).score_mod(attnkit::score_mods::softcap(2.0)));
  EXPECT_EQ(mla_softcap->make_paged_kv_cache(4, 3).head_dim(), 9);
  expect_paged_steps_equal_the_contiguous_cache(*mla_softcap.ptr(), 16, "mla, qkv_bias, softcap");
  biased_options = mla_options;
  attnkit::MultiHeadLatentAttention mla_alibi(biased_options.qkv_bias(true).score_mod(
      attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(4))));
  expect_paged_steps_equal_the_contiguous_cache(*mla_alibi.ptr(), 16, "mla, qkv_bias, alibi");
}

// Score functions that read positions in a window: ALiBi (its q_idx shifts a row's scores
// alike), a random relative-position bias (it does not), and a C++ function of every index,
// which the kernels call on each row's tensors: a paged prefill of 9 (in tiles), a chunk of 2
// (a query at a time) and a decode step against the training forward over the whole sequence
// (float64).
TEST(PagedModules, PositionalScoresInAWindowEqualTheTrainingForward) {
  torch::manual_seed(13);
  torch::NoGradGuard no_grad;
  const auto head_bias = torch::randn({4}, torch::kDouble);
  const std::vector<std::pair<std::string, attnkit::ScoreMod>> scores{
      {"alibi", attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(4))},
      {"relative bias",
       attnkit::score_mods::relative_position_bias(torch::randn({4, 7}, torch::kDouble))},
      {"C++ function",
       [head_bias](const torch::Tensor& score, const torch::Tensor& b, const torch::Tensor& h,
                   const torch::Tensor& q_idx, const torch::Tensor& kv_idx) {
         return torch::tanh(score) * (1 + b) + head_bias.index({h}) * (q_idx - kv_idx) / 3 +
                (q_idx * kv_idx).to(torch::kDouble) / 40;
       }}};
  for (const auto& [label, score_mod] : scores) {
    attnkit::GroupedQueryAttention gqa(attnkit::GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2)
                                           .sliding_window_size(4)
                                           .rope(attnkit::RopeOptions(64))
                                           .score_mod(score_mod));
    gqa->to(torch::kDouble);
    gqa->eval();
    const auto sequence = torch::randn({2, 12, 16}, torch::kDouble);
    const auto whole = gqa->forward(sequence);  // (2, 12, 16)
    auto pool = gqa->make_paged_kv_cache(16, 3);
    const std::vector<int64_t> rows{pool.add_sequence(), pool.add_sequence()};
    for (const auto& [start, n] : {std::pair<int64_t, int64_t>{0, 9}, {9, 2}, {11, 1}}) {
      EXPECT_TENSOR_NEAR(gqa->forward_with_cache(sequence.narrow(1, start, n), pool, rows),
                         whole.narrow(1, start, n), 1e-10)
          << label << ", positions from " << start;
    }
  }
}

// Masks in paged steps at each sequence's positions, as in training: packed documents (read
// from their host form) and a mask_mod (evaluated as tensors), with and without a window; a
// paged prefill and decode steps against the training forward with the same mask (float64),
// on key/value pages and on latent attention's pages. The mask_mod leaves position 3's query no key
// but itself, and in a window of 2 a later query none at all: zeros, as the training forward gives.
TEST(PagedModules, MasksAtTheSequencesPositionsEqualTheTrainingForward) {
  torch::manual_seed(14);
  torch::NoGradGuard no_grad;
  // Each over positions [0, end): a documents mask's ids cover exactly the positions a call
  // reads, as on a KVCache.
  const auto masks = attnkit::testing::masks_over_two_sequences();
  // Grouped-query attention with RoPE, in and out of a window; latent attention, and with
  // qkv_bias and a softcap (its pages carry the biases' column; a query left no key gets
  // zeros, not W_UV's bias).
  const auto gqa_options =
      attnkit::GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2).rope(attnkit::RopeOptions(64));
  const auto mla_options = attnkit::MultiHeadLatentAttentionOptions(16, 16, 0.0, 4).latent_dim(8);
  const std::vector<
      std::pair<std::string, std::function<std::shared_ptr<attnkit::CachedAttentionLayer>()>>>
      layers{{"gqa", [&] { return attnkit::GroupedQueryAttention(gqa_options).ptr(); }},
             {"gqa, window 2",
              [&] {
                auto options = gqa_options;
                return attnkit::GroupedQueryAttention(options.sliding_window_size(2)).ptr();
              }},
             {"mla", [&] { return attnkit::MultiHeadLatentAttention(mla_options).ptr(); }},
             {"mla, qkv_bias, softcap", [&] {
                auto options = mla_options;
                return attnkit::MultiHeadLatentAttention(
                           options.qkv_bias(true).score_mod(attnkit::score_mods::softcap(2.0)))
                    .ptr();
              }}};
  for (const auto& [layer_label, make_layer] : layers) {
    for (const auto& [label, mask_at] : masks) {
      SCOPED_TRACE(c10::str(label, ", ", layer_label));
      const auto layer = make_layer();
      layer->as_module()->to(torch::kDouble);
      layer->as_module()->eval();
      const auto sequence = torch::randn({2, 12, 16}, torch::kDouble);
      const auto whole = layer->forward(sequence, {}, {}, mask_at(12));  // (2, 12, 16)
      auto pool = layer->make_paged_kv_cache(16, 3);
      const std::vector<int64_t> rows{pool.add_sequence(), pool.add_sequence()};
      EXPECT_TENSOR_NEAR(
          layer->forward_with_cache(sequence.narrow(1, 0, 9), pool, rows, mask_at(9)),
          whole.narrow(1, 0, 9), 1e-10);
      for (int64_t t = 9; t < 12; ++t) {
        EXPECT_TENSOR_NEAR(
            layer->forward_with_cache(sequence.narrow(1, t, 1), pool, rows, mask_at(t + 1)),
            whole.narrow(1, t, 1), 1e-10)
            << "position " << t;
      }
    }
  }
  // A mask that does not cover the positions read is refused before anything is written.
  attnkit::GroupedQueryAttention gqa(attnkit::GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2));
  gqa->eval();
  auto pool = gqa->make_paged_kv_cache(16, 3);
  const auto row = pool.add_sequence();
  expect_error_containing(
      [&] {
        gqa->forward_with_cache(torch::randn({1, 5, 16}), pool, {row},
                                attnkit::Mask::documents(torch::zeros({1, 4}, torch::kInt64)));
      },
      "[GroupedQueryAttention::forward_with_cache]");
  EXPECT_EQ(pool.length(row), 0) << "a refused step wrote";
}

TEST(PagedModules, ForkedRequestsDecodeLikeTheirOwnCaches) {
  torch::manual_seed(12);
  torch::NoGradGuard no_grad;
  attnkit::GroupedQueryAttention gqa(
      attnkit::GroupedQueryAttentionOptions(16, 16, 0.0, 4, 2).rope(attnkit::RopeOptions(64)));
  gqa->to(torch::kDouble);
  gqa->eval();
  const auto prompt = torch::randn({1, 9, 16}, torch::kDouble);
  auto pool = gqa->make_paged_kv_cache(16, 4);
  const auto system_prompt = pool.add_sequence();
  gqa->forward_with_cache(prompt, pool, {system_prompt});
  const std::vector<int64_t> requests{pool.fork(system_prompt), pool.fork(system_prompt)};
  pool.release(system_prompt);
  auto cache = gqa->make_kv_cache(2, 32);  // the prompt prefilled in each row
  gqa->forward_with_cache(prompt.expand({2, 9, 16}).contiguous(), cache);
  for (int step = 0; step < 6; ++step) {
    const auto token = torch::randn({2, 1, 16}, torch::kDouble);
    EXPECT_TENSOR_NEAR(gqa->forward_with_cache(token, pool, requests),
                       gqa->forward_with_cache(token, cache), 1e-10)
        << "step " << step;
  }
  // The prompt's 2 full pages stay shared; its third, partly filled, was copied by the first
  // request to write, and the second kept it; then a new page each.
  EXPECT_EQ(pool.num_pages() - pool.free_pages(), 2 + 2 * 2);
}

TEST(PagedModules, RefuseWhatAPagedStepCannotDo) {
  torch::NoGradGuard no_grad;
  attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2));
  auto pool = mha->make_paged_kv_cache(2, 4);
  const auto a = pool.add_sequence();
  const auto x = torch::randn({1, 3, 8});
  expect_error_containing([&] { mha->forward_with_cache(x, pool, {a}); },
                          "[MultiHeadAttention::forward_with_cache] the KV cache is for "
                          "inference, but the module is in training mode");
  mha->eval();
  expect_error_containing(
      [&] {
        mha->forward_with_cache(x, pool, {a, a});
      },
      "sequences: expected one per row of x (1), got 2");
  expect_error_containing(
      [&] {
        mha->forward_with_cache(torch::randn({1, 17, 8}), pool, {a});
      },
      "row 0: 17 tokens after the 0 that sequence 0 holds would pass "
      "context_length 16");
  expect_error_containing(
      [&] {
        mha->forward_with_cache(torch::randn({1, 9, 8}), pool, {a});
      },
      "the pool is full: this step needs 3 free pages, and 2 of 2 are free");
  EXPECT_EQ(pool.length(a), 0);  // nothing written
  const auto b = pool.add_sequence();
  expect_error_containing(
      [&] {
        mha->forward_with_cache(torch::randn({2, 1, 8}), pool, {b, b});
      },
      "sequences must be distinct, got 1 at rows 0 and 1");
  PagedKVCache wide(2, 4, 4, 2);
  expect_error_containing([&] { mha->forward_with_cache(x, wide, {wide.add_sequence()}); },
                          "cache: expected pages of (num_heads, head_dim) = (2, 4), got (4, 2)");
  // A score function that does not fit the heads is refused before the step writes.
  attnkit::MultiHeadAttention alibi(
      attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2)
          .score_mod(attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(3))));
  alibi->eval();
  auto alibi_pool = alibi->make_paged_kv_cache(4, 4);
  expect_error_containing(
      [&] { alibi->forward_with_cache(x, alibi_pool, {alibi_pool.add_sequence()}); },
      "[MultiHeadAttention::forward_with_cache] score_mod: ALiBi's slopes must be one per head "
      "(2), not [3]");
  EXPECT_EQ(alibi_pool.free_pages(), 4) << "a refused step wrote";
  // Latent attention reads a pool of latents, and key/value modules a pool of keys and values.
  attnkit::MultiHeadLatentAttention mla(attnkit::MultiHeadLatentAttentionOptions(8, 8, 0.0, 2));
  mla->eval();
  expect_error_containing([&] { mla->forward_with_cache(x, pool, {a}); },
                          "[MultiHeadLatentAttention::forward_with_cache] cache: expected a pool "
                          "of latents, got one of keys and values; make it with "
                          "make_paged_kv_cache");
  auto latents = mla->make_paged_kv_cache(4, 4);
  expect_error_containing([&] { mha->forward_with_cache(x, latents, {latents.add_sequence()}); },
                          "[MultiHeadAttention::forward_with_cache] cache: expected a pool of keys "
                          "and values, got one of latents");
  EXPECT_EQ(pool.length(a), 0);
}

}  // namespace
