// attnkit::Mask, score functions and functional::attention: the tiles a mask judges agree
// with its dense form; every backend agrees with an element-by-element reference written
// here from the definitions (outputs and every gradient, captured tensors included); bad
// input is named.

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <tuple>

#include <sys/wait.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "attnkit/attention.h"
#include "attnkit/block_mask.h"
#include "attnkit/context_parallel.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/score_graph.h"
#include "attnkit/serialize.h"
#include "core/kernels/decode_attention.h"
#include "core/kernels/sdpa_kernel.h"
#include "core/scores/row_variants.h"
#include "source_paths.h"
#include "test_support.h"

namespace {

using attnkit::AttentionBackend;
using attnkit::Mask;
using attnkit::TileKind;
using attnkit::functional::AttentionOptions;
using attnkit::testing::expect_error_containing;
using attnkit::testing::tensors_close;
namespace F = attnkit::functional;
namespace score_mods = attnkit::score_mods;

constexpr int64_t kBatch = 2, kHeads = 4, kKvHeads = 2;

// Document ids of two packed rows: (2, n), documents of uneven lengths.
torch::Tensor document_ids(int64_t n) {
  auto ids = torch::empty({kBatch, n}, torch::kInt64);
  for (int64_t j = 0; j < n; ++j) {
    ids[0][j] = j < n / 3 ? 0 : j < n - 2 ? 1 : 2;
    ids[1][j] = j / 5;
  }
  return ids;
}

// The masks under test, named, for n queries and m keys; the dense truth of each is built
// element by element from its definition by `truth`.
struct MaskCase {
  std::string name;
  Mask mask;
  std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)> truth;
};

std::vector<MaskCase> mask_cases(int64_t n, int64_t m) {
  const auto lengths = torch::tensor({m, m / 2}, torch::kInt64);
  auto padding = torch::zeros({kBatch, m}, torch::kBool);
  padding[1].narrow(0, m - 3, 3).fill_(true);
  padding[0][1] = true;  // padding need not be a suffix
  const int64_t offset = m - n;
  const auto causal = [offset](int64_t i, int64_t j) { return j <= i + offset; };
  const auto allowed = torch::rand({1, kHeads, n, m}) > 0.3;
  std::vector<MaskCase> cases{
      {"causal", Mask::causal(offset),
       [=](int64_t, int64_t, int64_t i, int64_t j) { return causal(i, j); }},
      {"window", Mask::causal(offset).sliding_window(3),
       [=](int64_t, int64_t, int64_t i, int64_t j) { return causal(i, j) && i + offset - j < 3; }},
      {"lengths", Mask::key_padding(lengths),
       [=](int64_t b, int64_t, int64_t, int64_t j) { return j < lengths[b].item<int64_t>(); }},
      {"padding", Mask::key_padding(padding),
       [=](int64_t b, int64_t, int64_t, int64_t j) { return !padding[b][j].item<bool>(); }},
      {"tensor", Mask::from_tensor(allowed),
       [=](int64_t, int64_t h, int64_t i, int64_t j) { return allowed[0][h][i][j].item<bool>(); }},
      {"function (prefix-LM)", Mask::from_function([offset](auto, auto, auto q, auto kv) {
         return (kv <= q + offset).logical_or(kv < 4);
       }),
       [=](int64_t, int64_t, int64_t i, int64_t j) { return causal(i, j) || j < 4; }},
      {"causal & lengths", Mask::causal(offset) & Mask::key_padding(lengths),
       [=](int64_t b, int64_t, int64_t i, int64_t j) {
         return causal(i, j) && j < lengths[b].item<int64_t>();
       }},
      {"padding | function of the head",
       Mask::key_padding(padding) |
           Mask::from_function([](auto, auto h, auto q, auto kv) { return (h + q + kv) % 3 == 0; }),
       [=](int64_t b, int64_t h, int64_t i, int64_t j) {
         return !padding[b][j].item<bool>() || (h + i + j) % 3 == 0;
       }},
      {"two windows",
       Mask::causal(offset).sliding_window(2) | Mask::causal(offset + 3).sliding_window(2),
       [=](int64_t, int64_t, int64_t i, int64_t j) {
         return (causal(i, j) && i + offset - j < 2) ||
                (j <= i + offset + 3 && i + offset + 3 - j < 2);
       }},
      // One causal offset per batch entry (rows of a ragged batch in a KV cache).
      {"per-row causal", Mask::causal(torch::tensor({offset, int64_t{1}})),
       [=](int64_t b, int64_t, int64_t i, int64_t j) { return j <= i + (b == 0 ? offset : 1); }},
      {"per-row window & lengths",
       Mask::causal(torch::tensor({int64_t{2}, offset})).sliding_window(3) &
           Mask::key_padding(lengths),
       [=](int64_t b, int64_t, int64_t i, int64_t j) {
         const int64_t position = i + (b == 0 ? 2 : offset);
         return j <= position && position - j < 3 && j < lengths[b].item<int64_t>();
       }},
      // Rows that see no key: batch entry 1 sees none at all.
      {"empty rows", Mask::key_padding(torch::tensor({m, int64_t{0}})),
       [=](int64_t b, int64_t, int64_t, int64_t) { return b == 0; }},
  };
  if (n == m) {
    const auto ids = document_ids(n);
    const auto same = [ids](int64_t b, int64_t i, int64_t j) {
      return ids[b][i].item<int64_t>() == ids[b][j].item<int64_t>();
    };
    cases.push_back({"documents", Mask::documents(ids),
                     [=](int64_t b, int64_t, int64_t i, int64_t j) { return same(b, i, j); }});
    cases.push_back(
        {"causal documents", Mask::documents(ids, true),
         [=](int64_t b, int64_t, int64_t i, int64_t j) { return same(b, i, j) && j <= i; }});
    // Two structured masks, each partial on a tile, whose & may hide all of it.
    cases.push_back({"documents & padding", Mask::documents(ids) & Mask::key_padding(padding),
                     [=](int64_t b, int64_t, int64_t i, int64_t j) {
                       return same(b, i, j) && !padding[b][j].item<bool>();
                     }});
  }
  return cases;
}

torch::Tensor truth_tensor(const MaskCase& c, int64_t n, int64_t m) {
  auto out = torch::empty({kBatch, kHeads, n, m}, torch::kBool);
  auto a = out.accessor<bool, 4>();
  for (int64_t b = 0; b < kBatch; ++b)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < m; ++j)
          a[b][h][i][j] = c.truth(b, h, i, j);
  return out;
}

TEST(Mask, DenseFormAndTileVerdictsAgreeWithTheDefinition) {
  torch::manual_seed(7);
  std::mt19937 random(11);
  for (const auto& [n, m] : {std::pair<int64_t, int64_t>{13, 13}, {6, 17}}) {
    for (const auto& c : mask_cases(n, m)) {
      SCOPED_TRACE(c.name + " n=" + std::to_string(n) + " m=" + std::to_string(m));
      const auto truth = truth_tensor(c, n, m);
      EXPECT_TRUE(
          torch::equal(c.mask.dense(kBatch, kHeads, n, m, torch::kCPU).expand_as(truth), truth));
      // Random tiles: an empty verdict has no allowed entry, a full one no hidden entry, and
      // a partial one gives exactly the tile's entries.
      for (int trial = 0; trial < 40; ++trial) {
        attnkit::Tile tile;
        tile.batch = random() % kBatch;
        tile.head_begin = random() % kHeads;
        tile.heads = 1 + random() % (kHeads - tile.head_begin);
        tile.query_begin = random() % n;
        tile.queries = 1 + random() % (n - tile.query_begin);
        tile.key_begin = random() % m;
        tile.keys = 1 + random() % (m - tile.key_begin);
        const auto expected = truth[tile.batch]
                                  .narrow(0, tile.head_begin, tile.heads)
                                  .narrow(1, tile.query_begin, tile.queries)
                                  .narrow(2, tile.key_begin, tile.keys);
        const auto verdict = c.mask.tile(tile, torch::kCPU);
        if (verdict.kind == TileKind::kEmpty) {
          EXPECT_FALSE(expected.any().item<bool>()) << "trial " << trial;
        } else if (verdict.kind == TileKind::kFull) {
          EXPECT_TRUE(expected.all().item<bool>()) << "trial " << trial;
        } else {
          EXPECT_TRUE(torch::equal(verdict.allowed.expand_as(expected), expected))
              << "trial " << trial;
        }
      }
    }
  }
}

// A region of each mask (what a context-parallel rank applies to a pair of chunks) is the
// slice of the whole mask: its dense form, and its tiles' verdicts, also read from a block mask.
// A causal offset whose last query position overflows int64 is refused by name, on every
// backend (Mask::causal(INT64_MAX) wrapped, and every query saw no key: zeros); one that fits
// sees every key, as it should.
TEST(Mask, ACausalOffsetPastInt64IsRefusedByName) {
  const auto q = torch::randn({2, 2, 32, 8});
  const int64_t most = std::numeric_limits<int64_t>::max();
  for (const auto backend :
       {AttentionBackend::kAuto, AttentionBackend::kChunked, AttentionBackend::kMath}) {
    SCOPED_TRACE(attnkit::backend_name(backend));
    for (const auto& mask : {Mask::causal(most), Mask::causal(most - 31).sliding_window(4),
                             Mask::causal(torch::tensor({int64_t{0}, most}))}) {
      const auto call = [&] {
        F::attention(q, q, q, F::AttentionOptions().mask(mask).backend(backend));
      };
      expect_error_containing(call, "mask: causal query_offset");
      expect_error_containing(call,
                              " must be at most INT64_MAX - 32 = 9223372036854775775 (the last "
                              "query's key position must fit in int64), got 9223372036854775");
    }
    const auto fits =
        F::attention(q, q, q, F::AttentionOptions().mask(Mask::causal(most - 32)).backend(backend));
    EXPECT_TRUE(tensors_close("every key seen", fits, F::attention(q, q, q), 1e-5));
    // A window of INT64_MAX is no window (its first key, position - window + 1, overflowed).
    const auto widest = F::attention(q, q, q,
                                     F::AttentionOptions()
                                         .mask(Mask::causal().sliding_window(most))
                                         .backend(backend)
                                         .query_block_size(8)
                                         .key_block_size(8));
    EXPECT_TRUE(tensors_close(
        "causal", widest, F::attention(q, q, q, F::AttentionOptions().mask(Mask::causal())), 1e-5));
  }
}

TEST(Mask, RegionsAreSlicesOfTheWholeMask) {
  torch::manual_seed(7);
  std::mt19937 random(5);
  const int64_t n = 13;
  for (const auto& c : mask_cases(n, n)) {
    SCOPED_TRACE(c.name);
    const auto truth = truth_tensor(c, n, n);
    const auto blocks = attnkit::create_block_mask(c.mask, kBatch, kHeads, n, n,
                                                   attnkit::BlockMaskOptions().block_size(4));
    for (int trial = 0; trial < 12; ++trial) {
      const int64_t q0 = random() % n, k0 = random() % n;
      const int64_t queries = 1 + random() % (n - q0), keys = 1 + random() % (n - k0);
      const auto expected = truth.narrow(2, q0, queries).narrow(3, k0, keys);
      for (const auto& whole : {c.mask, attnkit::Mask::from_block_mask(blocks)}) {
        const auto region = whole.region(q0, k0, n, n);
        EXPECT_TRUE(torch::equal(
            region.dense(kBatch, kHeads, queries, keys, torch::kCPU).expand_as(expected), expected))
            << "region " << q0 << ", " << k0 << " of " << queries << " x " << keys;
        for (int64_t b = 0; b < kBatch; ++b) {
          const auto verdict =
              region.tile(attnkit::Tile{b, 0, kHeads, 0, queries, 0, keys}, torch::kCPU);
          const auto entries = expected[b];
          if (verdict.kind == TileKind::kEmpty)
            EXPECT_FALSE(entries.any().item<bool>());
          else if (verdict.kind == TileKind::kFull)
            EXPECT_TRUE(entries.all().item<bool>());
          else
            EXPECT_TRUE(torch::equal(verdict.allowed.expand_as(entries), entries));
        }
      }
    }
  }
  // A region must lie inside the problem: refused when made, and when a call is larger.
  const auto documents = attnkit::Mask::documents(torch::zeros({8}, torch::kInt64));
  expect_error_containing([&] { (void)documents.region(8, 0, 8, 8); },
                          "query_start must be in [0, num_queries)");
  const auto q = torch::randn({1, 1, 6, 4});
  expect_error_containing(
      [&] {
        (void)attnkit::functional::attention(q, q, q,
                                             AttentionOptions().mask(documents.region(4, 0, 8, 8)));
      },
      "holds at most 4 queries and 8 keys, got 6 queries and 6 keys");
}

// Each rank's shard of a sequence, its positions, and the whole again, in both layouts.
TEST(SequenceShards, ShardsCoverTheSequenceOnceAndRefuseLengthsThatDoNotDivide) {
  const auto whole = torch::arange(24).view({1, 24, 1});
  for (const auto layout : {attnkit::ShardLayout::kZigzag, attnkit::ShardLayout::kContiguous}) {
    const attnkit::SequenceShards shards(24, 3, layout);
    std::vector<torch::Tensor> pieces;
    for (int r = 0; r < 3; ++r) {
      pieces.push_back(shards.shard(whole, r, 1));
      EXPECT_TRUE(torch::equal(pieces.back().view({-1}), shards.positions(r)));
    }
    EXPECT_TRUE(torch::equal(shards.unshard(pieces, 1), whole));
  }
  // Zigzag: rank 0 holds chunks 0 and 5 of six, rank 2 chunks 2 and 3.
  const attnkit::SequenceShards zigzag(24, 3, attnkit::ShardLayout::kZigzag);
  EXPECT_TRUE(torch::equal(zigzag.positions(0), torch::tensor({0, 1, 2, 3, 20, 21, 22, 23})));
  EXPECT_TRUE(torch::equal(zigzag.positions(2), torch::tensor({8, 9, 10, 11, 12, 13, 14, 15})));
  expect_error_containing(
      [&] { (void)attnkit::SequenceShards(20, 3, attnkit::ShardLayout::kZigzag); },
      "a sequence of 20 tokens must divide into 6 equal chunks (zigzag over 3 "
      "ranks): pad it to a multiple of 6");
  expect_error_containing(
      [&] {
        (void)zigzag.shard(torch::zeros({1, 20}), 0, 1);
      },
      "expected a tensor with 24 tokens along dimension 1, got [1, 20]");
  expect_error_containing([&] { (void)zigzag.positions(3); }, "rank must be in [0, 3), got 3");
}

// The definition, element by element in float64: scores, score function, mask, softmax (a
// row that sees nothing gives zeros), weighted values; key/value head h / (H / G).
torch::Tensor reference_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const MaskCase& c,
    const std::function<torch::Tensor(torch::Tensor, int64_t, int64_t, int64_t, int64_t)>& modify) {
  const int64_t n = q.size(2), m = k.size(2), group = q.size(1) / k.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  std::vector<torch::Tensor> heads_out;
  for (int64_t b = 0; b < q.size(0); ++b) {
    for (int64_t h = 0; h < q.size(1); ++h) {
      std::vector<torch::Tensor> rows_out;
      for (int64_t i = 0; i < n; ++i) {
        std::vector<torch::Tensor> scores;
        std::vector<int64_t> seen;
        for (int64_t j = 0; j < m; ++j) {
          if (!c.truth(b, h, i, j))
            continue;
          auto s = (q[b][h][i] * k[b][h / group][j]).sum() * scale;
          scores.push_back(modify ? modify(s, b, h, i, j) : s);
          seen.push_back(j);
        }
        auto row = torch::zeros({v.size(3)}, q.options());
        if (!scores.empty()) {
          const auto weights = torch::softmax(torch::stack(scores), 0);
          for (size_t t = 0; t < seen.size(); ++t)
            row = row + weights[t] * v[b][h / group][seen[t]];
        }
        rows_out.push_back(row);
      }
      heads_out.push_back(torch::stack(rows_out));
    }
  }
  return torch::stack(heads_out).view({q.size(0), q.size(1), n, v.size(3)});
}

struct ScoreCase {
  std::string name;
  attnkit::ScoreMod score_mod;  // empty: none
  std::function<torch::Tensor(torch::Tensor, int64_t, int64_t, int64_t, int64_t)> reference;
};

// Attention sinks (GPT-OSS): each head's logit joins every row's softmax with no value. The
// math core against the definition spelled out (a key whose score is the sink and whose value
// is zero), outputs and gradients, with grouped heads, a softcap and a row that sees no key;
// the decode step's kernel against it too; kernels without sinks decline, by name.
TEST(Attention, SinksJoinEachRowsSoftmaxWithNoValue) {
  torch::manual_seed(21);
  const auto dtype = torch::kFloat64;
  const auto q = torch::randn({2, 4, 5, 8}, dtype).requires_grad_(true);
  const auto k = torch::randn({2, 2, 7, 8}, dtype).requires_grad_(true);
  const auto v = torch::randn({2, 2, 7, 8}, dtype).requires_grad_(true);
  const auto sinks = torch::randn({4}, dtype).requires_grad_(true);
  // Query 0 of every row sees no key (its window starts past the keys it may see).
  const auto mask =
      Mask::causal(2) &
      Mask::from_function([](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q_idx,
                             const torch::Tensor& kv_idx) { return q_idx.gt(0) | kv_idx.gt(6); });
  const auto options =
      AttentionOptions().mask(mask).score_mod(score_mods::softcap(2.0)).sinks(sinks);
  const auto probe = torch::randn({2, 4, 5, 8}, dtype);
  const auto grads = [&](const torch::Tensor& out) {
    for (const auto& t : {q, k, v, sinks})
      t.mutable_grad() = torch::Tensor();
    (out * probe).sum().backward();
    return std::vector<torch::Tensor>{q.grad().clone(), k.grad().clone(), v.grad().clone(),
                                      sinks.grad().clone()};
  };
  const auto out = F::attention(q, k, v, options);
  const auto got = grads(out);
  // The chunked backend runs them on the fused tile kernel's split path (the sinks kernel):
  // memory linear in n, the same values.
  F::KernelRecord record;
  const auto tiled =
      F::attention(q, k, v, AttentionOptions(options).backend(AttentionBackend::kChunked));
  const auto tiled_grads = grads(tiled);
  ASSERT_GE(record.runs().size(), 2u);
  EXPECT_EQ(record.runs()[0].kernel, "sinks");
  EXPECT_EQ(record.runs()[1].kernel, "fused_tiles");
  // The definition: (b, 4, 5, 7) scores, then the sink as an eighth key of value zero.
  auto scores = torch::tanh(torch::matmul(q, k.repeat_interleave(2, 1).transpose(2, 3)) /
                            std::sqrt(8.0) / 2.0) *
                2.0;
  scores = scores.masked_fill(mask.dense(2, 4, 5, 7, torch::kCPU).logical_not(),
                              -std::numeric_limits<double>::infinity());
  const auto with_sink =
      torch::cat({scores, sinks.view({1, 4, 1, 1}).expand({2, 4, 5, 1})}, -1);  // (2, 4, 5, 8)
  const auto weights = torch::softmax(with_sink, -1).narrow(-1, 0, 7);
  const auto expected = torch::matmul(weights, v.repeat_interleave(2, 1));
  const auto want = grads(expected);
  EXPECT_TRUE(tensors_close("output", out, expected, 1e-12));
  EXPECT_TRUE(out.select(2, 0).eq(0).all().item<bool>());  // the row that sees no key
  const char* names[] = {"q", "k", "v", "sinks"};
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(tensors_close(c10::str("grad ", names[i]), got[i], want[i], 1e-12));
  EXPECT_GT(got[3].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(tensors_close("tiled output", tiled, expected, 1e-12));
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_TRUE(tensors_close(c10::str("tiled grad ", names[i]), tiled_grads[i], want[i], 1e-12));

  // One query per row against a cache: the decode kernel's sinks (the last query sees all 7
  // keys).
  const torch::NoGradGuard no_grad;
  const auto decoded = attnkit::detail::decode_attention(
      q.detach().narrow(2, 4, 1).contiguous(), k.detach(), v.detach(), 1.0 / std::sqrt(8.0), {}, {},
      /*softcap=*/2.0, sinks.detach());
  EXPECT_TRUE(tensors_close("decode", decoded, expected.detach().narrow(2, 4, 1), 1e-12));

  // Kernels without sinks decline, by name; a named one says why.
  expect_error_containing(
      [&] { F::attention(q, k, v, AttentionOptions(options).kernel("fused_tiles")); },
      "kernel fused_tiles cannot run this: the fused_tiles kernel has no attention sinks");
  expect_error_containing(
      [&] { F::attention(q, k, v, AttentionOptions().sinks(torch::zeros({3}, dtype))); },
      "sinks must be a floating (4) tensor, one logit per query head of 4-D inputs");
}

// The split call in public: attention_forward's output and lse, and attention_backward from
// them. The keys in two uneven shards, each attended with the shard's part of a documents and
// causal mask and a relative bias, merge into the whole call's output and lse; each shard's
// backward from the merged forward gives its keys' and values' gradients, and the query's and
// the bias's add up: what ring attention runs, against autograd through the whole call.
TEST(Attention, SplitCallsOverKeyShardsMergeIntoTheWholeCall) {
  torch::manual_seed(22);
  const auto dtype = torch::kFloat64;
  const int64_t n = 12, split = 5;
  const auto q = torch::randn({2, 4, n, 8}, dtype).requires_grad_(true);
  const auto k = torch::randn({2, 2, n, 8}, dtype).requires_grad_(true);
  const auto v = torch::randn({2, 2, n, 8}, dtype).requires_grad_(true);
  const auto bias = torch::randn({4, 7}, dtype).requires_grad_(true);
  const auto document = torch::tensor({0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2});
  // The mask over keys [offset, offset + m): query i sees key j of its document, j <= i.
  const auto mask_from = [&](int64_t offset) {
    return Mask::from_function([document, offset](const torch::Tensor&, const torch::Tensor&,
                                                  const torch::Tensor& q_idx,
                                                  const torch::Tensor& kv_idx) {
      const auto key = kv_idx + offset;
      return key.le(q_idx) & document.index({q_idx}).eq(document.index({key}));
    });
  };
  const auto whole =
      AttentionOptions().mask(mask_from(0)).score_mod(score_mods::relative_position_bias(bias));
  // The reference: autograd through the whole call.
  const auto probe = torch::randn({2, 4, n, 8}, dtype);
  const auto reference = F::attention(q, k, v, whole);
  (reference * probe).sum().backward();
  // The whole split call: the same output, and its lse is the definition's.
  const auto forward = F::attention_forward(q, k, v, whole);
  EXPECT_FALSE(forward.out.requires_grad());
  EXPECT_TRUE(tensors_close("whole out", forward.out, reference.detach(), 1e-12));
  ASSERT_EQ(forward.lse.sizes(), (std::vector<int64_t>{2, 4, n}));
  const auto grads = F::attention_backward(q, k, v, forward, probe, whole);
  EXPECT_TRUE(tensors_close("whole grad q", grads.query, q.grad(), 1e-12));
  EXPECT_TRUE(tensors_close("whole grad k", grads.key, k.grad(), 1e-12));
  EXPECT_TRUE(tensors_close("whole grad v", grads.value, v.grad(), 1e-12));
  ASSERT_EQ(grads.score_tensors.size(), 1u);
  EXPECT_TRUE(tensors_close("whole grad bias", grads.score_tensors[0], bias.grad(), 1e-12));

  // Two shards of the keys, [0, 5) and [5, 12), each with its part of the mask (a bias that
  // reads positions would need its kv_idx counted from the shard's start, which the split
  // kernels' named score functions do not take yet): each shard's split call, merged.
  const std::vector<std::pair<int64_t, int64_t>> shards{{0, split}, {split, n}};
  std::vector<F::AttentionWithLse> parts;
  for (const auto& [begin, end] : shards) {
    parts.push_back(F::attention_forward(q, k.narrow(2, begin, end - begin),
                                         v.narrow(2, begin, end - begin),
                                         AttentionOptions().mask(mask_from(begin))));
  }
  const auto merged = F::merge_attention(parts);
  const auto plain = F::attention_forward(q, k, v, AttentionOptions().mask(mask_from(0)));
  EXPECT_TRUE(tensors_close("merged out", merged.out, plain.out, 1e-12));
  EXPECT_TRUE(tensors_close("merged lse", merged.lse, plain.lse, 1e-12));
  // Query 0 of the second shard sees no key there: its lse is +inf and its output zeros.
  EXPECT_TRUE(parts[1].lse.select(2, 0).isposinf().all().item<bool>());
  // Each shard's backward from the merged forward.
  const auto plain_grads =
      F::attention_backward(q, k, v, plain, probe, AttentionOptions().mask(mask_from(0)));
  auto grad_q = torch::zeros_like(q);
  std::vector<torch::Tensor> grad_k, grad_v;
  for (const auto& [begin, end] : shards) {
    const auto shard =
        F::attention_backward(q, k.narrow(2, begin, end - begin), v.narrow(2, begin, end - begin),
                              merged, probe, AttentionOptions().mask(mask_from(begin)));
    grad_q += shard.query;
    grad_k.push_back(shard.key);
    grad_v.push_back(shard.value);
  }
  EXPECT_TRUE(tensors_close("sharded grad q", grad_q, plain_grads.query, 1e-12));
  EXPECT_TRUE(tensors_close("sharded grad k", torch::cat(grad_k, 2), plain_grads.key, 1e-12));
  EXPECT_TRUE(tensors_close("sharded grad v", torch::cat(grad_v, 2), plain_grads.value, 1e-12));

  // What the split call refuses, by name.
  expect_error_containing(
      [&] {
        F::attention_forward(
            q, k, v,
            AttentionOptions().score_mod([](const torch::Tensor& s, const torch::Tensor&,
                                            const torch::Tensor&, const torch::Tensor&,
                                            const torch::Tensor&) { return s * 2; }));
      },
      "[attention_forward] score_mod: a C++ function, which only LibTorch's ops evaluate; a "
      "split call takes the named score functions and ScoreGraphs");
  expect_error_containing(
      [&] { F::attention_forward(q, k, v, AttentionOptions().dropout_p(0.1).training(true)); },
      "[attention_forward] dropout is not offered in a split call");
  expect_error_containing(
      [&] { F::attention_forward(q[0], k[0], v[0]); },
      "[attention_forward] query, key and value must be 4-D (b, h, n, hd), got [4, 12, 8], "
      "[2, 12, 8] and [2, 12, 8]");
  expect_error_containing([&] { F::attention_backward(q, k, v, plain, probe.narrow(2, 0, 3)); },
                          "[attention_backward] forward.out and grad_out must be (2, 4, 12, 8)");
  expect_error_containing([&] { F::merge_attention({}); },
                          "[merge_attention] needs at least one part");
  expect_error_containing(
      [&] {
        F::merge_attention({plain, {plain.out.narrow(2, 0, 3), plain.lse}});
      },
      "[merge_attention] part 1: out must be shaped as part 0's [2, 4, 12, 8]");
  const F::AttentionWithLse misshapen{plain.out, plain.lse, plain.out.narrow(2, 0, 3)};
  expect_error_containing(
      [&] {
        F::merge_attention({plain, misshapen});
      },
      "[merge_attention] part 1: out_for_backward must be shaped as its out [2, 4, 12, 8], got "
      "[2, 4, 3, 8]");
  expect_error_containing(
      [&] { F::attention_backward(q, k, v, misshapen, probe); },
      "[attention_backward] forward.out_for_backward must be shaped as forward.out [2, 4, 12, 8], "
      "got [2, 4, 3, 8]");
}

TEST(Attention, EveryBackendMatchesTheDefinitionWithMasksAndScoreFunctions) {
  torch::manual_seed(3);
  const auto dtype = torch::kFloat64;
  const auto slopes = torch::tensor({0.5, 0.25, 0.125, 0.0625}, dtype);
  // A learnable relative-position bias (distances clamped to +-3), captured by the function.
  const auto bias = torch::randn({kHeads, 7}, dtype).requires_grad_(true);
  const std::vector<ScoreCase> score_cases{
      {"none", {}, {}},
      {"alibi", score_mods::alibi(slopes),
       [&](torch::Tensor s, int64_t, int64_t h, int64_t i, int64_t j) {
         return s + slopes[h] * double(j - i);
       }},
      {"softcap", score_mods::softcap(0.7),
       [](torch::Tensor s, int64_t, int64_t, int64_t, int64_t) {
         return torch::tanh(s / 0.7) * 0.7;
       }},
      {"relative bias", score_mods::relative_position_bias(bias),
       [&](torch::Tensor s, int64_t, int64_t h, int64_t i, int64_t j) {
         return s + bias[h][std::clamp<int64_t>(j - i, -3, 3) + 3];
       }},
  };
  for (const auto& [n, m] : {std::pair<int64_t, int64_t>{13, 13}, {6, 17}}) {
    const auto q = torch::randn({kBatch, kHeads, n, 8}, dtype).requires_grad_(true);
    const auto k = torch::randn({kBatch, kKvHeads, m, 8}, dtype).requires_grad_(true);
    const auto v = torch::randn({kBatch, kKvHeads, m, 5}, dtype).requires_grad_(true);
    const auto probe = torch::randn({kBatch, kHeads, n, 5}, dtype);
    const auto gradients = [&](const torch::Tensor& out) {
      for (const auto& t : {q, k, v, bias}) {
        if (t.grad().defined())
          t.grad().zero_();
      }
      (out * probe).sum().backward();
      std::vector<torch::Tensor> grads;
      for (const auto& t : {q, k, v, bias})
        grads.push_back(t.grad().defined() ? t.grad().clone() : torch::zeros_like(t));
      return grads;
    };
    for (const auto& mask_case : mask_cases(n, m)) {
      for (const auto& score_case : score_cases) {
        const auto expected = reference_attention(q, k, v, mask_case, score_case.reference);
        const auto expected_grads = gradients(expected);
        for (const auto backend :
             {AttentionBackend::kMath, AttentionBackend::kChunked, AttentionBackend::kAuto}) {
          const std::string label = mask_case.name + " / " + score_case.name + " / " +
                                    attnkit::backend_name(backend) + " n=" + std::to_string(n) +
                                    " m=" + std::to_string(m);
          // Small tiles, so that every verdict (empty, full, partial) occurs.
          const auto options = AttentionOptions()
                                   .mask(mask_case.mask)
                                   .score_mod(score_case.score_mod)
                                   .backend(backend)
                                   .query_block_size(4)
                                   .key_block_size(5);
          const auto out = F::attention(q, k, v, options);
          EXPECT_TRUE(tensors_close(label + " output", out, expected, 1e-10));
          const auto grads = gradients(out);
          const char* names[] = {" dq", " dk", " dv", " dbias"};
          for (size_t t = 0; t < grads.size(); ++t)
            EXPECT_TRUE(tensors_close(label + names[t], grads[t], expected_grads[t], 1e-10));
        }
      }
    }
  }
}

TEST(Attention, Float32ThreeAndTwoDimensionalInputsAndAnExplicitScale) {
  torch::manual_seed(5);
  const auto q = torch::randn({3, 40, 16}), k = torch::randn({3, 70, 16}),
             v = torch::randn({3, 70, 16});
  const auto options = AttentionOptions()
                           .mask(Mask::key_padding(torch::tensor({70, 33, 1})))
                           .score_mod(score_mods::softcap(5.0))
                           .scale(0.3);
  const auto math =
      F::attention(q, k, v, AttentionOptions(options).backend(AttentionBackend::kMath));
  const auto chunked = F::attention(
      q, k, v, AttentionOptions(options).backend(AttentionBackend::kChunked).key_block_size(16));
  EXPECT_EQ(math.sizes(), q.sizes());
  EXPECT_TRUE(tensors_close("3-D float32 chunked", chunked, math,
                            attnkit::testing::agreement(torch::kFloat32)));
  const auto two_d = F::attention(q[1], k[1], v[1], AttentionOptions().mask(Mask::causal(30)));
  EXPECT_TRUE(tensors_close(
      "2-D", two_d,
      F::attention(q[1], k[1], v[1],
                   AttentionOptions().mask(Mask::causal(30)).backend(AttentionBackend::kMath)),
      attnkit::testing::agreement(torch::kFloat32)));
}

TEST(Attention, AutoTakesFusedForCausalMasksAndForInferenceByPaddedSegments) {
  const auto q = torch::randn({1, 2, 8, 4});
  const auto pick = [&](const AttentionOptions& options) {
    return F::choose_backend(q, q, q, options);
  };
  EXPECT_EQ(pick(AttentionOptions()), AttentionBackend::kFused);
  EXPECT_EQ(pick(AttentionOptions().mask(Mask::causal().sliding_window(2))),
            AttentionBackend::kFused);
  // Key padding on the CPU: the chunked kernel where a gradient is kept or the mask is causal;
  // LibTorch 2.x's SDPA by segments (sdpa_varlen) for a non-causal call that keeps none.
  const auto padding = AttentionOptions().mask(Mask::key_padding(torch::tensor({8})));
  EXPECT_EQ(pick(padding), attnkit::detail::libtorch_has_sdpa() ? AttentionBackend::kFused
                                                                : AttentionBackend::kChunked);
  const auto trained = q.clone().requires_grad_();
  EXPECT_EQ(F::choose_backend(trained, trained, trained, padding), AttentionBackend::kChunked);
  EXPECT_EQ(pick(AttentionOptions().mask(Mask::key_padding(torch::tensor({8})) & Mask::causal())),
            AttentionBackend::kChunked);
  EXPECT_EQ(pick(AttentionOptions().score_mod(score_mods::softcap(1.0))),
            AttentionBackend::kChunked);
  EXPECT_EQ(pick(AttentionOptions().backend(AttentionBackend::kMath)), AttentionBackend::kMath);
}

TEST(Attention, BadArgumentsNameWhatIsWrong) {
  const auto q = torch::randn({2, 2, 5, 4}), k = torch::randn({2, 2, 7, 4});
  const auto run = [&](const AttentionOptions& options) { F::attention(q, k, k, options); };
  // Masks of the wrong shape, dtype or range.
  expect_error_containing(
      [&] {
        run(AttentionOptions().mask(Mask::key_padding(torch::zeros({2, 6}, torch::kBool))));
      },
      "[attention] mask: key_padding must have shape (batch, num_keys) = (2, 7), got [2, 6]");
  expect_error_containing(
      [&] {
        run(AttentionOptions().mask(Mask::key_padding(torch::tensor({7, 8}))));
      },
      "[attention] mask: key_padding lengths must be in [0, 7] (the number of keys), got a length "
      "of 8");
  expect_error_containing(
      [] {
        Mask::key_padding(torch::tensor({3, -1}));
      },
      "[Mask::key_padding] lengths must be >= 0, got -1 at batch entry 1");
  expect_error_containing(
      [] {
        Mask::key_padding(torch::zeros({2, 3}));
      },
      "[Mask::key_padding] lengths must be a 1-D int64 tensor (b), got 2-D Float");
  expect_error_containing([] { Mask::causal(torch::zeros({2})); },
                          "[Mask::causal] query_offsets must be a (b) int64 tensor, got [2] Float");
  expect_error_containing(
      [] {
        Mask::causal(torch::tensor({int64_t{0}, int64_t{-2}}));
      },
      "[Mask::causal] query_offsets[1] must be >= 0, got -2");
  expect_error_containing(
      [&] { run(AttentionOptions().mask(Mask::causal(torch::tensor({int64_t{0}})))); },
      "[attention] mask: causal query_offsets must have shape (2) (the batch), got [1]");
  expect_error_containing(
      [&] {
        run(AttentionOptions().mask(Mask::key_padding(torch::tensor({7, 7, 7}))));
      },
      "[attention] mask: key_padding lengths must have shape (2) (the batch), got [3]");
  expect_error_containing(
      [] {
        Mask::from_tensor(torch::ones({5, 7}));
      },
      "[Mask::from_tensor] allowed must be a bool tensor (true = may attend), got Float");
  expect_error_containing(
      [&] {
        run(AttentionOptions().mask(Mask::from_tensor(torch::ones({3, 5, 7}, torch::kBool))));
      },
      "[attention] mask: the allowed tensor must broadcast to (batch, heads, num_queries, "
      "num_keys) = (2, 2, 5, 7), got [1, 3, 5, 7]");
  expect_error_containing(
      [&] { run(AttentionOptions().mask(Mask::documents(torch::zeros({5}, torch::kInt64)))); },
      "[attention] mask: documents needs self-attention (as many queries as keys), got 5 queries "
      "and 7 keys");
  expect_error_containing(
      [] { Mask::documents(torch::zeros({5})); },
      "[Mask::documents] document_ids must be an int64 tensor (n) or (b, n), got 1-D Float");
  expect_error_containing([] { Mask::causal(-1); }, "[Mask::causal] query_offset must be >= 0");
  expect_error_containing([] { Mask::key_padding(torch::tensor({1})).sliding_window(2); },
                          "[Mask::sliding_window] a sliding window restricts a causal mask");
  expect_error_containing([] { Mask::causal().sliding_window(0); },
                          "[Mask::sliding_window] window_size must be >= 1, got 0");
  // mask_mod and score_mod returning the wrong dtype or shape, on every backend.
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kChunked}) {
    SCOPED_TRACE(attnkit::backend_name(backend));
    const auto options = AttentionOptions().backend(backend);
    expect_error_containing(
        [&] {
          run(AttentionOptions(options).mask(Mask::from_function(
              [](auto, auto, auto qi, auto kv) { return (kv - qi).to(torch::kFloat); })));
        },
        "[attention] mask_mod must return a bool tensor, got Float");
    expect_error_containing(
        [&] {
          run(AttentionOptions(options).mask(Mask::from_function([](auto, auto, auto, auto) {
            return torch::ones({3, 2}, torch::kBool);
          })));
        },
        "[attention] mask_mod must return a tensor broadcastable to");
    expect_error_containing(
        [&] {
          run(AttentionOptions(options).score_mod(
              [](auto s, auto, auto, auto, auto) { return s.sum(-1); }));
        },
        "[attention] score_mod must return a tensor of the score's shape");
    expect_error_containing(
        [&] {
          run(AttentionOptions(options).score_mod(
              [](auto s, auto, auto, auto, auto) { return s.to(torch::kDouble); }));
        },
        "and dtype Float, got");
  }
  // A cross-attention key whose batch differs from the query's; heads that do not divide.
  expect_error_containing(
      [&] { F::attention(q, k.narrow(0, 0, 1), k.narrow(0, 0, 1)); },
      "[attention] key and value must have the query's batch size 2, got key [1, 2, 7, 4]");
  expect_error_containing(
      [&] {
        F::attention(torch::randn({2, 3, 5, 4}), k, k);
      },
      "[attention] key/value heads (2) must divide query heads (3)");
  // A forced backend that lacks what the problem needs; weights from another backend.
  // A demanded fused backend takes any mask on LibTorch 2.x (SDPA with the dense mask); 1.x
  // has no SDPA to take one.
  const auto padded = AttentionOptions().mask(Mask::key_padding(torch::tensor({7, 3})));
  if (TORCH_VERSION_MAJOR >= 2) {
    auto fused = padded;
    auto math = padded;
    EXPECT_TRUE(tensors_close("fused with key padding",
                              F::attention(q, k, k, fused.backend(AttentionBackend::kFused)),
                              F::attention(q, k, k, math.backend(AttentionBackend::kMath)), 1e-5));
  } else {
    expect_error_containing(
        [&] {
          auto fused = padded;
          run(fused.backend(AttentionBackend::kFused));
        },
        "[attention] backend fused cannot run this: the fused backend takes only causal and "
        "sliding-window masks on LibTorch 1.x (2.x takes any mask through its SDPA), not "
        "key_padding(lengths)");
  }
  expect_error_containing(
      [&] {
        run(AttentionOptions().backend(AttentionBackend::kFused).score_mod(score_mods::softcap(2)));
      },
      "the fused backend has no score functions (score_mod)");
  expect_error_containing(
      [&] {
        F::attention_with_weights(q, k, k, AttentionOptions().backend(AttentionBackend::kChunked));
      },
      "[attention_with_weights] the weights come from the math backend");
  expect_error_containing([&] { run(AttentionOptions().dropout_p(1.0)); },
                          "[attention] dropout_p must be in [0, 1), got 1");
}

TEST(MultiHeadAttentionMasks, PaddedRowsEqualEachSequenceAloneOnEveryBackend) {
  torch::manual_seed(9);
  const std::vector<int64_t> lengths{9, 4, 1};
  const auto x = torch::randn({3, 9, 8}, torch::kFloat64);
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kChunked,
                             AttentionBackend::kFused, AttentionBackend::kAuto}) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(attnkit::backend_name(backend) + (causal ? " causal" : " encoder"));
      attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2)
                                          .causal(causal)
                                          .backend(backend)
                                          .query_block_size(4)
                                          .key_block_size(3));
      mha->to(torch::kFloat64);
      // kFused in a module runs the padding mask, which its kernels do not take, on chunked.
      const auto padded = mha->forward(x, {}, {}, Mask::key_padding(torch::tensor(lengths)));
      for (size_t i = 0; i < lengths.size(); ++i) {
        const auto alone = mha(x.narrow(0, i, 1).narrow(1, 0, lengths[i]));
        EXPECT_TRUE(tensors_close("sequence " + std::to_string(i),
                                  padded.narrow(0, i, 1).narrow(1, 0, lengths[i]), alone,
                                  attnkit::testing::agreement(torch::kFloat64)));
      }
    }
  }
}

TEST(MultiHeadAttentionMasks, CrossAttentionAndForwardOfOneArgument) {
  torch::manual_seed(10);
  attnkit::MultiHeadAttention mha(
      attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2).causal(false).qkv_bias(true));
  const auto query = torch::randn({2, 5, 8}), memory = torch::randn({2, 11, 8});
  const auto lengths = torch::tensor({11, 6});
  const auto out = mha(query, memory, memory, Mask::key_padding(lengths));
  EXPECT_EQ(out.sizes(), query.sizes());
  // The same attention spelled out from the module's projections.
  const auto split = [](const torch::Tensor& t) { return t.view({2, -1, 2, 4}).transpose(1, 2); };
  const auto context = F::attention(split(mha->W_query(query)), split(mha->W_key(memory)),
                                    split(mha->W_value(memory)),
                                    AttentionOptions().mask(Mask::key_padding(lengths)));
  const auto expected = mha->out_proj(context.transpose(1, 2).reshape({2, 5, 8}));
  EXPECT_TRUE(tensors_close("cross-attention", out, expected,
                            attnkit::testing::agreement(torch::kFloat32)));
  auto weights = mha->forward_with_weights(query, memory, {}, Mask::key_padding(lengths)).weights;
  EXPECT_EQ(weights.sizes(), (std::vector<int64_t>{2, 2, 5, 11}));
  EXPECT_EQ(weights[1].narrow(-1, 6, 5).abs().sum().item<double>(), 0.0);  // padding unseen
  // forward(x) through Sequential and AnyModule (FORWARD_HAS_DEFAULT_ARGS).
  torch::nn::Sequential sequential(mha);
  EXPECT_TRUE(tensors_close("sequential", sequential->forward(query), mha(query), 0.0));
  // Bad calls name the argument.
  expect_error_containing([&] { mha(query, memory.narrow(0, 0, 1)); },
                          "[MultiHeadAttention::forward] key and value must have the query's "
                          "batch size 2, got key [1, 11, 8]");
  expect_error_containing([&] { mha->forward(query, {}, memory); },
                          "[MultiHeadAttention::forward] value given without key");
  expect_error_containing(
      [&] {
        mha(query, torch::randn({2, 11, 7}));
      },
      "[MultiHeadAttention::forward] key: expected last dimension d_in = 8");
}

// A padded batch through `module` (causal, d_in 8, float64): on every backend that takes a
// padding mask, each row's real positions equal that sequence alone, with the weights too;
// then left-padded rows (the padding first, as batched prompts are) decoded through a KV
// cache with the padding mask over the cache's positions equal each sequence alone.
template <typename Holder>
void expect_masked_module_rows_equal_each_sequence_alone(Holder module, torch::Device device) {
  torch::manual_seed(11);
  module->to(device, torch::kFloat64);
  const std::vector<int64_t> lengths{9, 5, 2};
  const auto length_tensor = torch::tensor(lengths, torch::kInt64).to(device);
  const int64_t b = 3, n = 9;
  const auto x = torch::randn({b, n, 8}, torch::kFloat64).to(device);
  const double tolerance = attnkit::testing::agreement(torch::kFloat64);
  const auto alone = [&](const torch::Tensor& row) { return module->forward(row); };
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kChunked,
                             AttentionBackend::kFused, AttentionBackend::kAuto}) {
    SCOPED_TRACE(attnkit::backend_name(backend));
    module->options.backend(backend);
    const auto padded = module->forward(x, {}, {}, Mask::key_padding(length_tensor));
    const auto weighted = module->forward_with_weights(x, {}, {}, Mask::key_padding(length_tensor));
    for (int64_t i = 0; i < b; ++i) {
      const auto expected = alone(x.narrow(0, i, 1).narrow(1, 0, lengths[i]));
      EXPECT_TRUE(tensors_close("right-padded row " + std::to_string(i),
                                padded.narrow(0, i, 1).narrow(1, 0, lengths[i]), expected,
                                tolerance));
      EXPECT_TRUE(tensors_close("with weights, row " + std::to_string(i),
                                weighted.context.narrow(0, i, 1).narrow(1, 0, lengths[i]), expected,
                                tolerance));
      EXPECT_EQ(weighted.weights[i]
                    .narrow(-1, lengths[i], n - lengths[i])
                    .abs()
                    .sum()
                    .template item<double>(),
                0.0);
    }
    // Left padding: row i's sequence sits at positions [n - lengths[i], n).
    const auto padding = torch::arange(n, x.options().dtype(torch::kInt64)).unsqueeze(0) <
                         (n - length_tensor).unsqueeze(1);  // (b, n), true = padding
    module->eval();
    auto cache = module->make_kv_cache(b, n);
    std::vector<torch::Tensor> pieces;
    for (const auto& [start, count] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 1}, {6, 2}, {8, 1}}) {
      const auto keys_so_far = Mask::key_padding(padding.narrow(1, 0, start + count));
      pieces.push_back(module->forward_with_cache(x.narrow(1, start, count), cache, keys_so_far));
    }
    const auto cached = torch::cat(pieces, 1);
    EXPECT_TRUE(tensors_close("cached left-padded batch", cached,
                              module->forward(x, {}, {}, Mask::key_padding(padding)), tolerance));
    for (int64_t i = 0; i < b; ++i) {
      const auto start = n - lengths[i];
      EXPECT_TRUE(tensors_close("cached left-padded row " + std::to_string(i),
                                cached.narrow(0, i, 1).narrow(1, start, lengths[i]),
                                alone(x.narrow(0, i, 1).narrow(1, start, lengths[i])), tolerance));
    }
    module->train();
  }
}

// The same on each device (CUDA where there is one).
class ModuleMasksDevices : public attnkit::testing::DeviceTest {};

TEST_P(ModuleMasksDevices, EveryMultiHeadModuleTakesPaddingMasksInForwardAndItsCache) {
  {
    SCOPED_TRACE("MultiHeadAttention");
    expect_masked_module_rows_equal_each_sequence_alone(
        attnkit::MultiHeadAttention(attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2)
                                        .query_block_size(4)
                                        .key_block_size(3)),
        device());
  }
  {
    SCOPED_TRACE("MultiHeadAttentionCombinedQKV");
    expect_masked_module_rows_equal_each_sequence_alone(
        attnkit::MultiHeadAttentionCombinedQKV(attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2)
                                                   .qkv_bias(true)
                                                   .query_block_size(4)),
        device());
  }
  {
    SCOPED_TRACE("GroupedQueryAttention");
    expect_masked_module_rows_equal_each_sequence_alone(
        attnkit::GroupedQueryAttention(attnkit::GroupedQueryAttentionOptions(8, 8, 0.0, 4, 2)
                                           .query_block_size(4)
                                           .key_block_size(3)),
        device());
  }
  {
    SCOPED_TRACE("MultiHeadLatentAttention");
    expect_masked_module_rows_equal_each_sequence_alone(
        attnkit::MultiHeadLatentAttention(attnkit::MultiHeadLatentAttentionOptions(8, 8, 0.0, 2)
                                              .latent_dim(4)
                                              .query_block_size(4)),
        device());
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(ModuleMasksDevices);

TEST(ModuleMasks, CrossAttentionWhereItMakesSenseAndClearRefusalsElsewhere) {
  torch::manual_seed(12);
  const auto query = torch::randn({2, 5, 8}), memory = torch::randn({2, 7, 8});
  const auto split = [](const torch::Tensor& t, int64_t heads) {
    return t.view({2, t.size(1), heads, -1}).transpose(1, 2);  // (b, n, d) -> (b, heads, n, hd)
  };
  const auto merge = [](const torch::Tensor& t) {
    return t.transpose(1, 2).reshape({2, t.size(2), -1});  // (b, h, n, hd) -> (b, n, d)
  };
  const auto padding = Mask::key_padding(torch::tensor({7, 3}));
  // GQA: keys and values of 2 heads from memory, shared by 4 query heads, under the causal mask
  // (query i sees memory positions <= i).
  attnkit::GroupedQueryAttention gqa(attnkit::GroupedQueryAttentionOptions(8, 8, 0.0, 4, 2));
  const auto gqa_expected = gqa->out_proj(merge(F::attention(
      split(gqa->W_query(query), 4), split(gqa->W_key(memory), 2), split(gqa->W_value(memory), 2),
      AttentionOptions().mask(Mask::causal() & padding))));
  EXPECT_TRUE(tensors_close("GroupedQueryAttention cross", gqa(query, memory, memory, padding),
                            gqa_expected, attnkit::testing::agreement(torch::kFloat32)));
  // MLA: keys and values up-projected from the latents of key and of value.
  attnkit::MultiHeadLatentAttention mla(
      attnkit::MultiHeadLatentAttentionOptions(8, 8, 0.0, 2).latent_dim(4));
  const auto values_from = torch::randn({2, 7, 8});
  const auto mla_expected = mla->out_proj(merge(F::attention(
      split(mla->W_query(query), 2), split(mla->W_UK(mla->W_DKV(memory)), 2),
      split(mla->W_UV(mla->W_DKV(values_from)), 2), AttentionOptions().mask(Mask::causal()))));
  EXPECT_TRUE(tensors_close("MultiHeadLatentAttention cross", mla(query, memory, values_from),
                            mla_expected, attnkit::testing::agreement(torch::kFloat32)));
  // forward(x) through Sequential (FORWARD_HAS_DEFAULT_ARGS) for all three.
  attnkit::MultiHeadAttentionCombinedQKV combined(
      attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2));
  torch::nn::Sequential stack(gqa, mla, combined);
  EXPECT_TRUE(tensors_close("Sequential", stack->forward(query), combined(mla(gqa(query))), 0.0));
  // One projection for q, k and v cannot read two inputs.
  expect_error_containing([&] { combined(query, memory); },
                          "[MultiHeadAttentionCombinedQKV::forward] key/value: this module "
                          "projects queries, keys and values from one input with one matrix, so "
                          "it does self-attention only; got key [2, 7, 8] and value none");
  expect_error_containing([&] { gqa(query, memory.narrow(0, 0, 1)); },
                          "[GroupedQueryAttention::forward] key and value must have the query's "
                          "batch size 2, got key [1, 7, 8]");
  expect_error_containing(
      [&] {
        mla(query, memory, torch::randn({2, 6, 8}));
      },
      "[MultiHeadLatentAttention::forward] key and value must have the same "
      "number of tokens");
  // A cached step reads a mask at the positions of its sequences, [0, 5) here: a mask that
  // does not fit them is refused before anything is written, on a rolling cache too.
  attnkit::GroupedQueryAttention windowed(
      attnkit::GroupedQueryAttentionOptions(8, 8, 0.0, 4, 2).sliding_window_size(3));
  windowed->eval();
  auto rolling = windowed->make_kv_cache(2, 16);
  expect_error_containing(
      [&] { windowed->forward_with_cache(query, rolling, padding); },
      "[GroupedQueryAttention::forward_with_cache] mask: key_padding lengths must be in [0, 5] "
      "(the number of keys), got a length of 7");
  EXPECT_EQ(rolling.size(), 0);  // nothing appended by the refused call
}

TEST(ModuleMasks, StateDictsCarryThePythonMaskBufferThatTheModuleDoesNotKeep) {
  attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(4, 4, 6, 0.0, 2));
  EXPECT_TRUE(mha->named_buffers().is_empty());  // no n^2 buffer in the module
  // The state dict has the book's `mask` as the Python constructor makes it, so Python's
  // strict load takes it; a strict load here accepts and ignores it.
  auto dict = attnkit::state_dict(*mha);
  EXPECT_TRUE(torch::equal(dict["mask"], torch::triu(torch::ones({6, 6}), 1)));
  attnkit::MultiHeadAttention loaded(attnkit::MultiHeadAttentionOptions(4, 4, 6, 0.0, 2));
  const auto result = attnkit::load_state_dict(*loaded, dict);  // strict
  EXPECT_EQ(result.ignored_keys, std::vector<std::string>{"mask"});
  EXPECT_TRUE(result.unexpected_keys.empty());
  EXPECT_TRUE(result.missing_keys.empty());
  EXPECT_TRUE(tensors_close("loaded weights", loaded->W_query->weight, mha->W_query->weight, 0.0));
  // Files written before the key was made at save time (no `mask`) still load strictly.
  dict.erase("mask");
  EXPECT_TRUE(attnkit::load_state_dict(*loaded, dict).ignored_keys.empty());
  // Nested, as in a model: the key under the submodule's path, in the parameters' dtype.
  torch::nn::Sequential model(
      attnkit::MultiHeadAttentionCombinedQKV(attnkit::MultiHeadAttentionOptions(4, 4, 6, 0.0, 2)));
  model->to(torch::kDouble);
  auto nested = attnkit::state_dict(*model);
  ASSERT_TRUE(nested.contains("0.mask"));
  EXPECT_EQ(nested["0.mask"].scalar_type(), torch::kDouble);
  EXPECT_EQ(attnkit::load_state_dict(*model, nested).ignored_keys,
            std::vector<std::string>{"0.mask"});
  nested.insert("1.mask", torch::ones({2}));
  expect_error_containing([&] { attnkit::load_state_dict(*model, nested); },
                          "unexpected key '1.mask'");
}

// ---- block masks (attnkit::create_block_mask) ----------------------------------------------

// FlexAttention's rule, from the dense truth: a tile is full when every one of its
// q_block x kv_block entries (the short last block padded with masked ones) may attend.
TileKind expected_kind(const torch::Tensor& truth, int64_t b, int64_t h, int64_t i, int64_t j,
                       int64_t qb, int64_t kb) {
  const int64_t n = truth.size(2), m = truth.size(3);
  const auto tile = truth[b][h]
                        .narrow(0, i * qb, std::min(qb, n - i * qb))
                        .narrow(1, j * kb, std::min(kb, m - j * kb));
  const int64_t allowed = tile.sum().item<int64_t>();
  return allowed == 0         ? TileKind::kEmpty
         : allowed == qb * kb ? TileKind::kFull
                              : TileKind::kPartial;
}

// The block lists agree with the verdicts: counts, indices in FlexAttention's order (the
// row's blocks of that kind ascending, then the others ascending), to_dense and sparsity.
void expect_lists_agree(const attnkit::BlockMask& bm) {
  const int64_t nq = bm.num_q_blocks(), nk = bm.num_kv_blocks();
  const auto dense = bm.to_dense();
  int64_t visited = 0;
  for (int64_t b = 0; b < bm.batch(); ++b) {
    for (int64_t h = 0; h < bm.heads(); ++h) {
      for (int64_t i = 0; i < nq; ++i) {
        for (const auto kind : {TileKind::kPartial, TileKind::kFull}) {
          const bool partial = kind == TileKind::kPartial;
          const auto& counts = partial ? bm.kv_num_blocks() : bm.full_kv_num_blocks();
          const auto& indices = partial ? bm.kv_indices() : bm.full_kv_indices();
          std::vector<int32_t> expected, rest;
          for (int64_t j = 0; j < nk; ++j)
            (bm.kind(b, h, i, j) == kind ? expected : rest).push_back(static_cast<int32_t>(j));
          ASSERT_EQ(counts[b][h][i].item<int32_t>(), static_cast<int32_t>(expected.size()));
          expected.insert(expected.end(), rest.begin(), rest.end());
          EXPECT_TRUE(torch::equal(indices[b][h][i], torch::tensor(expected, torch::kInt32)));
        }
        for (int64_t j = 0; j < nk; ++j) {
          const bool seen = bm.kind(b, h, i, j) != TileKind::kEmpty;
          visited += seen;
          EXPECT_EQ(dense[b][h][i][j].item<bool>(), seen);
        }
      }
    }
  }
  const double total = static_cast<double>(bm.batch() * bm.heads() * nq * nk);
  EXPECT_NEAR(bm.sparsity(), 100.0 * (1.0 - visited / total), 1e-9);
}

TEST(BlockMask, BlockListsAgreeWithTheDenseMaskForRandomMasksAndBlockSizes) {
  torch::manual_seed(17);
  std::mt19937 random(23);
  for (const auto& [n, m] : {std::pair<int64_t, int64_t>{13, 13}, {6, 17}, {40, 40}}) {
    for (const auto& c : mask_cases(n, m)) {
      const auto truth = truth_tensor(c, n, m);
      for (int trial = 0; trial < 3; ++trial) {
        const int64_t qb = 1 + random() % 9, kb = 1 + random() % 9;
        SCOPED_TRACE(c.name + " n=" + std::to_string(n) + " m=" + std::to_string(m) + " blocks " +
                     std::to_string(qb) + "x" + std::to_string(kb));
        const auto bm = attnkit::create_block_mask(c.mask, kBatch, kHeads, n, m,
                                                   attnkit::BlockMaskOptions().block_size(qb, kb));
        ASSERT_EQ(bm.num_q_blocks(), (n + qb - 1) / qb);
        ASSERT_EQ(bm.kv_indices().sizes(),
                  (std::vector<int64_t>{kBatch, kHeads, bm.num_q_blocks(), bm.num_kv_blocks()}));
        EXPECT_EQ(bm.kv_indices().scalar_type(), torch::kInt32);
        for (int64_t b = 0; b < kBatch; ++b)
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t i = 0; i < bm.num_q_blocks(); ++i)
              for (int64_t j = 0; j < bm.num_kv_blocks(); ++j)
                ASSERT_EQ(bm.kind(b, h, i, j), expected_kind(truth, b, h, i, j, qb, kb))
                    << "tile (" << b << ", " << h << ", " << i << ", " << j << ")";
        expect_lists_agree(bm);
      }
    }
  }
}

TEST(BlockMask, AttentionFromABlockMaskEqualsAttentionFromTheMaskOnEveryBackend) {
  torch::manual_seed(29);
  const auto dtype = torch::kFloat64;
  const int64_t n = 40;
  const auto q = torch::randn({kBatch, kHeads, n, 8}, dtype).requires_grad_(true);
  const auto k = torch::randn({kBatch, kKvHeads, n, 8}, dtype).requires_grad_(true);
  const auto v = torch::randn({kBatch, kKvHeads, n, 5}, dtype).requires_grad_(true);
  const auto probe = torch::randn({kBatch, kHeads, n, 5}, dtype);
  const auto run = [&](const AttentionOptions& options) {
    for (const auto& t : {q, k, v}) {
      if (t.grad().defined())
        t.grad().zero_();
    }
    const auto out = F::attention(q, k, v, options);
    (out * probe).sum().backward();
    return std::vector<torch::Tensor>{out.detach(), q.grad().clone(), k.grad().clone(),
                                      v.grad().clone()};
  };
  const auto ids = document_ids(n);
  const std::vector<std::pair<std::string, Mask>> masks{
      {"causal", Mask::causal()},
      {"window", Mask::causal().sliding_window(7)},
      {"causal documents", Mask::documents(ids, true)},
      {"padding & causal", Mask::key_padding(torch::tensor({n, int64_t{23}})) & Mask::causal()},
      {"mask_mod of the head", Mask::from_function([](auto, auto h, auto q_idx, auto kv) {
         return (q_idx - kv) % (h + 2) == 0;
       })},
  };
  for (const auto& [name, mask] : masks) {
    // The problem's own shape, and with B and H broadcast where the mask allows it.
    std::vector<attnkit::BlockMask> block_masks;
    block_masks.push_back(attnkit::create_block_mask(mask, kBatch, kHeads, n, n,
                                                     attnkit::BlockMaskOptions().block_size(8, 6)));
    if (name == "causal" || name == "window")
      block_masks.push_back(
          attnkit::create_block_mask(mask, 1, 1, n, n, attnkit::BlockMaskOptions().block_size(16)));
    for (const auto backend :
         {AttentionBackend::kMath, AttentionBackend::kChunked, AttentionBackend::kAuto}) {
      const auto expected = run(AttentionOptions().mask(mask).backend(AttentionBackend::kMath));
      for (const auto& bm : block_masks) {
        const std::string label = name + " / " + attnkit::backend_name(backend) + " / " +
                                  bm.to_string().substr(0, bm.to_string().find('\n'));
        // key_block_size 12: two of the 6-key blocks are computed together where they agree.
        const auto got = run(AttentionOptions().block_mask(bm).backend(backend).key_block_size(12));
        const char* what[] = {" output", " dq", " dk", " dv"};
        for (size_t t = 0; t < got.size(); ++t)
          EXPECT_TRUE(tensors_close(label + what[t], got[t], expected[t], 1e-10));
      }
    }
  }
  // One block mask reused by the layers of a stack, as a model does each step.
  const auto bm = attnkit::create_block_mask(Mask::documents(ids, true), kBatch, 1, n, n);
  auto x = q.detach();
  auto y = q.detach();
  for (int layer = 0; layer < 3; ++layer) {
    x = F::attention(x, x, x, AttentionOptions().block_mask(bm));
    y = F::attention(
        y, y, y,
        AttentionOptions().mask(Mask::documents(ids, true)).backend(AttentionBackend::kMath));
  }
  EXPECT_TRUE(tensors_close("three layers with one block mask", x, y, 1e-10));

  // Through a module's mask argument, under its own causal mask: one block mask per step.
  attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(8, 8, n, 0.0, 2)
                                      .backend(AttentionBackend::kChunked)
                                      .query_block_size(8));
  const auto tokens = torch::randn({kBatch, n, 8}, dtype);
  mha->to(dtype);
  const auto padding = Mask::key_padding(torch::tensor({n, int64_t{17}}));
  const auto per_step = attnkit::create_block_mask(padding, kBatch, 1, n, n,
                                                   attnkit::BlockMaskOptions().block_size(8));
  ASSERT_NE(Mask::from_block_mask(per_step).block_mask(), nullptr);
  EXPECT_EQ(padding.block_mask(), nullptr);
  EXPECT_TRUE(tensors_close("module with a block mask",
                            mha->forward(tokens, {}, {}, Mask::from_block_mask(per_step)),
                            mha->forward(tokens, {}, {}, padding), 1e-10));
  EXPECT_EQ(Mask::from_block_mask(per_step).to_string(), "block_mask(key_padding(lengths))");
  expect_error_containing(
      [&] { mha->forward(tokens.narrow(1, 0, 30), {}, {}, Mask::from_block_mask(per_step)); },
      "block_mask was made for (B, H, Q_LEN, KV_LEN) = (2, 1, 40, 40) on cpu, but the attention "
      "is (batch, heads, num_queries, num_keys) = (2, 2, 30, 30)");
}

TEST(BlockMask, SummaryAndBadArgumentsNameWhatIsWrong) {
  const auto bm = attnkit::create_block_mask(Mask::causal(), 1, 1, 256, 256);
  EXPECT_EQ(bm.num_q_blocks(), 2);
  EXPECT_DOUBLE_EQ(bm.sparsity(), 25.0);  // of 2 x 2 tiles, the one above the diagonal
  EXPECT_TRUE(
      torch::equal(bm.full_kv_num_blocks().flatten(), torch::tensor({0, 1}, torch::kInt32)));
  EXPECT_TRUE(torch::equal(bm.kv_num_blocks().flatten(), torch::tensor({1, 1}, torch::kInt32)));
  EXPECT_EQ(bm.to_string(),
            "BlockMask(shape=(1, 1, 256, 256), block_size=(128, 128), sparsity=25.00%, "
            "mask=causal(query_offset=0), device=cpu)\n  ~.\n  #~");
  EXPECT_FALSE(attnkit::BlockMask().defined());

  const auto q = torch::randn({2, 4, 256, 8});
  expect_error_containing(
      [&] {
        F::attention(q.narrow(2, 0, 200), q.narrow(2, 0, 200), q.narrow(2, 0, 200),
                     AttentionOptions().block_mask(bm));
      },
      "[attention] block_mask was made for (B, H, Q_LEN, KV_LEN) = (1, 1, 256, 256) on cpu, but "
      "the attention is (batch, heads, num_queries, num_keys) = (2, 4, 200, 200) on cpu");
  const auto per_head = attnkit::create_block_mask(Mask::causal(), 1, 3, 256, 256);
  expect_error_containing([&] { F::attention(q, q, q, AttentionOptions().block_mask(per_head)); },
                          "made for (B, H, Q_LEN, KV_LEN) = (1, 3, 256, 256)");
  expect_error_containing(
      [&] { F::attention(q, q, q, AttentionOptions().block_mask(bm).mask(Mask::causal())); },
      "[attention] pass the mask either as mask(...) or inside block_mask(...), not both");
  expect_error_containing([] { Mask::from_block_mask(attnkit::BlockMask()); },
                          "[Mask::from_block_mask] an empty BlockMask; make one with "
                          "create_block_mask");
  expect_error_containing([] { attnkit::create_block_mask(Mask::causal(), 0, 1, 8, 8); },
                          "[create_block_mask] B and H must be >= 1 (1 broadcasts), got B 0");
  expect_error_containing(
      [] { attnkit::create_block_mask(Mask::causal(), 1, 1, 8, 0); },
      "[create_block_mask] Q_LEN and KV_LEN must be >= 1, got Q_LEN 8 and KV_LEN 0");
  expect_error_containing(
      [] {
        attnkit::create_block_mask(Mask::causal(), 1, 1, 8, 8,
                                   attnkit::BlockMaskOptions().block_size(16, 0));
      },
      "[create_block_mask] block_size must be >= 1, got (16, 0)");
  // A mask whose tensors are for another batch, or another device, is refused by the mask.
  expect_error_containing(
      [] {
        attnkit::create_block_mask(Mask::key_padding(torch::tensor({3, 5})), 3, 1, 8, 8);
      },
      "[create_block_mask] mask: key_padding lengths must have shape (3) (the batch), got [2]");
  expect_error_containing([] { attnkit::BlockMask().sparsity(); },
                          "[BlockMask::sparsity] an empty BlockMask");
  if (torch::cuda::is_available()) {
    const auto on_gpu = attnkit::create_block_mask(
        Mask::causal(), 1, 1, 256, 256, attnkit::BlockMaskOptions().device(torch::kCUDA));
    EXPECT_EQ(on_gpu.kv_indices().device().type(), torch::kCUDA);
    expect_error_containing([&] { F::attention(q, q, q, AttentionOptions().block_mask(on_gpu)); },
                            "on cuda:0, but the attention is");
  }
}

// A block mask rebuilt from another's lists (what the Python operators receive) judges every
// tile alike and gives the same attention; each bad list is refused by name.
TEST(BlockMask, FromKvBlocksRebuildsTheListsAndRefusesBadOnes) {
  const auto ids = torch::repeat_interleave(torch::arange(3), torch::tensor({70, 100, 86}));
  const auto mask = Mask::documents(ids, /*causal=*/true);
  const auto made =
      attnkit::create_block_mask(mask, 1, 1, 256, 256, attnkit::BlockMaskOptions().block_size(64));
  const auto rebuilt = attnkit::BlockMask::from_kv_blocks(
      made.kv_num_blocks(), made.kv_indices().to(torch::kInt64), made.full_kv_num_blocks(),
      made.full_kv_indices(), 256, 256, 64, 64, mask);
  EXPECT_TRUE(torch::equal(made.kv_num_blocks(), rebuilt.kv_num_blocks()));
  EXPECT_TRUE(torch::equal(made.kv_indices(), rebuilt.kv_indices()));
  EXPECT_TRUE(torch::equal(made.full_kv_num_blocks(), rebuilt.full_kv_num_blocks()));
  EXPECT_TRUE(torch::equal(made.full_kv_indices(), rebuilt.full_kv_indices()));
  const auto q = torch::randn({1, 2, 256, 8});
  EXPECT_TRUE(torch::allclose(F::attention(q, q, q, AttentionOptions().block_mask(made)),
                              F::attention(q, q, q, AttentionOptions().block_mask(rebuilt))));
  // Without full lists every listed tile is partial: the same attention, more evaluation.
  const auto partial_only =
      attnkit::BlockMask::from_kv_blocks(made.kv_num_blocks() + made.full_kv_num_blocks(),
                                         made.to_dense()
                                             .to(torch::kInt32)
                                             .argsort(
                                                 /*dim=*/-1, /*descending=*/true)
                                             .to(torch::kInt32),
                                         {}, {}, 256, 256, 64, 64, mask);
  EXPECT_TRUE(torch::allclose(F::attention(q, q, q, AttentionOptions().block_mask(made)),
                              F::attention(q, q, q, AttentionOptions().block_mask(partial_only)),
                              1e-5, 1e-6));

  const auto num = made.kv_num_blocks(), idx = made.kv_indices();
  const auto from = [&](const torch::Tensor& n, const torch::Tensor& i, const torch::Tensor& fn,
                        const torch::Tensor& fi, int64_t q_len = 256) {
    attnkit::BlockMask::from_kv_blocks(n, i, fn, fi, q_len, 256, 64, 64, mask);
  };
  expect_error_containing([&] { from(num, idx, made.full_kv_num_blocks(), {}); },
                          "[BlockMask::from_kv_blocks] full_kv_num_blocks and full_kv_indices "
                          "come together");
  expect_error_containing([&] { from(num, idx, {}, {}, 300); },
                          "kv_num_blocks must be (B, H, 5) for q_len 300 in blocks of 64, got "
                          "[1, 1, 4]");
  expect_error_containing([&] { from(num.to(torch::kFloat), idx, {}, {}); },
                          "kv_num_blocks must be int32 or int64, got Float");
  expect_error_containing([&] { from(num, idx.narrow(3, 0, 2), {}, {}); },
                          "kv_indices must be (1, 1, 4, >= 4) for kv_len 256 in blocks of 64, got "
                          "[1, 1, 4, 2]");
  expect_error_containing([&] { from(num + 9, idx, {}, {}); },
                          "kv_num_blocks must be in [0, 4] (the key blocks), got 10 at row 0");
  expect_error_containing([&] { from(num, idx + 4, {}, {}); },
                          "kv_indices must be in [0, 4), got 4 at row 0");
  expect_error_containing([&] { from(num, idx, num, idx); },
                          "[BlockMask::from_kv_blocks] key block 0 of row 0 is listed twice "
                          "(full_kv_indices)");
}

// A score function as data: parsed, printed, evaluated as the C++ function it stands for,
// with gradients to its captured tensor; each malformed line refused by line and name.
TEST(ScoreGraph, EvaluatesAsTheFunctionItStandsForAndRefusesBadText) {
  const auto f64 = torch::dtype(torch::kDouble);
  const auto bias = torch::randn({2, 9}, f64.requires_grad(true));
  // 5 tanh(score / 5) + bias[h, clamp(kv_idx - q_idx, -4, 4) + 4]
  const std::string text =
      "div %0 f:5\ntanh %5\nmul f:5 %6\nsub %4 %3\nclamp %8 i:-4 i:4\nadd %9 i:4\n"
      "index $0 %2 %10\nadd %7 %11\n";
  const auto graph = attnkit::ScoreGraph::parse(text);
  EXPECT_EQ(graph.to_string(), text);
  EXPECT_EQ(graph.num_tensors(), 1);
  const attnkit::ScoreMod by_hand = [&](const torch::Tensor& s, const torch::Tensor&,
                                        const torch::Tensor& h, const torch::Tensor& q,
                                        const torch::Tensor& kv) {
    return 5.0 * torch::tanh(s / 5.0) + bias.index({h, torch::clamp(kv - q, -4, 4) + 4});
  };
  const auto run = [&](const attnkit::ScoreMod& score_mod, AttentionBackend backend) {
    torch::manual_seed(3);
    std::vector<torch::Tensor> qkv;
    for (int i = 0; i < 3; ++i)
      qkv.push_back(torch::randn({1, 2, 20, 4}, f64.requires_grad(true)));
    const auto out =
        F::attention(qkv[0], qkv[1], qkv[2],
                     AttentionOptions().mask(Mask::causal()).score_mod(score_mod).backend(backend));
    qkv.push_back(bias);
    auto grads = torch::autograd::grad({out.square().sum()}, qkv);
    grads.insert(grads.begin(), out);
    return grads;
  };
  const auto from_graph = run(graph.bind({bias}), AttentionBackend::kChunked);
  const auto reference = run(by_hand, AttentionBackend::kMath);
  for (size_t i = 0; i < from_graph.size(); ++i)
    EXPECT_TRUE(torch::allclose(from_graph[i], reference[i], 1e-10, 1e-12)) << "output/grad " << i;

  // An additive graph (ALiBi's slopes[h] * (kv_idx - q_idx)) binds as an additive score, which
  // a demanded fused backend runs on LibTorch 2.x's SDPA with the bias as a float mask; the
  // softcap above and a bias that reads the score do not.
  const auto alibi = attnkit::ScoreGraph::parse("sub %4 %3\nindex $0 %2\nmul %6 %5\nadd %0 %7\n");
  ASSERT_TRUE(alibi.additive_bias().has_value());
  EXPECT_EQ(alibi.additive_bias()->to_string(), "sub %4 %3\nindex $0 %2\nmul %6 %5\n");
  EXPECT_TRUE(attnkit::ScoreGraph::parse("sub %4 %3\nadd %5 %0").additive_bias().has_value());
  EXPECT_FALSE(graph.additive_bias().has_value());
  EXPECT_FALSE(attnkit::ScoreGraph::parse("mul %0 %0\nadd %0 %5").additive_bias().has_value());
  EXPECT_FALSE(attnkit::ScoreGraph::parse("add %0 $0").additive_bias().has_value());
  const auto slopes = torch::rand({2}, f64);
  EXPECT_NE(alibi.bind({slopes}).target<attnkit::detail::AdditiveScore>(), nullptr);
  EXPECT_EQ(graph.bind({bias}).target<attnkit::detail::AdditiveScore>(), nullptr);
  {
    torch::manual_seed(4);
    const auto q = torch::randn({1, 2, 20, 4}, f64), k = torch::randn({1, 2, 20, 4}, f64),
               v = torch::randn({1, 2, 20, 4}, f64);
    const bool sdpa = TORCH_VERSION_MAJOR >= 2;
    F::KernelRecord record;
    const auto out =
        F::attention(q, k, v,
                     AttentionOptions()
                         .mask(Mask::causal())
                         .score_mod(alibi.bind({slopes}))
                         .backend(sdpa ? AttentionBackend::kFused : AttentionBackend::kChunked));
    EXPECT_EQ(record.runs().back().kernel, sdpa ? "sdpa_masked" : "fused_tiles");
    const attnkit::ScoreMod alibi_by_hand = [&](const torch::Tensor& s, const torch::Tensor&,
                                                const torch::Tensor& h, const torch::Tensor& q_idx,
                                                const torch::Tensor& kv_idx) {
      return s + slopes.index({h}) * (kv_idx - q_idx);
    };
    const auto expected = F::attention(q, k, v,
                                       AttentionOptions()
                                           .mask(Mask::causal())
                                           .score_mod(alibi_by_hand)
                                           .backend(AttentionBackend::kMath));
    EXPECT_TRUE(torch::allclose(out, expected, 1e-10, 1e-12));
  }

  const auto parse = [](const std::string& t) { attnkit::ScoreGraph::parse(t); };
  expect_error_containing([&] { parse("add %0 i:1\nfoo %0"); },
                          "[ScoreGraph::parse] line 2: unknown operation 'foo'; known: abs,");
  expect_error_containing([&] { parse("add %0 %7"); },
                          "line 1: operand '%7' names no earlier value (there are 5)");
  expect_error_containing([&] { parse("add %0"); }, "line 1: add takes 2 operand(s), got 1");
  expect_error_containing([&] { parse("add %0 f:x"); }, "operand 'f:x' is not a number");
  expect_error_containing([&] { parse("add %0 _"); },
                          "'_' is an index's whole dimension or clamp's missing bound");
  expect_error_containing([&] { parse("add %0 #1"); }, "operand '#1' is none of %N, $N");
  expect_error_containing([&] { parse("\n"); }, "a score graph needs at least one operation");
  expect_error_containing([&] { graph.bind({}); },
                          "[ScoreGraph::bind] the graph reads 1 captured tensor(s), got 0");
}

// The graphs that Python's tracer makes of a softcap, ALiBi and a relative-position table
// (attnkit's _score_graph.trace of the FlexAttention examples) bind as score variants that the
// fused tile kernel evaluates itself, and give its answer; near misses bind as general graphs,
// which the fused tile kernel compiles for its rows.
TEST(ScoreGraph, TheNamedFunctionsBindAsTheirVariants) {
  // float64 throughout, so that the kernels agree to rounding: in float32 the near miss with
  // q - kv (scores up to +150) differs from the math core by float32's own noise, which moves
  // with the BLAS's summation order between runs (up to 1.4e-5 seen).
  const auto f64 = torch::kFloat64;
  const auto slopes = torch::rand({4}, f64), table = torch::rand({4, 21}, f64);
  const auto kind_of = [](const attnkit::ScoreMod& mod) {
    const auto variant = attnkit::detail::score_variant_of(mod);
    return std::string(variant ? variant->name() : "no variant");
  };
  const auto graph = [](const std::string& text) { return attnkit::ScoreGraph::parse(text); };
  const std::vector<std::tuple<std::string, std::vector<torch::Tensor>, std::string>> cases{
      {"div %0 f:30.0\ntanh %5\nmul f:30.0 %6", {}, "softcap"},
      {"div %0 f:30.0\ntanh %5\nmul %6 f:30.0", {}, "softcap"},
      {"index $0 %2\nsub %4 %3\nmul %5 %6\nadd %0 %7", {slopes}, "alibi"},
      {"sub %4 %3\nindex $0 %2\nmul %6 %5\nadd %0 %7", {slopes}, "alibi"},
      {"sub %4 %3\nclamp %5 i:-10 i:10\nadd %6 i:10\nindex $0 %2 %7\nadd %0 %8",
       {table},
       "relative_bias"},
      // Near misses: another cap inside, q - kv, a clamp that is not the table's width.
      {"div %0 f:30.0\ntanh %5\nmul %6 f:20.0", {}, "graph"},
      {"index $0 %2\nsub %3 %4\nmul %5 %6\nadd %0 %7", {slopes}, "graph"},
      {"sub %4 %3\nclamp %5 i:-9 i:9\nadd %6 i:9\nindex $0 %2 %7\nadd %0 %8", {table}, "graph"}};
  torch::manual_seed(3);
  const auto q = torch::randn({1, 4, 150, 8}, f64), k = torch::randn({1, 4, 150, 8}, f64),
             v = torch::randn({1, 4, 150, 8}, f64);
  for (const auto& [text, tensors, kind] : cases) {
    SCOPED_TRACE(text);
    const auto mod = graph(text).bind(tensors);
    EXPECT_EQ(kind_of(mod), kind);
    // Bound as a variant or not, the kernels that run it agree with the math core.
    const auto options = AttentionOptions().mask(Mask::causal()).score_mod(mod);
    F::KernelRecord record;
    const auto out = F::attention(q, k, v, options);
    EXPECT_EQ(record.runs().at(0).kernel, "fused_tiles");
    const auto expected = F::attention(q, k, v, AttentionOptions(options).kernel("math"));
    EXPECT_TRUE(torch::allclose(out, expected, 1e-10, 1e-10));
  }
}

// PyTorch's own create_block_mask (2.5 and later) on the same masks:
// scripts/block_mask_reference.py.
TEST(BlockMaskReference, EqualsPyTorchsCreateBlockMask) {
  const auto file = ::testing::TempDir() + "block_masks_pytorch.pt";
  const auto [status, output] = attnkit::testing::run_leg_python(
      std::string(attnkit::testing::kSourceDir) + "/scripts/block_mask_reference.py",
      "--out " + file);
#if TORCH_VERSION_MAJOR < 2
  if (WEXITSTATUS(status) == 3)
    GTEST_SKIP() << "PyTorch 1.x has no flex_attention: this check runs on the 2.x leg\n" << output;
#endif
  ASSERT_EQ(status, 0) << output;
  const auto golden = attnkit::read_state_dict(file);
  int compared = 0;
  for (const int64_t n : {256, 512, 300, 1000}) {
    const auto key = [n](const std::string& what) { return what + "/n" + std::to_string(n); };
    const auto ids = golden[key("inputs/ids")];
    const auto lengths = golden[key("inputs/lengths")];
    const auto prefix = Mask::from_function([](auto, auto, auto, auto kv) { return kv < 70; });
    const std::vector<std::tuple<std::string, Mask, int64_t>> cases{
        {"causal", Mask::causal(), 1},
        {"window", Mask::causal().sliding_window(96), 1},
        {"documents", Mask::documents(ids), 1},
        {"prefix_lm", Mask::causal() | prefix, 1},
        {"key_padding", Mask::key_padding(lengths), 2},
        {"causal_and_padding", Mask::causal() & Mask::key_padding(lengths), 2},
        {"causal_documents", Mask::documents(ids, true), 1},
    };
    for (const auto& [name, mask, batch] : cases) {
      for (const int64_t block : {64, 128}) {
        const std::string c = name + "/n" + std::to_string(n) + "/b" + std::to_string(block);
        SCOPED_TRACE(c);
        const auto bm = attnkit::create_block_mask(mask, batch, 1, n, n,
                                                   attnkit::BlockMaskOptions().block_size(block));
        // The same tiles, partial and full, at every length (the last, short block is never
        // full in either). sparsity() agrees at multiples of the block: PyTorch counts
        // elements, a short block as a whole one (-9.2% for causal at n 300, block 128).
        EXPECT_TRUE(torch::equal(bm.to_dense(), golden[c + "/dense"]));
        if (n % block == 0) {
          EXPECT_NEAR(bm.sparsity(), golden[c + "/sparsity"].item<double>(), 1e-9);
        }
        EXPECT_TRUE(torch::equal(bm.kv_num_blocks(), golden[c + "/kv_num_blocks"]));
        EXPECT_TRUE(torch::equal(bm.full_kv_num_blocks(), golden[c + "/full_kv_num_blocks"]));
        EXPECT_TRUE(torch::equal(bm.kv_indices(), golden[c + "/kv_indices"]));
        EXPECT_TRUE(torch::equal(bm.full_kv_indices(), golden[c + "/full_kv_indices"]));
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 56);
}

// ---- against scripts/mask_reference.py and PyTorch ---------------------------------------

const std::string kMaskReference =
    std::string(attnkit::testing::kSourceDir) + "/scripts/mask_reference.py";

attnkit::StateDict mask_golden() {
  return attnkit::read_state_dict(std::string(attnkit::testing::kSourceDir) +
                                  "/data/golden/masks/reference.pt");
}

// The mask scripts/mask_reference.py names `name`, from the inputs of its shape.
Mask reference_mask(const std::string& name, const attnkit::StateDict& golden,
                    const std::string& shape, int64_t n, int64_t m,
                    torch::Device device = torch::kCPU) {
  const auto input = [&](const char* what) {
    return golden["inputs/" + shape + "/" + what].to(device);
  };
  const auto causal = Mask::causal(m - n);
  const auto window = Mask::causal(m - n).sliding_window(4);
  if (name == "none")
    return Mask();
  if (name == "causal")
    return causal;
  if (name == "sliding_window")
    return window;
  if (name == "key_padding_lengths")
    return Mask::key_padding(input("lengths"));
  if (name == "key_padding_bool")
    return Mask::key_padding(input("padding"));
  if (name == "tensor")
    return Mask::from_tensor(input("allowed"));
  if (name == "causal_and_key_padding")
    return causal & Mask::key_padding(input("lengths"));
  if (name == "sliding_window_or_key_padding_bool")
    return window | Mask::key_padding(input("padding"));
  if (name == "documents")
    return Mask::documents(input("ids"), /*causal=*/false);
  if (name == "documents_causal")
    return Mask::documents(input("ids"), /*causal=*/true);
  if (name == "documents_causal_sliding_window")
    return Mask::documents(input("ids"), /*causal=*/true).sliding_window(4);
  if (name == "prefix_lm") {
    const int64_t prefix = input("prefix").item<int64_t>();
    return Mask::from_function(
        [prefix](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
                 const torch::Tensor& kv) { return (kv <= q) | (kv < prefix); });
  }
  ADD_FAILURE() << "no mask named " << name;
  return Mask();
}

attnkit::ScoreMod reference_score(const std::string& name, const torch::Tensor& bias) {
  if (name == "alibi")
    return score_mods::alibi(score_mods::alibi_slopes(4));
  if (name == "softcap")
    return score_mods::softcap(1.5);
  if (name == "relative_position_bias")
    return score_mods::relative_position_bias(bias);
  EXPECT_EQ(name, "none");
  return nullptr;
}

// On each device: the CPU to 1e-10 (float64) and 1e-5 (float32); CUDA's float32 kernels sum
// in other orders, so 1e-4 there.
class MaskReferenceDevices : public attnkit::testing::DeviceTest {};

TEST_P(MaskReferenceDevices, EveryBackendMatchesThePythonReferenceInFloat64AndFloat32) {
  const auto golden = mask_golden();
  int64_t cases = 0, runs = 0;
  F::KernelRecord record;  // which routes the reference checked
  for (const auto& item : golden) {
    const auto& key = item.key();  // case/<shape>/<mask>/<score>/out
    if (key.rfind("case/", 0) != 0 || key.size() < 4 || key.substr(key.size() - 4) != "/out")
      continue;
    ++cases;
    const auto prefix = key.substr(0, key.size() - 3);
    const std::string parts = key.substr(5);
    const auto shape = parts.substr(0, parts.find('/'));
    const auto rest = parts.substr(shape.size() + 1);
    const auto mask_name = rest.substr(0, rest.find('/'));
    const auto score_name =
        rest.substr(mask_name.size() + 1, rest.rfind('/') - mask_name.size() - 1);
    const auto input = [&](const char* what) {
      return golden["inputs/" + shape + "/" + what].to(device());
    };
    const int64_t n = input("q").size(2), m = input("k").size(2);
    for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
      const double tolerance =
          dtype == torch::kFloat64 ? 1e-10 : (device().is_cuda() ? 1e-4 : 1e-5);
      // kChunked runs the fused tile kernel where it can: the chunked kernel is named too.
      for (const auto& [backend, kernel] : std::vector<std::pair<AttentionBackend, std::string>>{
               {AttentionBackend::kMath, ""},
               {AttentionBackend::kChunked, ""},
               {AttentionBackend::kChunked, "chunked"},
               {AttentionBackend::kFused, ""},
               {AttentionBackend::kAuto, ""}}) {
        SCOPED_TRACE(
            c10::str(prefix, " ", dtype, " ", attnkit::backend_name(backend), " ", kernel));
        auto q = input("q").to(dtype).clone().requires_grad_();
        auto k = input("k").to(dtype).clone().requires_grad_();
        auto v = input("v").to(dtype).clone().requires_grad_();
        auto bias = input("bias").to(dtype).clone().requires_grad_();
        const auto options = AttentionOptions()
                                 .mask(reference_mask(mask_name, golden, shape, n, m, device()))
                                 .score_mod(reference_score(score_name, bias))
                                 .backend(backend)
                                 .kernel(kernel)
                                 .query_block_size(4)
                                 .key_block_size(3);
        if (!F::unsupported_reason(backend, q, k, v, options).empty()) {
          EXPECT_EQ(backend, AttentionBackend::kFused);  // the others run everything
          continue;
        }
        ++runs;
        const auto out = F::attention(q, k, v, options);
        (out * input("w").to(dtype)).sum().backward();
        EXPECT_TRUE(tensors_close("out", out, golden[prefix + "out"], tolerance));
        EXPECT_TRUE(tensors_close("dq", q.grad(), golden[prefix + "dq"], tolerance));
        EXPECT_TRUE(tensors_close("dk", k.grad(), golden[prefix + "dk"], tolerance));
        EXPECT_TRUE(tensors_close("dv", v.grad(), golden[prefix + "dv"], tolerance));
        if (score_name == "relative_position_bias") {
          EXPECT_TRUE(tensors_close("dbias", bias.grad(), golden[prefix + "dbias"], tolerance));
        }
      }
    }
  }
  EXPECT_EQ(cases, 80) << "the reference file's cases";
  EXPECT_GT(runs, cases * 8);  // math, kChunked twice and auto on both dtypes, fused where it can
  std::set<std::string> kernels;
  for (const auto& run : record.runs())
    kernels.insert(run.kernel);
  // On 2.x the demanded fused backend runs padding and documents as segments and the other
  // masks and additive biases through SDPA's dense mask: both are checked here.
  if (TORCH_VERSION_MAJOR >= 2) {
    EXPECT_EQ(kernels.count("sdpa_varlen"), 1u);
    EXPECT_EQ(kernels.count("sdpa_masked"), 1u);
  }
  EXPECT_EQ(kernels.count("chunked"), 1u);
  EXPECT_EQ(kernels.count("fused_tiles"), 1u);
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(MaskReferenceDevices);

// torch.nn.MultiheadAttention(8, 2, bias=True, batch_first=True) with key_padding_mask and
// attn_mask (True = masked), its weights copied into MultiHeadAttention (qkv_bias), gives
// the same outputs, self- and cross-attention, on every backend that takes such masks.
TEST(MaskReference, NnMultiheadAttentionWithItsMasksGivesTheSameOutputs) {
  const auto golden = mask_golden();
  attnkit::MultiHeadAttention mha(
      attnkit::MultiHeadAttentionOptions(8, 8, 16, 0.0, 2).qkv_bias(true).causal(false));
  mha->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    const auto in_weight = golden["mha/in_proj_weight"].chunk(3);
    const auto in_bias = golden["mha/in_proj_bias"].chunk(3);
    mha->W_query->weight.copy_(in_weight[0]);
    mha->W_key->weight.copy_(in_weight[1]);
    mha->W_value->weight.copy_(in_weight[2]);
    mha->W_query->bias.copy_(in_bias[0]);
    mha->W_key->bias.copy_(in_bias[1]);
    mha->W_value->bias.copy_(in_bias[2]);
    mha->out_proj->weight.copy_(golden["mha/out_proj_weight"]);
    mha->out_proj->bias.copy_(golden["mha/out_proj_bias"]);
  }
  const auto query = golden["mha/query"], memory = golden["mha/memory"];
  // PyTorch's attn_mask says where not to attend; Mask::from_tensor where to.
  const auto cross_mask = Mask::key_padding(golden["mha/cross_key_padding"]) &
                          Mask::from_tensor(golden["mha/cross_attn_mask"].logical_not());
  const auto self_mask = Mask::key_padding(golden["mha/self_key_padding"]) &
                         Mask::from_tensor(golden["mha/self_attn_mask"].logical_not());
  for (const auto backend :
       {AttentionBackend::kMath, AttentionBackend::kChunked, AttentionBackend::kAuto}) {
    SCOPED_TRACE(attnkit::backend_name(backend));
    mha->options.backend(backend);
    EXPECT_TRUE(tensors_close("cross-attention", mha(query, memory, memory, cross_mask),
                              golden["mha/cross_out"], 1e-10));
    EXPECT_TRUE(tensors_close("self-attention", mha->forward(query, {}, {}, self_mask),
                              golden["mha/self_out"], 1e-10));
  }
  // The attn_mask there is causal: the module's own causal setting and the padding agree.
  mha->options.causal(true);
  EXPECT_TRUE(
      tensors_close("causal module",
                    mha->forward(query, {}, {}, Mask::key_padding(golden["mha/self_key_padding"])),
                    golden["mha/self_out"], 1e-10));
}

// The reference script against its file and against PyTorch itself with this leg's Python:
// nn.MultiheadAttention; on 2.x F.scaled_dot_product_attention with bool masks; from 2.5
// FlexAttention's eager flex_attention (ALiBi, softcap, documents, prefix-LM; gradients where
// PyTorch runs its backward).
TEST(MaskReference, PythonReferenceAgreesWithItsFileAndWithPyTorch) {
  const auto [status, output] = attnkit::testing::run_leg_python(kMaskReference, "--check");
  ASSERT_EQ(status, 0) << output;
  EXPECT_NE(output.find("OK torch"), std::string::npos) << output;
#if TORCH_VERSION_MAJOR >= 2
  // On the 2.x leg the checks against PyTorch's own kernels must have run, not been skipped.
  EXPECT_NE(output.find("F.scaled_dot_product_attention 18"), std::string::npos) << output;
  // PyTorch 2.7 and later refuse flex_attention's backward on the CPU (the script says so):
  // there the 5 output checks run without the 15 gradient checks; on a GPU all 20 run.
  const bool cpu_backward_refused =
      (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 7) && !torch::cuda::is_available();
  EXPECT_EQ(output.find("refuses backward on the cpu") != std::string::npos, cpu_backward_refused)
      << output;
  EXPECT_NE(output.find(cpu_backward_refused ? "flex_attention 5" : "flex_attention 20"),
            std::string::npos)
      << output;
#endif
}

}  // namespace
