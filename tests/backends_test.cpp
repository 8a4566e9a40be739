// The fused and chunked kernels and backends against the math path: outputs and every
// gradient.

#include "attnkit/autocast.h"
#include "attnkit/functional.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/threads.h"
#include "core/kernels.h"
#include "core/planner.h"
#include "test_support.h"

#include <array>
#include <set>

#include <torch/version.h>

// These tests also hold the deprecated adapters (SdpaOptions, ChunkedOptions, FusedOptions)
// to the core they forward to.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace F = attnkit::functional;
using attnkit::AttentionBackend;
using attnkit::MultiHeadAttentionOptions;
using namespace attnkit::testing;

namespace {

// Agreement tolerances of the issue: blockwise summation reorders float32 sums (1e-5) and
// float64 sums (1e-10); nothing else differs.
struct Shape {
  int64_t batch, heads, num_queries, num_keys, head_dim, block, key_block;
};

// Output and gradients of q, k, v of sum(attention(q, k, v) * probe).
std::vector<torch::Tensor> output_and_grads(
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                                      const torch::Tensor&)>& attention,
    const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
    const torch::Tensor& probe) {
  auto q = q_in.clone().requires_grad_(true);
  auto k = k_in.clone().requires_grad_(true);
  auto v = v_in.clone().requires_grad_(true);
  const auto out = attention(q, k, v);
  (out * probe).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

using AttentionFn =
    std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

// The reference every kernel here is held to: the math core through the public core,
// attention(..., backend(kMath)), with the causal mask at `query_offset` and `window` when
// `causal`, and dropout drawn as torch::dropout draws it (training when dropout_p > 0).
torch::Tensor math_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             bool causal, int64_t query_offset = 0,
                             c10::optional<int64_t> window = c10::nullopt, double dropout_p = 0.0) {
  if (q.dim() > 4) {
    // attention() takes ranks 2 to 4: (..., n, hd) -> (outer, n, hd), and back
    const auto fold = [](const torch::Tensor& t) {
      return t.reshape({-1, t.size(-2), t.size(-1)});
    };
    auto shape = q.sizes().vec();
    shape.back() = v.size(-1);
    return math_reference(fold(q), fold(k), fold(v), causal, query_offset, window, dropout_p)
        .reshape(shape);
  }
  attnkit::Mask mask;
  if (causal) {
    mask = attnkit::Mask::causal(query_offset);
    if (window.has_value())
      mask = mask.sliding_window(*window);
  }
  return F::attention(q, k, v,
                      F::AttentionOptions()
                          .mask(mask)
                          .backend(AttentionBackend::kMath)
                          .dropout_p(dropout_p)
                          .training(dropout_p > 0.0));
}

// `attention` against the math path on (q, k, v): output and the gradients of q, k and v of
// sum(out * probe), at the agreement tolerance of q's dtype.
void expect_matches_math(const AttentionFn& attention, const torch::Tensor& q,
                         const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& probe,
                         bool causal, int64_t query_offset = 0,
                         c10::optional<int64_t> window_size = c10::nullopt) {
  const auto math = output_and_grads(
      [&](auto& a, auto& b, auto& c) {
        return math_reference(a, b, c, causal, query_offset, window_size);
      },
      q, k, v, probe);
  const auto other = output_and_grads(attention, q, k, v, probe);
  const std::vector<std::string> names{"output", "grad q", "grad k", "grad v"};
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_TRUE(tensors_close(names[i], other[i], math[i], agreement(q.scalar_type())));
  }
}

AttentionFn chunked(bool causal, int64_t block, int64_t key_block) {
  return [=](auto& q, auto& k, auto& v) {
    return F::chunked_attention(
        q, k, v, F::ChunkedOptions().is_causal(causal).block_size(block).key_block_size(key_block));
  };
}

AttentionFn fused(bool causal) {
  return [=](auto& q, auto& k, auto& v) {
    return F::fused_attention(q, k, v, F::FusedOptions().is_causal(causal));
  };
}

// `train` (causal, dropout on, masks drawn from the global generator) against `eval` (the
// same kernel with dropout off): they differ, eval equals the causal math path, and with the
// seed fixed per call the masks repeat, so train's gradients match finite differences.
void expect_dropout_off_in_eval_and_differentiable(const AttentionFn& train,
                                                   const AttentionFn& eval, const torch::Tensor& q,
                                                   const torch::Tensor& k, const torch::Tensor& v) {
  torch::manual_seed(5);
  const auto with_dropout = train(q, k, v);
  const auto without = eval(q, k, v);
  EXPECT_FALSE(tensors_close("train vs eval", with_dropout, without, 1e-6));
  EXPECT_TENSOR_NEAR(without, math_reference(q, k, v, /*causal=*/true), 1e-10);
  torch::nn::Module holder;
  auto key = holder.register_parameter("key", k.clone());
  auto value = holder.register_parameter("value", v.clone());
  expect_gradients_match_finite_differences(
      holder,
      [&](const torch::Tensor& query) {
        torch::manual_seed(5);
        return train(query, key, value);
      },
      q);
}

// 2-D (n, hd), 3-D (h, n, hd), 5-D inputs, and (b, h, n, hd) views of a (b, n, h * hd)
// projection, which the kernels read in place rather than copy.
std::vector<torch::Tensor> inputs_of_any_rank_and_strides() {
  torch::manual_seed(13);
  const auto projection = torch::randn({2, 9, 3 * 4}, torch::kFloat64);
  const auto strided = projection.view({2, 9, 3, 4}).transpose(1, 2);  // (b, h, n, hd) view
  EXPECT_FALSE(strided.is_contiguous());
  return {torch::randn({7, 3}, torch::kFloat64), torch::randn({2, 7, 3}, torch::kFloat64),
          torch::randn({2, 1, 3, 7, 3}, torch::kFloat64), strided};
}

}  // namespace

TEST(ChunkedAttention, MatchesMathOutputsAndGradients) {
  // n = 1, n not a multiple of the block, head_dim 1, n != m, one block and many, key
  // blocks smaller and larger than query blocks and not aligned with them.
  const std::vector<Shape> shapes{{2, 3, 1, 1, 4, 16, 16},   {2, 2, 37, 37, 8, 16, 16},
                                  {1, 2, 64, 64, 1, 16, 16}, {2, 1, 20, 33, 5, 7, 7},
                                  {1, 1, 9, 9, 3, 128, 128}, {2, 3, 41, 41, 4, 8, 5},
                                  {1, 2, 30, 23, 6, 4, 64},  {1, 1, 50, 50, 2, 16, 1}};
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const bool causal : {false, true}) {
      for (const auto& s : shapes) {
        SCOPED_TRACE(c10::str("dtype ", dtype, " causal ", causal, " n ", s.num_queries, " m ",
                              s.num_keys, " hd ", s.head_dim, " blocks ", s.block, " x ",
                              s.key_block));
        torch::manual_seed(11);
        const auto options = torch::dtype(dtype);
        const auto q = torch::randn({s.batch, s.heads, s.num_queries, s.head_dim}, options);
        const auto k = torch::randn({s.batch, s.heads, s.num_keys, s.head_dim}, options);
        const auto v = torch::randn({s.batch, s.heads, s.num_keys, s.head_dim + 1}, options);
        const auto probe = torch::randn({s.batch, s.heads, s.num_queries, s.head_dim + 1}, options);
        expect_matches_math(chunked(causal, s.block, s.key_block), q, k, v, probe, causal);
      }
    }
  }
}

TEST(ChunkedAttention, AnyRankAndStridedInputsMatchMath) {
  for (const auto& q : inputs_of_any_rank_and_strides()) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(c10::str("shape ", q.sizes(), " causal ", causal));
      const auto probe = torch::randn(q.sizes(), torch::kFloat64);
      expect_matches_math(chunked(causal, /*block=*/2, /*key_block=*/3), q, q.flip(-2), q * 2,
                          probe, causal);
    }
  }
}

class ChunkedAttentionDevices : public DeviceTest {};

// The tile loop draws each block's dropout mask from a generator seeded per block, on every
// device: the global seed repeats the output, backward redraws forward's masks (finite
// differences), eval turns dropout off, and the draws average to the output without dropout
// (inverted dropout keeps the expectation; a keep-probability of p instead of 1 - p would be
// off by half).
TEST_P(ChunkedAttentionDevices, DropoutIsSeededDifferentiableAndOffInEval) {
  torch::manual_seed(3);
  const auto on = torch::TensorOptions().dtype(torch::kFloat64).device(device());
  const auto q = torch::randn({2, 2, 10, 4}, on);
  const auto k = torch::randn({2, 2, 10, 4}, on);
  const auto v = torch::randn({2, 2, 10, 4}, on);
  const auto train = F::ChunkedOptions()
                         .is_causal(true)
                         .dropout_p(0.3)
                         .training(true)
                         .block_size(4)
                         .key_block_size(3);
  // The masks come from the global generator: the same seed, the same output.
  torch::manual_seed(5);
  const auto first = F::chunked_attention(q, k, v, train);
  torch::manual_seed(5);
  EXPECT_TENSOR_NEAR(F::chunked_attention(q, k, v, train), first, 0.0);
  EXPECT_FALSE(torch::equal(F::chunked_attention(q, k, v, train), first));
  expect_dropout_off_in_eval_and_differentiable(
      [&](auto& a, auto& b, auto& c) { return F::chunked_attention(a, b, c, train); },
      [&](auto& a, auto& b, auto& c) {
        return F::chunked_attention(a, b, c, F::ChunkedOptions().is_causal(true));
      },
      q, k, v);
  const auto exact = F::chunked_attention(q, k, v, F::ChunkedOptions().is_causal(true));
  auto sum = torch::zeros_like(exact);
  const int draws = 400;
  for (int i = 0; i < draws; ++i)
    sum += F::chunked_attention(q, k, v, train);
  const double off = (sum / draws - exact).abs().mean().item<double>();
  const double scale = exact.abs().mean().item<double>();
  EXPECT_LT(off, 0.1 * scale) << "the mean of " << draws << " draws is off by " << off;
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(ChunkedAttentionDevices);

// Restores LibTorch's and the BLAS's thread counts when a test that changes them ends.
struct ThreadCountsRestorer {
  int torch_threads = torch::get_num_threads();
  int blas_threads = attnkit::blas_threads().num_threads;
  ~ThreadCountsRestorer() {
    attnkit::set_num_threads(blas_threads > 0 ? blas_threads : torch_threads);
    torch::set_num_threads(torch_threads);
  }
};

TEST(ChunkedAttention, ThreadCountChangesNeitherResultsNorTheBlasSetting) {
  const ThreadCountsRestorer restore;
  torch::manual_seed(11);
  // Grouped heads, a window, dropout and ragged blocks: every path the workers split.
  const auto q = torch::randn({2, 4, 37, 8}, torch::kFloat64);
  const auto k = torch::randn({2, 2, 37, 8}, torch::kFloat64);
  const auto v = torch::randn({2, 2, 37, 8}, torch::kFloat64);
  const auto probe = torch::randn({2, 4, 37, 8}, torch::kFloat64);
  const auto options = F::ChunkedOptions()
                           .is_causal(true)
                           .window_size(9)
                           .dropout_p(0.2)
                           .training(true)
                           .block_size(8)
                           .key_block_size(16);
  const auto run = [&](int threads) {
    attnkit::set_num_threads(threads);
    torch::manual_seed(5);
    return output_and_grads(
        [&](auto& a, auto& b, auto& c) { return F::chunked_attention(a, b, c, options); }, q, k, v,
        probe);
  };
  const auto serial = run(1);
  const auto parallel = run(3);
  for (size_t i = 0; i < serial.size(); ++i)
    EXPECT_TENSOR_NEAR(parallel[i], serial[i], 1e-12);
  // The kernel ran its BLAS calls single-threaded and gave the BLAS its count back.
  EXPECT_EQ(torch::get_num_threads(), 3);
  if (attnkit::blas_threads().name != "unknown") {
    EXPECT_EQ(attnkit::blas_threads().num_threads, 3);
  }
}

TEST(Threads, BadCountsAreRefusedAndChangeNothing) {
  const ThreadCountsRestorer restore;
  attnkit::set_num_threads(2);
  for (const int bad : {0, -3}) {
    expect_error_containing(
        [&] { attnkit::set_num_threads(bad); },
        "[attnkit::set_num_threads] num_threads must be >= 1, got " + std::to_string(bad));
  }
  EXPECT_EQ(torch::get_num_threads(), 2);
  std::ostringstream text;
  text << attnkit::blas_threads();
  EXPECT_EQ(text.str(), attnkit::blas_threads().name == "unknown"
                            ? "BLAS threads unknown"
                            : attnkit::blas_threads().name + ", 2 threads");
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

// `attention(causal)` against the math path, float32 and float64, causal and not, over
// n = 1, n != m both ways, head_dim 1, widths below, at and past the fused kernel's 8-column
// register block, and the toy size of attnkit-train (n = 16, hd = 16).
void expect_matches_math_on_kernel_shapes(const std::function<AttentionFn(bool)>& attention) {
  const std::vector<Shape> shapes{{2, 3, 1, 1, 4, 0, 0},    {2, 2, 37, 37, 8, 0, 0},
                                  {1, 2, 64, 64, 1, 0, 0},  {2, 1, 20, 33, 5, 0, 0},
                                  {1, 2, 30, 23, 16, 0, 0}, {4, 4, 16, 16, 16, 0, 0},
                                  {1, 1, 9, 8, 17, 0, 0}};
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const bool causal : {false, true}) {
      for (const auto& s : shapes) {
        SCOPED_TRACE(c10::str("dtype ", dtype, " causal ", causal, " n ", s.num_queries, " m ",
                              s.num_keys, " hd ", s.head_dim));
        torch::manual_seed(17);
        const auto options = torch::dtype(dtype);
        const auto q = torch::randn({s.batch, s.heads, s.num_queries, s.head_dim}, options);
        const auto k = torch::randn({s.batch, s.heads, s.num_keys, s.head_dim}, options);
        const auto v = torch::randn({s.batch, s.heads, s.num_keys, s.head_dim + 1}, options);
        const auto probe = torch::randn({s.batch, s.heads, s.num_queries, s.head_dim + 1}, options);
        expect_matches_math(attention(causal), q, k, v, probe, causal);
      }
    }
  }
}

TEST(FusedAttention, MatchesMathOutputsAndGradients) {
  expect_matches_math_on_kernel_shapes(fused);
}

TEST(FusedAttention, AnyRankAndStridedInputsMatchMath) {
  for (const auto& q : inputs_of_any_rank_and_strides()) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(c10::str("shape ", q.sizes(), " causal ", causal));
      const auto probe = torch::randn(q.sizes(), torch::kFloat64);
      expect_matches_math(fused(causal), q, q.flip(-2), q * 2, probe, causal);
    }
  }
}

TEST(FusedAttention, DropoutDrawsTheMathPathsMaskAndIsDifferentiable) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto k = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto v = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto train = F::FusedOptions().is_causal(true).dropout_p(0.3).training(true);
  // Drawn from the global generator as torch::dropout draws: the math path's mask.
  torch::manual_seed(5);
  const auto out = F::fused_attention(q, k, v, train);
  torch::manual_seed(5);
  const auto math = math_reference(q, k, v, /*causal=*/true, 0, c10::nullopt, /*dropout_p=*/0.3);
  EXPECT_TENSOR_NEAR(out, math, 1e-10);
  expect_dropout_off_in_eval_and_differentiable(
      [&](auto& a, auto& b, auto& c) { return F::fused_attention(a, b, c, train); },
      [&](auto& a, auto& b, auto& c) {
        return F::fused_attention(a, b, c, F::FusedOptions().is_causal(true).dropout_p(0.3));
      },
      q, k, v);
}

TEST(FusedAttention, PackedProjectionsMatchMathOnTheirHeads) {
  const int64_t b = 3, n = 13, heads = 2, hd = 5;
  for (const bool causal : {false, true}) {
    for (const double dropout : {0.0, 0.2}) {
      SCOPED_TRACE(c10::str("causal ", causal, " dropout ", dropout));
      torch::manual_seed(19);
      const auto qkv_in = torch::randn({b, n, 3 * heads * hd}, torch::kFloat64);
      const auto probe = torch::randn({b, n, heads * hd}, torch::kFloat64);
      // Both sides draw their dropout mask after the same seed.
      const auto run = [&](bool packed) {
        auto qkv = qkv_in.clone().requires_grad_(true);
        torch::manual_seed(23);
        torch::Tensor out;
        if (packed) {
          out = F::fused_packed_attention(
              qkv, heads, F::FusedOptions().is_causal(causal).dropout_p(dropout).training(true));
        } else {
          const auto parts = qkv.chunk(3, -1);
          const auto split = [&](const torch::Tensor& t) {
            return t.view({b, n, heads, hd}).transpose(1, 2);  // (b, n, d) -> (b, h, n, hd)
          };
          const auto context = math_reference(split(parts[0]), split(parts[1]), split(parts[2]),
                                              causal, 0, c10::nullopt, dropout);
          out = context.transpose(1, 2).reshape({b, n, heads * hd});  // heads merged
        }
        (out * probe).sum().backward();
        return std::make_pair(out.detach(), qkv.grad());
      };
      const auto [math_out, math_grad] = run(false);
      const auto [packed_out, packed_grad] = run(true);
      EXPECT_TRUE(tensors_close("output", packed_out, math_out, agreement(torch::kFloat64)));
      EXPECT_TRUE(tensors_close("grad qkv", packed_grad, math_grad, agreement(torch::kFloat64)));
    }
  }
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

// The fused backend's attention on this LibTorch: LibTorch's own SDPA on >= 2.0, attnkit's
// kernel or the math core on 1.13 (each CI leg tests its own).
AttentionFn fused_backend(bool causal, double dropout_p = 0.0, bool training = false) {
  return [=](auto& q, auto& k, auto& v) {
    return F::fused_backend_attention(
        q, k, v, F::FusedOptions().is_causal(causal).dropout_p(dropout_p).training(training));
  };
}

TEST(FusedBackend, MatchesMathOutputsAndGradients) {
  SCOPED_TRACE(c10::str("LibTorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR));
  expect_matches_math_on_kernel_shapes([](bool causal) { return fused_backend(causal); });
  // Past the 1.13 kernel's 64 x 64 limit too (the math core there).
  torch::manual_seed(19);
  const auto q = torch::randn({1, 2, 80, 8}, torch::kFloat64);
  expect_matches_math(fused_backend(true), q, q.flip(-2), q * 2, torch::randn_like(q), true);
}

TEST(FusedBackend, MoreThreadsChangeNeitherResultsNorTheBlasSetting) {
  // On >= 2.5 LibTorch's flash kernel then runs with the BLAS pinned to one thread (forward,
  // and backward through a graph kept in its node); on 1.13 past 64 x 64, the chunked kernel.
  const ThreadCountsRestorer restore;
  attnkit::set_num_threads(2);
  torch::manual_seed(23);
  const auto q = torch::randn({2, 4, 80, 8}, torch::kFloat64);
  const auto k = torch::randn({2, 4, 80, 8}, torch::kFloat64);
  const auto probe = torch::randn_like(q);
  expect_matches_math(fused_backend(true), q, k, k * 2, probe, /*causal=*/true);
  // A window sends an explicit mask; grouped heads share key/value heads.
  const auto windowed = [](auto& a, auto& b, auto& c) {
    return F::fused_backend_attention(a, b, c, F::FusedOptions().is_causal(true).window_size(7));
  };
  expect_matches_math(windowed, q, k, k * 2, probe, true, /*query_offset=*/0, /*window_size=*/7);
  const auto k2 = k.narrow(1, 0, 2).contiguous();
  expect_matches_math(fused_backend(true), q, k2, k2 * 2, probe, true);
  // Gradients for some inputs only, and none at all.
  auto v = (k * 2).requires_grad_(true);
  (fused_backend(true)(q, k, v) * probe).sum().backward();
  auto v_math = (k * 2).requires_grad_(true);
  (math_reference(q, k, v_math, /*causal=*/true) * probe).sum().backward();
  EXPECT_TRUE(tensors_close("grad v", v.grad(), v_math.grad(), agreement(torch::kFloat64)));
  {
    const torch::NoGradGuard no_grad;
    const auto out = fused_backend(true)(q, k, v);
    EXPECT_FALSE(out.requires_grad());
    EXPECT_TRUE(tensors_close("no-grad output", out, math_reference(q, k, v, /*causal=*/true),
                              agreement(torch::kFloat64)));
  }
  EXPECT_EQ(torch::get_num_threads(), 2);
  if (attnkit::blas_threads().name != "unknown") {
    EXPECT_EQ(attnkit::blas_threads().num_threads, 2);
  }
}

TEST(FusedBackend, DropoutHasTheRightDistributionAndIsOffInEval) {
  // Equal scores give weights 1/m; with v = I, out[i][j] is row i's weight j after dropout:
  // 0 with probability p, else (1/m) / (1 - p).
  const int64_t m = 64;
  const double p = 0.3;
  const auto q = torch::zeros({4, 4, m, 8}, torch::kFloat64);
  const auto v = torch::eye(m, torch::kFloat64).expand({4, 4, m, m});
  torch::manual_seed(7);
  const auto out = fused_backend(false, p, /*training=*/true)(q, q, v);
  const double kept = 1.0 / m / (1.0 - p);
  const auto zero = out.eq(0);
  EXPECT_TRUE(torch::logical_or(zero, (out - kept).abs().lt(1e-12)).all().item<bool>())
      << "elements other than 0 and " << kept;
  // 65,536 draws: the dropped fraction's standard deviation is 0.0018; 0.02 is 11 of them.
  EXPECT_NEAR(zero.to(torch::kFloat64).mean().item<double>(), p, 0.02);
  EXPECT_TENSOR_NEAR(fused_backend(false, p, /*training=*/false)(q, q, v),
                     torch::full_like(out, 1.0 / m), 1e-12);
  torch::manual_seed(3);
  const auto a = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  expect_dropout_off_in_eval_and_differentiable(
      fused_backend(true, p, true), fused_backend(true, p, false), a, a.flip(-2), a * 2);
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

// Queries at the end of a longer key sequence, as decoding with a KV cache has them: the
// causal mask aligned bottom-right (query i at key position m - n + i).
TEST(DecodeShapedAttention, MathWithAnOffsetIsTheLastRowsOfFullCausalAttention) {
  torch::manual_seed(23);
  const auto q = torch::randn({2, 3, 9, 4}, torch::kFloat64);
  const auto k = torch::randn({2, 3, 9, 4}, torch::kFloat64);
  const auto v = torch::randn({2, 3, 9, 5}, torch::kFloat64);
  const auto full = math_reference(q, k, v, /*causal=*/true);
  for (const int64_t n : {1, 4, 9}) {
    SCOPED_TRACE(c10::str("n ", n));
    const auto last = math_reference(q.narrow(2, 9 - n, n), k, v, /*causal=*/true, 9 - n);
    EXPECT_TENSOR_NEAR(last, full.narrow(2, 9 - n, n), 1e-12);
  }
  EXPECT_TRUE(F::causal_mask(1, 10, torch::kCPU, 9).logical_not().all().item<bool>());
  EXPECT_TRUE(F::causal_mask(3, 5, torch::kCPU, 2)
                  .equal(torch::tensor({0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0})
                             .to(torch::kBool)
                             .view({3, 5})));
}

TEST(DecodeShapedAttention, EveryBackendMatchesMathWithAQueryOffset) {
  struct Case {
    int64_t num_queries, num_keys, query_offset;
  };
  // One-token decode (n = 1), chunked prefill (1 < n < m), a whole prompt (n = m), offsets
  // short of bottom-right, and lengths past the chunked blocks (5 x 4) and the 1.13 kernel.
  const std::vector<Case> cases{{1, 1, 0}, {1, 17, 16}, {4, 17, 13}, {6, 11, 2},
                                {9, 9, 0}, {3, 40, 37}, {1, 80, 79}, {20, 90, 70}};
  const std::vector<std::pair<std::string, std::function<AttentionFn(int64_t)>>> backends{
      {"chunked",
       [](int64_t offset) {
         return [=](auto& q, auto& k, auto& v) {
           return F::chunked_attention(q, k, v,
                                       F::ChunkedOptions()
                                           .is_causal(true)
                                           .query_offset(offset)
                                           .block_size(5)
                                           .key_block_size(4));
         };
       }},
      {"fused kernel",
       [](int64_t offset) {
         return [=](auto& q, auto& k, auto& v) {
           return F::fused_attention(q, k, v,
                                     F::FusedOptions().is_causal(true).query_offset(offset));
         };
       }},
      {"fused backend", [](int64_t offset) {
         return [=](auto& q, auto& k, auto& v) {
           return F::fused_backend_attention(
               q, k, v, F::FusedOptions().is_causal(true).query_offset(offset));
         };
       }}};
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const auto& c : cases) {
      for (const auto& [name, backend] : backends) {
        SCOPED_TRACE(c10::str(name, " ", dtype, " n ", c.num_queries, " m ", c.num_keys, " offset ",
                              c.query_offset));
        torch::manual_seed(29);
        const auto options = torch::dtype(dtype);
        const auto q = torch::randn({2, 3, c.num_queries, 8}, options);
        const auto k = torch::randn({2, 3, c.num_keys, 8}, options);
        const auto v = torch::randn({2, 3, c.num_keys, 8}, options);
        const auto probe = torch::randn({2, 3, c.num_queries, 8}, options);
        expect_matches_math(backend(c.query_offset), q, k, v, probe, /*causal=*/true,
                            c.query_offset);
      }
    }
  }
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

TEST(AttentionBackends, EveryBackendComputesTheSameModule) {
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const bool causal : {true, false}) {
      for (const bool combined : {false, true}) {
        SCOPED_TRACE(c10::str("dtype ", dtype, " causal ", causal, " combined ", combined));
        torch::manual_seed(21);
        const auto options = MultiHeadAttentionOptions(6, 8, 12, 0.0, 2)
                                 .qkv_bias(true)
                                 .causal(causal)
                                 .chunk_size(4)
                                 .key_chunk_size(3);
        std::shared_ptr<torch::nn::Module> reference;
        if (combined) {
          reference = attnkit::MultiHeadAttentionCombinedQKV(options).ptr();
        } else {
          reference = attnkit::MultiHeadAttention(options).ptr();
        }
        reference->to(dtype);
        const auto x = torch::randn({3, 11, 6}, torch::dtype(dtype));
        const auto probe = torch::randn({3, 11, 8}, torch::dtype(dtype));
        // Same parameters, other backend: clone, then switch the option.
        const auto run = [&](AttentionBackend backend) {
          auto module = reference->clone();
          torch::Tensor out;
          if (combined) {
            auto m = std::dynamic_pointer_cast<attnkit::MultiHeadAttentionCombinedQKVImpl>(module);
            m->options.backend(backend);
            out = m->forward(x);
          } else {
            auto m = std::dynamic_pointer_cast<attnkit::MultiHeadAttentionImpl>(module);
            m->options.backend(backend);
            out = m->forward(x);
          }
          (out * probe).sum().backward();
          return std::make_pair(out.detach(), module->named_parameters());
        };
        const auto [math_out, math_params] = run(AttentionBackend::kMath);
        for (const auto backend : {AttentionBackend::kFused, AttentionBackend::kChunked}) {
          const auto [out, params] = run(backend);
          const auto name = attnkit::backend_name(backend);
          EXPECT_TRUE(tensors_close(name + " output", out, math_out, agreement(dtype)));
          for (const auto& p : math_params) {
            EXPECT_TRUE(tensors_close(name + " grad " + p.key(), params[p.key()].grad(),
                                      p.value().grad(), agreement(dtype)));
          }
        }
      }
    }
  }
}

TEST(AttentionBackends, NamesParseAndBadOptionsAreNamed) {
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kFused,
                             AttentionBackend::kChunked, AttentionBackend::kAuto}) {
    EXPECT_EQ(attnkit::parse_backend(attnkit::backend_name(backend)), backend);
  }
  expect_error_containing([] { attnkit::parse_backend("flash"); },
                          "unknown backend 'flash'; expected math, fused, chunked or auto");
  expect_error_containing(
      [] { attnkit::MultiHeadAttention(MultiHeadAttentionOptions(4, 4, 8, 0.0, 2).chunk_size(0)); },
      "[MultiHeadAttention] option chunk_size must be > 0, got 0");
  expect_error_containing(
      [] {
        attnkit::MultiHeadAttention(MultiHeadAttentionOptions(4, 4, 8, 0.0, 2).key_chunk_size(-1));
      },
      "[MultiHeadAttention] option key_chunk_size must be > 0, got -1");
}

// ---- Grouped-query and sliding-window attention -----------------------------------------

TEST(GroupedAndWindowedAttention, MathMatchesItsDefinition) {
  // Windows: key j visible to query i iff 0 <= offset + i - j < W, element by element.
  for (const int64_t window : {1, 2, 5}) {
    for (const int64_t offset : {0, 3}) {
      const auto mask = F::causal_mask(4, 9, torch::kCPU, offset, window);
      for (int64_t i = 0; i < 4; ++i) {
        for (int64_t j = 0; j < 9; ++j) {
          const int64_t distance = offset + i - j;
          EXPECT_EQ(mask[i][j].item<bool>(), !(distance >= 0 && distance < window))
              << "W " << window << " offset " << offset << " (" << i << ", " << j << ")";
        }
      }
    }
  }
  // Groups: query head h attends with key/value head h / (H / G), computed head by head.
  torch::manual_seed(41);
  const auto q = torch::randn({2, 6, 5, 4}, torch::kFloat64);
  const auto k = torch::randn({2, 3, 7, 4}, torch::kFloat64);
  const auto v = torch::randn({2, 3, 7, 3}, torch::kFloat64);
  const auto options = F::SdpaOptions().is_causal(true).query_offset(2).window_size(3);
  const auto grouped = F::scaled_dot_product_attention_with_weights(q, k, v, options);
  for (int64_t h = 0; h < 6; ++h) {
    const auto one = F::scaled_dot_product_attention_with_weights(
        q.narrow(1, h, 1), k.narrow(1, h / 2, 1), v.narrow(1, h / 2, 1), options);
    EXPECT_TENSOR_NEAR(grouped.context.narrow(1, h, 1), one.context, 1e-14);
    EXPECT_TENSOR_NEAR(grouped.weights.narrow(1, h, 1), one.weights, 1e-14);
  }
}

TEST(GroupedAndWindowedAttention, EveryBackendMatchesMath) {
  struct Case {
    int64_t num_queries, num_keys, query_offset;
  };
  // One-token decode, chunked prefill, whole prompts not a multiple of the blocks (5 x 4),
  // and a long one past the 1.13 kernel's tile.
  const std::vector<Case> cases{{1, 1, 0},   {1, 17, 16},  {4, 17, 13},
                                {13, 13, 0}, {20, 90, 70}, {70, 70, 0}};
  const std::vector<c10::optional<int64_t>> windows{c10::nullopt, 1, 3, 100};
  using Backend =
      std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                  int64_t, c10::optional<int64_t>)>;
  const std::vector<std::pair<std::string, Backend>> backends{
      {"chunked",
       [](auto& q, auto& k, auto& v, int64_t offset, c10::optional<int64_t> window) {
         return F::chunked_attention(q, k, v,
                                     F::ChunkedOptions()
                                         .is_causal(true)
                                         .query_offset(offset)
                                         .window_size(window)
                                         .block_size(5)
                                         .key_block_size(4));
       }},
      {"fused kernel",
       [](auto& q, auto& k, auto& v, int64_t offset, c10::optional<int64_t> window) {
         return F::fused_attention(
             q, k, v, F::FusedOptions().is_causal(true).query_offset(offset).window_size(window));
       }},
      {"fused backend",
       [](auto& q, auto& k, auto& v, int64_t offset, c10::optional<int64_t> window) {
         return F::fused_backend_attention(
             q, k, v, F::FusedOptions().is_causal(true).query_offset(offset).window_size(window));
       }}};
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const int64_t kv_heads : {1, 2, 6}) {  // 6 query heads: MQA, GQA, MHA
      for (const auto& window : windows) {
        for (const auto& c : cases) {
          torch::manual_seed(43);
          const auto options = torch::dtype(dtype);
          const auto q = torch::randn({2, 6, c.num_queries, 8}, options);
          const auto k = torch::randn({2, kv_heads, c.num_keys, 8}, options);
          const auto v = torch::randn({2, kv_heads, c.num_keys, 8}, options);
          const auto probe = torch::randn({2, 6, c.num_queries, 8}, options);
          for (const auto& [name, backend] : backends) {
            SCOPED_TRACE(c10::str(name, " ", dtype, " kv heads ", kv_heads, " window ",
                                  window.has_value() ? *window : 0, " n ", c.num_queries, " m ",
                                  c.num_keys, " offset ", c.query_offset));
            expect_matches_math(
                [&, offset = c.query_offset](auto& a, auto& b, auto& d) {
                  return backend(a, b, d, offset, window);
                },
                q, k, v, probe, /*causal=*/true, c.query_offset, window);
          }
        }
      }
    }
  }
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

// ---- the planner (src/core/planner.cpp) ---------------------------------------------------

namespace {

using attnkit::Mask;
using attnkit::detail::AttentionCall;
using attnkit::detail::StepKind;

// A call the planner meets, with its answer from the dense math core: the context on the
// rows that count (a ragged row's padding queries are nobody's), and the weights when asked.
struct PlannerCase {
  std::string name;
  AttentionCall call;
  torch::Tensor expected;          // (b, h, n, hd_v)
  torch::Tensor expected_weights;  // with call.with_weights
  torch::Tensor counted_rows;      // (b, 1, n, 1) bool: the query rows compared
};

// The reference, independent of the planner: keys and values repeated for their query
// heads, and `allowed` (b, h|1, n, m) as a dense mask.
std::pair<torch::Tensor, torch::Tensor> reference(const AttentionCall& call,
                                                  const torch::Tensor& allowed) {
  const auto group = call.query.size(1) / call.key.size(1);
  attnkit::detail::MathMasking masking;
  masking.allowed = allowed;
  const auto out = attnkit::detail::math_attention(call.query, call.key.repeat_interleave(group, 1),
                                                   call.value.repeat_interleave(group, 1), masking,
                                                   call.options.scale(), 0.0, false);
  return {out.context, out.weights};
}

// allowed (n, m): query i at key position offset + i sees keys in (offset + i - window,
// offset + i] (window 0: every earlier key) and before `end`.
torch::Tensor causal_allowed(int64_t n, int64_t m, int64_t offset, int64_t window, int64_t end) {
  const auto i = torch::arange(n).view({-1, 1}) + offset;
  const auto j = torch::arange(m).view({1, -1});
  auto allowed = (j <= i).logical_and(j < end);
  if (window > 0)
    allowed = allowed.logical_and(j > i - window);
  return allowed;
}

std::vector<PlannerCase> planner_cases() {
  torch::manual_seed(5);
  const int64_t b = 2, h = 4, hd = 8;  // key/value heads: 2 (grouped-query)
  const auto qkv = [&](int64_t n, int64_t m, int64_t kv_heads) {
    return std::array<torch::Tensor, 3>{torch::randn({b, h, n, hd}),
                                        torch::randn({b, kv_heads, m, hd}),
                                        torch::randn({b, kv_heads, m, hd})};
  };
  std::vector<PlannerCase> cases;
  const auto add = [&](const std::string& name, AttentionCall call, const torch::Tensor& allowed,
                       torch::Tensor counted_rows = {}) {
    const auto [context, weights] = reference(call, allowed);
    if (!counted_rows.defined())
      counted_rows = torch::ones({1, 1, call.query.size(2), 1}, torch::kBool);
    cases.push_back(
        {name, call, context, call.with_weights ? weights : torch::Tensor(), counted_rows});
  };
  const auto sequence = [&](const F::AttentionOptions& options, int64_t n = 12, int64_t m = 12,
                            int64_t kv_heads = 2) {
    const auto [q, k, v] = qkv(n, m, kv_heads);
    AttentionCall call;
    call.query = q, call.key = k, call.value = v, call.options = options;
    return call;
  };
  const auto dense = [](const Mask& mask, const AttentionCall& call) {
    return mask.dense(call.query.size(0), call.query.size(1), call.query.size(2), call.key.size(2),
                      torch::kCPU);
  };
  for (const auto& [name, mask] : std::vector<std::pair<std::string, Mask>>{
           {"no mask", Mask()},
           {"causal", Mask::causal()},
           {"sliding window", Mask::causal().sliding_window(3)},
           {"documents", Mask::documents(torch::tensor({0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2}),
                                         /*causal=*/true)},
           // Not segments: every query sees key 0 and its own last two.
           {"tensor mask", Mask::from_tensor(torch::eye(12, torch::kBool) |
                                             torch::eye(12, 12, torch::kBool).roll(1, 1) |
                                             torch::arange(12).eq(0).view({1, 12}))}}) {
    const auto call = sequence(F::AttentionOptions().mask(mask));
    add(name, call, mask.is_none() ? torch::Tensor() : dense(mask, call));
  }
  {
    // Past the loop nest's tile (n * m > kFusedAttentionMaxTile).
    const auto call = sequence(F::AttentionOptions().mask(Mask::causal()), 80, 80);
    add("long causal", call, causal_allowed(80, 80, 0, 0, 80));
  }
  {
    const auto call = sequence(F::AttentionOptions().mask(Mask::causal(7)), 5, 12);
    add("causal at offset 7", call, causal_allowed(5, 12, 7, 0, 12));
  }
  {
    const auto call = sequence(F::AttentionOptions().scale(0.3).mask(Mask::causal()));
    add("scale 0.3", call, causal_allowed(12, 12, 0, 0, 12));
  }
  {
    // softcap(1) changes every score: a kernel that ignores it answers differently.
    auto call = sequence(F::AttentionOptions().score_mod(attnkit::score_mods::softcap(1.0)));
    const auto capped = call;
    const auto group = call.query.size(1) / call.key.size(1);
    const auto scores =
        torch::matmul(call.query, call.key.repeat_interleave(group, 1).transpose(-2, -1)) /
        std::sqrt(static_cast<double>(hd));
    const auto weights = torch::softmax(torch::tanh(scores), -1);
    cases.push_back(PlannerCase{"score_mod softcap", capped,
                                torch::matmul(weights, call.value.repeat_interleave(group, 1)),
                                torch::Tensor(), torch::ones({1, 1, 12, 1}, torch::kBool)});
  }
  {
    auto call = sequence(F::AttentionOptions().mask(Mask::causal()));
    call.with_weights = true;
    add("with weights", call, causal_allowed(12, 12, 0, 0, 12));
  }
  {
    // Self-attention heads that are views of one packed projection (b, n, 3 * h * hd).
    const int64_t n = 10;
    const auto packed = torch::randn({b, n, 3 * h * hd});
    const auto parts = packed.chunk(3, -1);
    const auto heads = [&](const torch::Tensor& t) {
      return t.view({b, n, h, hd}).transpose(1, 2);  // (b, n, h * hd) -> (b, h, n, hd)
    };
    AttentionCall call;
    call.query = heads(parts[0]), call.key = heads(parts[1]), call.value = heads(parts[2]);
    call.options.mask(Mask::causal());
    call.packed_qkv = packed;
    add("packed projection", call, causal_allowed(n, n, 0, 0, n));
  }
  for (const auto& [name, window] : std::vector<std::pair<std::string, int64_t>>{
           {"cached decode", 0}, {"cached decode, window 3", 3}}) {
    auto mask = Mask::causal(8);
    if (window > 0)
      mask = mask.sliding_window(window);
    auto call = sequence(F::AttentionOptions().mask(mask), 1, 9);
    call.step = StepKind::kCached;
    add(name, call, causal_allowed(1, 9, 8, window, 9));
  }
  {
    auto call = sequence(F::AttentionOptions().mask(Mask::causal(5)), 4, 9);
    call.step = StepKind::kCached;
    add("cached prefill", call, causal_allowed(4, 9, 5, 0, 9));
  }
  {
    // MLA's absorbed decode: one key/value head of latents, the heads' scale.
    const int64_t latent = 6, m = 7;
    AttentionCall call;
    call.query = torch::randn({b, h, 1, latent});
    call.key = torch::randn({b, 1, m, latent});
    call.value = call.key;
    call.options.mask(Mask::causal(m - 1)).scale(1.0 / std::sqrt(static_cast<double>(hd)));
    call.step = StepKind::kCached;
    add("absorbed latent decode", call, torch::Tensor());
  }
  for (const auto& [n, window] : std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {3, 0}, {3, 2}}) {
    const std::vector<int64_t> offsets{2, 5}, ends{n == 1 ? 3 : 5, 6};
    auto call = sequence(F::AttentionOptions(), n, 8);
    call.step = StepKind::kRagged;
    call.ragged.query_offsets = torch::tensor(offsets);
    call.ragged.key_ends = torch::tensor(ends);
    call.ragged.window = window;
    std::vector<torch::Tensor> allowed, counted;
    for (size_t r = 0; r < offsets.size(); ++r) {
      allowed.push_back(causal_allowed(n, 8, offsets[r], window, ends[r]));
      counted.push_back(torch::arange(n) < ends[r] - offsets[r]);
    }
    add(c10::str("ragged step of ", n, window > 0 ? c10::str(", window ", window) : ""), call,
        torch::stack(allowed).unsqueeze(1), torch::stack(counted).view({b, 1, n, 1}));
  }
  return cases;
}

// What is wrong with the planner's answer to `c` under `backend` (a module's preference, or
// with `demanded` functional::attention's demand); "" when it is right.
std::string planner_error(
    const PlannerCase& c, AttentionBackend backend, bool demanded = false,
    const attnkit::detail::KernelTable& table = attnkit::detail::kernel_table()) {
  auto call = c.call;
  call.options.backend(backend);
  call.backend_is_preference = !demanded;
  try {
    const torch::NoGradGuard no_grad;  // inference kernels refuse autograd
    const auto out = attnkit::detail::run_attention(call, table);
    const auto rows = c.counted_rows.expand_as(c.expected);
    if (!out.context.defined() || out.context.sizes() != c.expected.sizes())
      return "a context of the wrong shape";
    if (!torch::allclose(out.context.masked_select(rows), c.expected.masked_select(rows), 1e-4,
                         1e-5))
      return "a wrong context";
    if (c.expected_weights.defined() &&
        (!out.weights.defined() || !torch::allclose(out.weights, c.expected_weights, 1e-4, 1e-5)))
      return "wrong or missing weights";
  } catch (const c10::Error& error) {
    return c10::str("an error: ", error.what_without_backtrace());
  }
  return "";
}

const std::vector<AttentionBackend> kBackends{AttentionBackend::kAuto, AttentionBackend::kMath,
                                              AttentionBackend::kFused, AttentionBackend::kChunked};

}  // namespace

// Every kernel the planner picks, for every kind of call and backend, as a module's
// preference and as a demand, answers as the math core does; and every kernel that can be
// picked on this LibTorch is picked by some case.
TEST(Planner, EveryPlannedKernelAnswersAsTheMathCore) {
  std::set<std::string> picked;
  for (const auto& c : planner_cases()) {
    for (const auto backend : kBackends) {
      for (const bool demanded : {false, true}) {
        SCOPED_TRACE(c.name + ", backend " + attnkit::backend_name(backend) +
                     (demanded ? ", demanded" : ", preferred"));
        auto call = c.call;
        call.options.backend(backend);
        call.backend_is_preference = !demanded;
        if (demanded && !attnkit::detail::backend_lacks(backend, call).empty())
          continue;  // refused, naming what it lacks (the test below)
        picked.insert(attnkit::detail::plan_attention(call).name);
        EXPECT_EQ(planner_error(c, backend, demanded), "");
      }
    }
  }
  std::set<std::string> expected{"decode", "ragged_loop_nest", "sdpa", "chunked", "math"};
  if (attnkit::detail::libtorch_has_sdpa()) {
    // A demanded fused backend with a mask beyond causal: documents as segments, others dense.
    expected.insert("sdpa_varlen");
    expected.insert("sdpa_masked");
  } else {
    expected.insert("loop_nest");
    expected.insert("packed_loop_nest");
  }
  EXPECT_EQ(picked, expected);
}

// The mutation check: a kernel made to claim every call (its decision declines nothing and
// runs the plan it made) gives a wrong answer or an error on some case, so the check above
// would catch a decision that takes a problem its kernel cannot run. The mutant lives in a
// table of its own, handed to the planner; the library's table is untouched.
TEST(Planner, AKernelThatClaimsWhatItCannotRunFailsTheCases) {
  const auto cases = planner_cases();
  const auto& table = attnkit::detail::kernel_table();
  for (size_t i = 0; i < table.size(); ++i) {
    if (std::string(table[i].name) == "math")
      continue;  // the fallback runs everything
    SCOPED_TRACE(table[i].name);
    auto mutant = table;
    mutant[i].decide = [decide = table[i].decide](const attnkit::detail::KernelInput& input) {
      auto decision = decide(input);
      decision.declined.clear();
      return decision;
    };
    int failures = 0;
    for (const auto& c : cases) {
      for (const auto backend : kBackends) {
        for (const bool demanded : {false, true})
          failures += planner_error(c, backend, demanded, mutant).empty() ? 0 : 1;
      }
    }
    EXPECT_GT(failures, 0) << table[i].name << " claimed every case and answered them all";
  }
}

// Every call a module makes reaches the planner: a forward, a cached prefill, a cached decode
// step, a ragged prefill and a ragged decode step of each multi-head module (MLA's absorbed
// decode among them) under every backend each leave exactly one record of the kernel that ran.
TEST(Planner, EveryModuleCallLeavesOneKernelRecord) {
  torch::manual_seed(4);
  const auto x = torch::randn({2, 5, 8});
  const auto lengths = torch::tensor({5, 3}, torch::kInt64);
  const auto one_record = [](const std::string& what, const std::function<void()>& call) {
    F::KernelRecord record;
    call();
    EXPECT_EQ(record.runs().size(), 1u) << what;
  };
  const auto check = [&](auto module, const std::string& name) {
    module->eval();
    const torch::NoGradGuard no_grad;
    for (const auto backend : kBackends) {
      SCOPED_TRACE(name + ", backend " + attnkit::backend_name(backend));
      module->options.backend(backend);
      one_record("forward", [&] { module(x); });
      auto cache = module->make_kv_cache(2, 16);
      one_record("cached prefill", [&] { module->forward_with_cache(x, cache); });
      one_record("cached decode step",
                 [&] { module->forward_with_cache(x.narrow(1, 0, 1), cache); });
      auto ragged = module->make_kv_cache(2, 16);
      one_record("ragged prefill", [&] { module->forward_with_cache(x, ragged, lengths); });
      one_record("ragged decode step", [&] {
        module->forward_with_cache(x.narrow(1, 0, 1), ragged, torch::ones({2}, torch::kInt64));
      });
    }
  };
  const auto mha = MultiHeadAttentionOptions(8, 8, 16, 0.0, 2);
  check(attnkit::MultiHeadAttention(mha), "MultiHeadAttention");
  check(attnkit::MultiHeadAttentionCombinedQKV(mha), "MultiHeadAttentionCombinedQKV");
  check(attnkit::GroupedQueryAttention(attnkit::GroupedQueryAttentionOptions(8, 8, 0.0, 4, 2)),
        "GroupedQueryAttention");
  check(attnkit::MultiHeadLatentAttention(attnkit::MultiHeadLatentAttentionOptions(8, 8, 0.0, 2)),
        "MultiHeadLatentAttention");
}

// A demanded backend's refusal names what it lacks; a module's preference gives way. On
// LibTorch 2.x a demanded fused backend runs a document mask through SDPA with the dense
// mask; on the CPU a preference (and kAuto) keeps the faster chunked kernel.
TEST(Planner, ADemandedBackendNamesWhatItLacksAndAPreferenceGivesWay) {
  auto c = planner_cases()[3];  // documents
  ASSERT_EQ(c.name, "documents");
  c.call.options.backend(AttentionBackend::kFused);
  if (attnkit::detail::libtorch_has_sdpa()) {
    EXPECT_STREQ(attnkit::detail::plan_attention(c.call).name, "sdpa_varlen");
    auto capped = c.call;
    capped.options.score_mod(attnkit::score_mods::softcap(5.0));
    expect_error_containing(
        [&] { attnkit::detail::plan_attention(capped); },
        "[attention] backend fused cannot run this: the fused backend has no score functions");
  } else {
    expect_error_containing(
        [&] { attnkit::detail::plan_attention(c.call); },
        "[attention] backend fused cannot run this: the fused backend takes only causal and "
        "sliding-window masks on LibTorch 1.x (2.x takes any mask through its SDPA), not ");
  }
  c.call.backend_is_preference = true;
  EXPECT_STREQ(attnkit::detail::plan_attention(c.call).name, "chunked");
  auto automatic = c.call;
  automatic.options.backend(AttentionBackend::kAuto);
  EXPECT_STREQ(attnkit::detail::plan_attention(automatic).name, "chunked");
  c.call.with_weights = true;
  EXPECT_STREQ(attnkit::detail::plan_attention(c.call).name, "math");
}

// The public record names the kernel each call ran, with the dtype it computed in: demanded
// backends, the weights, a 16-bit call (float32 inside), a module and a decode step. Records
// nest: the innermost one gets the calls.
TEST(Planner, TheKernelRecordNamesWhatRan) {
  torch::manual_seed(9);
  const auto q = torch::randn({1, 2, 8, 4}), k = torch::randn({1, 2, 8, 4}),
             v = torch::randn({1, 2, 8, 4});
  const auto causal = F::AttentionOptions().mask(Mask::causal());
  F::KernelRecord outer;
  F::attention(q, k, v, F::AttentionOptions(causal).backend(AttentionBackend::kChunked));
  {
    F::KernelRecord inner;
    F::attention_with_weights(q, k, v, causal);
    F::attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16),
                 F::AttentionOptions(causal).backend(AttentionBackend::kChunked));
    F::attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                 F::AttentionOptions(causal).backend(AttentionBackend::kMath));
    ASSERT_EQ(inner.runs().size(), 3u);
    EXPECT_EQ(inner.runs()[0].kernel, "math");
    EXPECT_EQ(inner.runs()[1].kernel, "chunked");
    EXPECT_EQ(inner.runs()[1].computed_in, torch::kFloat);
    EXPECT_EQ(inner.runs()[2].computed_in, torch::kDouble);
    EXPECT_EQ(inner.runs()[2].device, torch::Device(torch::kCPU));
  }
  const auto padding = F::AttentionOptions().mask(Mask::key_padding(torch::tensor({5})));
  if (attnkit::detail::libtorch_has_sdpa()) {
    F::attention(q, k, v, F::AttentionOptions(padding).backend(AttentionBackend::kFused));
    EXPECT_EQ(outer.runs().back().kernel, "sdpa_varlen");
  }
  F::attention(q, k, v, padding);  // kAuto on the CPU: the chunked kernel runs masks faster
  EXPECT_EQ(outer.runs().back().kernel, "chunked");
  attnkit::MultiHeadAttention mha(
      MultiHeadAttentionOptions(4, 8, 16, 0.0, 2).backend(AttentionBackend::kChunked));
  mha->eval();
  const torch::NoGradGuard no_grad;
  const auto x = torch::randn({1, 3, 4});
  mha(x);
  EXPECT_EQ(outer.runs().back().kernel, "chunked");
  auto cache = mha->make_kv_cache(1, 4);
  mha->forward_with_cache(x, cache);
  mha->forward_with_cache(torch::randn({1, 1, 4}), cache);
  EXPECT_EQ(outer.runs().back().kernel, "decode");
  EXPECT_EQ(outer.runs().front().kernel, "chunked");
  EXPECT_EQ(outer.runs().size(), attnkit::detail::libtorch_has_sdpa() ? 6u : 5u);
}

// The masked SDPA route builds a dense mask only within its budget (128 MiB of bools): a
// demand past it is refused with the sizes, and kAuto runs it on the chunked kernel.
TEST(Planner, TheMaskedSdpaRouteKeepsItsDenseMaskWithinItsBudget) {
  AttentionCall call;
  // 2 x 8,192 x 8,192 bools = 128 MiB: within; one more key passes it. Only the shapes
  // matter to the planner: the inputs are expanded, never filled.
  const auto inputs = [&](int64_t m) {
    call.query = torch::zeros({1, 1, 1, 8}).expand({2, 1, 8192, 8});
    call.key = torch::zeros({1, 1, 1, 8}).expand({2, 1, m, 8});
    call.value = call.key;
  };
  // Not segments (those go to the variable-length route, which needs no dense mask).
  call.options.mask(Mask::key_padding(torch::tensor({8000, 8100})) | Mask::causal())
      .backend(AttentionBackend::kFused);
  inputs(8192);
  if (!attnkit::detail::libtorch_has_sdpa())
    GTEST_SKIP() << "LibTorch 1.x: the fused backend has no masked route";
  EXPECT_STREQ(attnkit::detail::plan_attention(call).name, "sdpa_masked");
  inputs(8193);
  expect_error_containing([&] { attnkit::detail::plan_attention(call); },
                          "would take 134234112 bytes, more than its budget of 134217728");
  call.options.backend(AttentionBackend::kAuto);
  EXPECT_STREQ(attnkit::detail::plan_attention(call).name, "chunked");
}

namespace {

// The largest error of `got` against `reference`, relative to the reference's largest value.
double relative_error(const torch::Tensor& got, const torch::Tensor& reference) {
  const auto exact = reference.to(torch::kDouble);
  return ((got.to(torch::kDouble) - exact).abs().max() / exact.abs().max()).item<double>();
}

}  // namespace

// bfloat16 and float16 are computed in float32 and rounded once: on every backend, for every
// mask kind and score function, the output and the gradients of q, k and v are within 2x the
// float32 floor (float32 arithmetic on the same 16-bit inputs, each result rounded once to
// the dtype), errors relative to the largest value of the float64 result. Computed in the
// 16-bit dtype itself they were 3-10x the floor; float16 on LibTorch 1.13 had no CPU matrix
// product at all. On CUDA, LibTorch's kernels (flash, and SDPA on any mask) compute in the
// 16-bit dtype with float32 statistics and accumulators, rounding the weights to the dtype
// before they meet the values, as PyTorch's own SDPA does: their bound is 5x (PyTorch 2.6's CPU
// SDPA is at 4x on outputs and 5.6x on gradients in bfloat16). On CUDA the head size is 64, which
// the fused kernels take, and the test checks which route kAuto chose, by the kernel record.
class SixteenBitDevices : public DeviceTest {};

TEST_P(SixteenBitDevices, EveryBackendMaskAndScoreFunctionIsWithinTheFloat32Floor) {
  const int64_t b = 2, h = 4, n = 256, hd = 64;
  torch::manual_seed(7);
  const auto on = torch::TensorOptions().device(device());
  // Masks live on the attention's device.
  const auto lengths = torch::tensor({256, 150}).to(device());
  const auto ids = torch::cat({torch::zeros({100}, torch::kLong), torch::ones({90}, torch::kLong),
                               torch::full({66}, 2, torch::kLong)})
                       .to(device());
  const auto allowed = torch::rand({b, 1, n, n}).lt(0.7).logical_or(torch::eye(n).to(torch::kBool));
  const auto slopes = attnkit::score_mods::alibi_slopes(h);
  const auto relative = torch::randn({h, 2 * 32 + 1});
  struct Case {
    std::string name;
    F::AttentionOptions options;
    std::string cuda_route;  // kAuto's kernel for bfloat16 on CUDA with LibTorch's flash kernel
  };
  const auto causal = Mask::causal();
  const std::vector<Case> cases{
      {"causal", F::AttentionOptions().mask(causal), "sdpa"},
      {"sliding window", F::AttentionOptions().mask(causal.sliding_window(48)), "flash"},
      {"padding", F::AttentionOptions().mask(Mask::key_padding(lengths)), "flash"},
      {"causal padding", F::AttentionOptions().mask(Mask::key_padding(lengths) & causal), "flash"},
      {"documents", F::AttentionOptions().mask(Mask::documents(ids, /*causal=*/true)), "flash"},
      {"tensor", F::AttentionOptions().mask(Mask::from_tensor(allowed.to(device()))),
       "sdpa_masked"},
      {"mask_mod",
       F::AttentionOptions().mask(Mask::from_function(
           [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q_idx,
              const torch::Tensor& kv_idx) { return (q_idx - kv_idx).remainder(3).ne(1); })),
       "sdpa_masked"},
      {"softcap", F::AttentionOptions().mask(causal).score_mod(attnkit::score_mods::softcap(2.0)),
       "chunked"},
      {"alibi", F::AttentionOptions().mask(causal).score_mod(attnkit::score_mods::alibi(slopes)),
       "sdpa_masked"},
      {"relative position",
       F::AttentionOptions().mask(causal).score_mod(
           attnkit::score_mods::relative_position_bias(relative)),
       "sdpa_masked"},
  };
  const bool on_cuda = device().is_cuda();
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    // Scores of a few units, as trained models have: the softmax is far from uniform.
    const auto q = (2 * torch::randn({b, h, n, hd})).to(on.dtype(dtype));
    const auto k = (2 * torch::randn({b, h, n, hd})).to(on.dtype(dtype));
    const auto v = torch::randn({b, h, n, hd}).to(on.dtype(dtype));
    const auto probe = torch::randn({b, h, n, hd}).to(on.dtype(dtype));
    for (const auto& c : cases) {
      const auto run = [&](const torch::Tensor& q_in, const torch::Tensor& k_in,
                           const torch::Tensor& v_in, AttentionBackend backend) {
        auto options = c.options;
        options.backend(backend).query_block_size(64).key_block_size(64);
        return output_and_grads(
            [&](auto& a, auto& e, auto& f) { return F::attention(a, e, f, options); }, q_in, k_in,
            v_in, probe.to(q_in.scalar_type()));
      };
      const auto exact = run(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                             AttentionBackend::kMath);
      const auto floor = run(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat),
                             AttentionBackend::kMath);
      for (const auto backend : kBackends) {
        if (!F::unsupported_reason(backend, q, k, v, c.options).empty())
          continue;  // the fused backend's masks and score functions, on LibTorch 1.x
        SCOPED_TRACE(c10::str(c.name, ", ", dtype, ", backend ", attnkit::backend_name(backend)));
        F::KernelRecord record;
        const auto got = run(q, k, v, backend);
        ASSERT_EQ(record.runs().size(), 1u);
        const std::string kernel = record.runs()[0].kernel;
        const bool fused_16bit = kernel == "sdpa" || kernel == "flash" || kernel == "sdpa_masked" ||
                                 kernel == "sdpa_varlen";
        if (on_cuda && backend == AttentionBackend::kAuto && dtype == torch::kBFloat16 &&
            attnkit::detail::flash_kernel_available(device())) {
          EXPECT_EQ(kernel, c.cuda_route);
        }
        EXPECT_EQ(record.runs()[0].computed_in,
                  on_cuda && fused_16bit ? dtype : torch::ScalarType(torch::kFloat));
        const double bound = on_cuda && fused_16bit ? 5.0 : 2.0;
        const char* names[] = {"output", "dq", "dk", "dv"};
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].scalar_type(), dtype) << names[i];
          const double floor_error = relative_error(floor[i].to(dtype), exact[i]);
          const double error = relative_error(got[i], exact[i]);
          EXPECT_LE(error, bound * floor_error)
              << names[i] << " (" << kernel << "): the float32 floor is " << floor_error;
          if (on_cuda) {
            std::cout << "[16-bit] " << c.name << " " << dtype << " "
                      << attnkit::backend_name(backend) << " " << kernel << " " << names[i] << " "
                      << error / floor_error << "x floor\n";
          }
        }
      }
    }
  }
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(SixteenBitDevices);

// On CUDA the flash route draws its dropout on the GPU from LibTorch's generator: a seed
// repeats the draw, a new draw differs, and the draws average to the output without dropout
// (inverted dropout keeps the expectation).
TEST(FlashRoute, DropoutIsDrawnOnTheGpuFromTheSeed) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "CUDA not available (torch::cuda::is_available() is false)";
  const torch::Device cuda(torch::kCUDA, 0);
  if (!attnkit::detail::flash_kernel_available(cuda))
    GTEST_SKIP() << "LibTorch's flash kernel is not in this build or not on this GPU";
  torch::manual_seed(11);
  const auto on = torch::TensorOptions().device(cuda).dtype(torch::kBFloat16);
  const int64_t n = 512;
  const auto q = torch::randn({1, 4, n, 64}, on), k = torch::randn({1, 4, n, 64}, on),
             v = torch::randn({1, 4, n, 64}, on);
  const auto ids = torch::arange(n, torch::kLong).div(128, "floor").to(cuda);
  auto options = F::AttentionOptions()
                     .mask(Mask::documents(ids, /*causal=*/true))
                     .dropout_p(0.25)
                     .training(true);
  F::KernelRecord record;
  torch::manual_seed(3);
  const auto first = F::attention(q, k, v, options);
  torch::manual_seed(3);
  const auto again = F::attention(q, k, v, options);
  const auto next = F::attention(q, k, v, options);
  const auto exact = F::attention(q, k, v, F::AttentionOptions(options).training(false));
  for (const auto& run : record.runs())
    EXPECT_EQ(run.kernel, "flash");
  EXPECT_TRUE(torch::equal(first, again));
  EXPECT_FALSE(torch::equal(first, next));
  EXPECT_FALSE(torch::allclose(first, exact, 1e-2, 1e-2));
  auto sum = torch::zeros_like(exact, torch::kFloat);
  const int draws = 256;
  for (int i = 0; i < draws; ++i)
    sum += F::attention(q, k, v, options).to(torch::kFloat);
  const double off = (sum / draws - exact.to(torch::kFloat)).abs().mean().item<double>();
  const double scale = exact.to(torch::kFloat).abs().mean().item<double>();
  EXPECT_LT(off, 0.1 * scale) << "the mean of " << draws << " draws is off by " << off;
}

// Under LibTorch's autocast, attention runs on its inputs cast to the autocast dtype and is
// computed as any 16-bit call: in float32 inside, rounded once. So it answers bit for bit as
// the same call on inputs cast by hand, outputs and gradients, on every backend (were the
// kernels' own matrix products cast down by autocast, they would not). Backward runs after
// the guard, as in PyTorch.
TEST(Autocast, AttentionAnswersAsOnInputsCastByHand) {
  torch::manual_seed(8);
  const int64_t b = 2, h = 2, n = 40, hd = 16;
  const auto q = 2 * torch::randn({b, h, n, hd});
  const auto k = 2 * torch::randn({b, h, n, hd});
  const auto v = torch::randn({b, h, n, hd});
  const auto probe = torch::randn({b, h, n, hd});
  const std::vector<F::AttentionOptions> cases{
      F::AttentionOptions().mask(Mask::causal()),
      F::AttentionOptions().mask(Mask::key_padding(torch::tensor({40, 23}))),
      F::AttentionOptions().mask(Mask::causal()).score_mod(attnkit::score_mods::softcap(2.0))};
  for (const auto& mask : cases) {
    for (const auto backend : kBackends) {
      auto options = mask;
      options.backend(backend).query_block_size(16).key_block_size(16);
      if (!F::unsupported_reason(backend, q, k, v, options).empty())
        continue;
      SCOPED_TRACE(
          c10::str(options.mask().to_string(), ", backend ", attnkit::backend_name(backend)));
      const auto by_hand = output_and_grads(
          [&](auto& a, auto& c, auto& d) {
            return F::attention(a.to(torch::kBFloat16), c.to(torch::kBFloat16),
                                d.to(torch::kBFloat16), options);
          },
          q, k, v, probe);
      const auto under_autocast = output_and_grads(
          [&](auto& a, auto& c, auto& d) {
            attnkit::Autocast autocast(torch::kCPU, torch::kBFloat16);
            return F::attention(a, c, d, options);
          },
          q, k, v, probe);
      const char* names[] = {"output", "dq", "dk", "dv"};
      for (size_t i = 0; i < by_hand.size(); ++i) {
        EXPECT_EQ(under_autocast[i].scalar_type(), i == 0 ? torch::kBFloat16 : torch::kFloat)
            << names[i];
        EXPECT_TRUE(torch::equal(under_autocast[i], by_hand[i])) << names[i];
      }
    }
  }
  // Inputs of several floating dtypes are cast to one; float64 keeps its own, as PyTorch's
  // autocast leaves it; without autocast, mixed dtypes are refused.
  {
    attnkit::Autocast autocast(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(F::attention(q, k.to(torch::kBFloat16), v).scalar_type(), torch::kBFloat16);
    EXPECT_EQ(F::attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble))
                  .scalar_type(),
              torch::kDouble);
    expect_error_containing([&] { F::attention(q.to(torch::kDouble), k, v); },
                            "query, key and value must share a floating dtype, got Double, "
                            "Float, Float");
  }
  expect_error_containing([&] { F::attention(q, k.to(torch::kBFloat16), v); },
                          "query, key and value must share a floating dtype, got Float, "
                          "BFloat16, Float");
}

// The guard turns autocast on for its device type and restores what it found; nested guards
// keep the outer one's state; bad arguments are refused by name.
TEST(Autocast, TheGuardRestoresTheStateItFoundAndRefusesBadArguments) {
  const auto a = torch::randn({3, 3});
  const auto product_dtype = [&] { return torch::mm(a, a).scalar_type(); };
  EXPECT_EQ(product_dtype(), torch::kFloat);
  {
    attnkit::Autocast outer(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(product_dtype(), torch::kBFloat16);
    { attnkit::Autocast inner(torch::kCPU, torch::kBFloat16); }
    EXPECT_EQ(product_dtype(), torch::kBFloat16);
    // CUDA's switch is its own: the CPU's products are still cast.
    { attnkit::Autocast cuda(torch::kCUDA, torch::kHalf); }
    EXPECT_EQ(product_dtype(), torch::kBFloat16);
  }
  EXPECT_EQ(product_dtype(), torch::kFloat);
  expect_error_containing([] { attnkit::Autocast guard(torch::kCPU, torch::kFloat); },
                          "[Autocast] dtype: expected BFloat16 or Half, got Float");
  expect_error_containing([] { attnkit::Autocast guard(torch::kMeta, torch::kBFloat16); },
                          "[Autocast] device_type: expected cpu or cuda, got meta");
  if (attnkit::cpu_multiplies_float16()) {
    attnkit::Autocast half(torch::kCPU, torch::kHalf);
    EXPECT_EQ(product_dtype(), torch::kHalf);
  } else {
    expect_error_containing([] { attnkit::Autocast guard(torch::kCPU, torch::kHalf); },
                            "[Autocast] dtype Half on the CPU needs a LibTorch with float16 "
                            "matrix products");
  }
  EXPECT_EQ(product_dtype(), torch::kFloat);
}

// The variable-length layout: key padding whose valid keys come first and documents that are
// each one run of tokens, alone or with causal(), fall apart into dense segments; any other
// mask does not.
TEST(Varlen, PaddingAndDocumentsFallApartIntoSegments) {
  using attnkit::detail::varlen_layout;
  const auto segments = [](const attnkit::detail::VarlenLayout& layout) {
    std::vector<std::vector<int64_t>> result;
    for (const auto& s : layout.segments)
      result.push_back({s.batch, s.q_begin, s.q_end, s.k_begin, s.k_end});
    return result;
  };
  const auto lengths = Mask::key_padding(torch::tensor({5, 0}));
  auto layout = varlen_layout(lengths, 2, 4, 6);
  ASSERT_TRUE(layout.has_value());
  EXPECT_FALSE(layout->causal);
  EXPECT_EQ(segments(*layout),
            (std::vector<std::vector<int64_t>>{{0, 0, 4, 0, 5}, {1, 0, 4, 0, 0}}));
  layout = varlen_layout(Mask::causal() & lengths, 2, 4, 6);
  ASSERT_TRUE(layout.has_value());
  EXPECT_TRUE(layout->causal);
  // The bool form (true = padding) with its padding at the end, and not.
  const auto padding = torch::tensor({0, 0, 1, 1}).to(torch::kBool).view({1, 4});
  layout = varlen_layout(Mask::key_padding(padding), 1, 3, 4);
  ASSERT_TRUE(layout.has_value());
  EXPECT_EQ(segments(*layout), (std::vector<std::vector<int64_t>>{{0, 0, 3, 0, 2}}));
  EXPECT_FALSE(varlen_layout(Mask::key_padding(padding.flip(1)), 1, 3, 4).has_value());
  layout = varlen_layout(Mask::documents(torch::tensor({{7, 7, 2, 2, 2}, {1, 1, 1, 1, 1}}), true),
                         2, 5, 5);
  ASSERT_TRUE(layout.has_value());
  EXPECT_TRUE(layout->causal);
  EXPECT_EQ(segments(*layout),
            (std::vector<std::vector<int64_t>>{{0, 0, 2, 0, 2}, {0, 2, 5, 2, 5}, {1, 0, 5, 0, 5}}));
  // A document met twice in a row, an offset or window, a tensor mask, `|`, two paddings.
  EXPECT_FALSE(varlen_layout(Mask::documents(torch::tensor({0, 1, 0})), 1, 3, 3).has_value());
  EXPECT_FALSE(varlen_layout(Mask::causal(1) & lengths, 2, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(Mask::causal().sliding_window(2) & lengths, 2, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(Mask::from_tensor(torch::ones({4, 6}, torch::kBool)), 2, 4, 6));
  EXPECT_FALSE(varlen_layout(Mask::causal() | lengths, 2, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(lengths & lengths, 2, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(Mask::causal(), 2, 4, 6).has_value());
  // Masks that do not fit the problem (Mask::check refuses them) do not fall apart either.
  EXPECT_FALSE(varlen_layout(lengths, 3, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(Mask::key_padding(torch::tensor({7, 1})), 2, 4, 6).has_value());
  EXPECT_FALSE(varlen_layout(Mask::documents(torch::tensor({0, 0, 1})), 1, 4, 4).has_value());
}

// Packing puts each segment's tokens in a row of cu_seqlens-delimited buffers (FlashAttention's
// varlen form) and unpacking puts results back, gradients included; attention on the packed
// segments (one SDPA call each; on 1.13 its stand-in) answers as the math core, with a row
// that has no valid key and grouped-query heads.
TEST(Varlen, PackedSegmentsAnswerAsTheMathCore) {
  torch::manual_seed(10);
  const int64_t b = 3, h = 4, g = 2, n = 9, hd = 8;
  const auto q = torch::randn({b, h, n, hd}), k = torch::randn({b, g, n, hd}),
             v = torch::randn({b, g, n, hd}), probe = torch::randn({b, h, n, hd});
  const auto padding = Mask::key_padding(torch::tensor({9, 4, 0}));
  const auto packed =
      attnkit::detail::pack_varlen(q, k, v, *attnkit::detail::varlen_layout(padding, b, n, n));
  EXPECT_EQ(packed.cu_q, (std::vector<int64_t>{0, 9, 18, 27}));
  EXPECT_EQ(packed.cu_k, (std::vector<int64_t>{0, 9, 13, 13}));
  EXPECT_TRUE(torch::equal(packed.cu_q_on_device, torch::tensor(packed.cu_q)));
  EXPECT_TRUE(torch::equal(packed.cu_k_on_device, torch::tensor(packed.cu_k)));
  EXPECT_FALSE(packed.query_index.defined());  // every query, in order: no gather
  EXPECT_EQ(packed.key.sizes(), (std::vector<int64_t>{13, g, hd}));
  EXPECT_TRUE(torch::equal(packed.key[10], k[1].select(1, 1)));  // row 1's second key
  EXPECT_TRUE(
      torch::equal(attnkit::detail::unpack_varlen(packed.query, packed.query_index, b, n), q));
  // `attention` (output and q, k, v gradients) against the math core on `mask`.
  const auto expect_as_math = [&](const Mask& mask, const AttentionFn& attention) {
    const auto got = output_and_grads(attention, q, k, v, probe);
    const auto expected = output_and_grads(
        [&](auto& a, auto& c, auto& d) {
          return F::attention(a, c, d,
                              F::AttentionOptions().mask(mask).backend(AttentionBackend::kMath));
        },
        q, k, v, probe);
    const char* names[] = {"output", "dq", "dk", "dv"};
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(tensors_close(names[i], got[i], expected[i], agreement(torch::kFloat)));
  };
  const auto ids = torch::tensor({{0, 0, 0, 1, 1, 1, 1, 2, 2}});
  for (const auto& mask :
       {padding, Mask::causal() & padding, Mask::documents(ids.expand({b, n}).contiguous()),
        Mask::documents(ids.expand({b, n}).contiguous(), true)}) {
    SCOPED_TRACE(mask.to_string());
    const auto layout = attnkit::detail::varlen_layout(mask, b, n, n);
    ASSERT_TRUE(layout.has_value());
    expect_as_math(mask, [&](auto& a, auto& c, auto& d) {
      return attnkit::detail::sdpa_varlen_attention(a, c, d, *layout, 0.0);
    });
  }
  // FlashAttention's form (flash_varlen_attention on CUDA): the bottom-right parts of each
  // layout, every part's segments run as FlashAttention aligns them (a causal segment's last
  // query sees up to its last key; here the math core with that offset), answer as the
  // math core on the whole mask too.
  const auto bottom_right = [](const attnkit::detail::PackedVarlen& part, bool causal) {
    std::vector<torch::Tensor> outputs;
    for (size_t i = 0; i + 1 < part.cu_q.size(); ++i) {
      const auto segment = [&](const torch::Tensor& x, const std::vector<int64_t>& cu) {
        // (len, heads, d) rows -> (1, heads, len, d)
        return x.slice(0, cu[i], cu[i + 1]).transpose(0, 1).unsqueeze(0);
      };
      const int64_t q_len = part.cu_q[i + 1] - part.cu_q[i];
      const int64_t k_len = part.cu_k[i + 1] - part.cu_k[i];
      const auto out = F::attention(segment(part.query, part.cu_q), segment(part.key, part.cu_k),
                                    segment(part.value, part.cu_k),
                                    F::AttentionOptions()
                                        .mask(causal ? Mask::causal(k_len - q_len) : Mask())
                                        .backend(AttentionBackend::kMath));
      outputs.push_back(out.squeeze(0).transpose(0, 1));  // (1, h, len, d) -> (len, h, d)
    }
    return torch::cat(outputs, 0);
  };
  const auto lengths = torch::tensor({9, 4, 0});
  for (const auto& mask : {Mask::causal() & Mask::key_padding(lengths), Mask::key_padding(lengths),
                           Mask::documents(ids.expand({b, n}).contiguous(), true),
                           Mask::causal() & Mask::key_padding(torch::tensor({0, 0, 0}))}) {
    SCOPED_TRACE(c10::str("bottom-right parts of ", mask.to_string()));
    const auto layout = attnkit::detail::varlen_layout(mask, b, n, n);
    ASSERT_TRUE(layout.has_value());
    expect_as_math(mask, [&](auto& a, auto& c, auto& d) {
      // + 0: every input in the graph, so that a layout with no part (no row has a key)
      // gives zero gradients to compare too
      return attnkit::detail::run_bottom_right_parts(a, c, d, *layout, bottom_right) +
             0 * (a.sum() + c.sum() + d.sum());
    });
  }
  // Row 1 of causal padding (4 of 9 keys): its square part is causal, its last 5 queries see
  // every key; row 2 has no key and stays out.
  const auto parts = attnkit::detail::bottom_right_parts(
      *attnkit::detail::varlen_layout(Mask::causal() & Mask::key_padding(lengths), b, n, n));
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_TRUE(parts[0].causal);
  EXPECT_FALSE(parts[1].causal);
  ASSERT_EQ(parts[0].segments.size(), 2u);
  EXPECT_EQ(parts[0].segments[1].q_end, 4);
  ASSERT_EQ(parts[1].segments.size(), 1u);
  EXPECT_EQ(parts[1].segments[0].q_begin, 4);
  EXPECT_EQ(parts[1].segments[0].k_end, 4);
  // On 2.x a demanded fused backend takes this route for these masks (planner.cpp); 1.x's
  // refuses them (Planner.ADemandedBackendNamesWhatItLacksAndAPreferenceGivesWay).
  if (attnkit::detail::libtorch_has_sdpa()) {
    F::KernelRecord record;
    F::attention(q, k, v, F::AttentionOptions().mask(padding).backend(AttentionBackend::kFused));
    ASSERT_EQ(record.runs().size(), 1u);
    EXPECT_EQ(record.runs()[0].kernel, "sdpa_varlen");
  }
}
