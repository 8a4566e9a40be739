// The fused and chunked kernels and backends against the math path: outputs and every
// gradient (the planner's choices: planner_test.cpp).

#include "attnkit/autocast.h"
#include "attnkit/functional.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/memory_budget.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/score_graph.h"
#include "attnkit/threads.h"
#include "core/kernels/key_ranges.h"
#include "core/kernels/loop_nest_attention.h"
#include "core/kernels/sdpa_kernel.h"
#include "core/plan/planner.h"
#include "core/scores/score_program.h"
#include "test_support.h"

#include <dlfcn.h>

#include <array>
#include <set>

#include <torch/version.h>

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

// The causal mask at `query_offset`, with a sliding window when `window` is set; no mask when
// not `causal`.
attnkit::Mask causal_mask_of(bool causal, int64_t query_offset = 0,
                             c10::optional<int64_t> window = c10::nullopt) {
  if (!causal)
    return {};
  auto mask = attnkit::Mask::causal(query_offset);
  return window.has_value() ? mask.sliding_window(*window) : mask;
}

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
  return F::attention(q, k, v,
                      F::AttentionOptions()
                          .mask(causal_mask_of(causal, query_offset, window))
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

// What a call of attention() asks for besides its tensors: the causal mask at an offset and
// a window, the chunked kernel's tiles, dropout.
struct CoreCall {
  bool causal = false;
  int64_t query_offset = 0;
  c10::optional<int64_t> window;
  int64_t query_block = 128, key_block = 1024;
  double dropout_p = 0.0;
  bool training = false;
};

// `backend` demanded through attention(), the public core.
AttentionFn demanded(AttentionBackend backend, const CoreCall& c) {
  return [=](auto& q, auto& k, auto& v) {
    return F::attention(q, k, v,
                        F::AttentionOptions()
                            .mask(causal_mask_of(c.causal, c.query_offset, c.window))
                            .backend(backend)
                            .query_block_size(c.query_block)
                            .key_block_size(c.key_block)
                            .dropout_p(c.dropout_p)
                            .training(c.training));
  };
}

AttentionFn chunked(bool causal, int64_t block, int64_t key_block) {
  CoreCall c;
  c.causal = causal;
  c.query_block = block;
  c.key_block = key_block;
  return demanded(AttentionBackend::kChunked, c);
}

// The loop-nest kernel's own entry, on any LibTorch and any rank and strides of its inputs
// (attention() takes ranks 2 to 4, and the planner picks the loop nest for kFused on 1.x and
// short sequences only): held to the math core directly. Through the planner, by its name,
// it is Planner.ANamedKernelRunsTheCallOrSaysWhyItCannot's.
AttentionFn loop_nest(bool causal, int64_t query_offset = 0, int64_t window = 0,
                      double dropout_p = 0.0) {
  return [=](auto& q, auto& k, auto& v) {
    return attnkit::detail::loop_nest_attention(
        q, k, v, {attnkit::detail::CausalSpan{causal, query_offset, window}, dropout_p});
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

// The masks come from the global generator: the same seed, the same output, and another draw
// another; then as expect_dropout_off_in_eval_and_differentiable.
void expect_dropout_seeded_off_in_eval_and_differentiable(const AttentionFn& train,
                                                          const AttentionFn& eval,
                                                          const torch::Tensor& q,
                                                          const torch::Tensor& k,
                                                          const torch::Tensor& v) {
  torch::manual_seed(5);
  const auto first = train(q, k, v);
  torch::manual_seed(5);
  EXPECT_TENSOR_NEAR(train(q, k, v), first, 0.0);
  EXPECT_FALSE(torch::equal(train(q, k, v), first));
  expect_dropout_off_in_eval_and_differentiable(train, eval, q, k, v);
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
    if (q.dim() > 4)
      continue;  // attention() takes ranks 2 to 4 (the deprecated adapters more: functional_test)
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
  CoreCall dropped;
  dropped.causal = true;
  dropped.query_block = 4;
  dropped.key_block = 3;
  dropped.dropout_p = 0.3;
  dropped.training = true;
  const auto train = demanded(AttentionBackend::kChunked, dropped);
  const auto eval = chunked(/*causal=*/true, 128, 1024);
  expect_dropout_seeded_off_in_eval_and_differentiable(train, eval, q, k, v);
  const auto exact = eval(q, k, v);
  auto sum = torch::zeros_like(exact);
  const int draws = 400;
  for (int i = 0; i < draws; ++i)
    sum += train(q, k, v);
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
  CoreCall windowed;
  windowed.causal = true;
  windowed.window = 9;
  windowed.dropout_p = 0.2;
  windowed.training = true;
  windowed.query_block = 8;
  windowed.key_block = 16;
  const auto attention = demanded(AttentionBackend::kChunked, windowed);
  const auto run = [&](int threads) {
    attnkit::set_num_threads(threads);
    torch::manual_seed(5);
    return output_and_grads(attention, q, k, v, probe);
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

// pip's LibTorch links MKL, whose thread count is also per thread: a product inside one of
// run_tasks' tasks must find MKL on one thread (else it takes MKL's threaded driver, which then
// runs alone, about 9% slower per call), and the calling thread has its count back afterwards.
// Debian's LibTorch has no MKL: nothing to check there.
TEST(Threads, TasksRunMklOnOneThreadAndGiveItsCountBack) {
  const auto mkl_max_threads =
      reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "MKL_Get_Max_Threads"));
  if (mkl_max_threads == nullptr)
    GTEST_SKIP() << "this LibTorch has no MKL";
  const ThreadCountsRestorer restore;
  attnkit::set_num_threads(2);
  ASSERT_EQ(mkl_max_threads(), 2);
  std::array<int, 4> in_task{};
  attnkit::run_tasks(static_cast<int64_t>(in_task.size()), torch::kCPU,
                     [&](int64_t t) { in_task[static_cast<size_t>(t)] = mkl_max_threads(); });
  for (size_t t = 0; t < in_task.size(); ++t)
    EXPECT_EQ(in_task[t], 1) << "task " << t;
  EXPECT_EQ(mkl_max_threads(), 2);
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
  expect_matches_math_on_kernel_shapes([](bool causal) { return loop_nest(causal); });
}

TEST(FusedAttention, AnyRankAndStridedInputsMatchMath) {
  for (const auto& q : inputs_of_any_rank_and_strides()) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(c10::str("shape ", q.sizes(), " causal ", causal));
      const auto probe = torch::randn(q.sizes(), torch::kFloat64);
      expect_matches_math(loop_nest(causal), q, q.flip(-2), q * 2, probe, causal);
    }
  }
}

TEST(FusedAttention, DropoutDrawsTheMathPathsMaskAndIsDifferentiable) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto k = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto v = torch::randn({2, 2, 10, 4}, torch::kFloat64);
  const auto train = loop_nest(/*causal=*/true, 0, 0, /*dropout_p=*/0.3);
  // Drawn from the global generator as torch::dropout draws: the math path's mask.
  torch::manual_seed(5);
  const auto out = train(q, k, v);
  torch::manual_seed(5);
  const auto math = math_reference(q, k, v, /*causal=*/true, 0, c10::nullopt, /*dropout_p=*/0.3);
  EXPECT_TENSOR_NEAR(out, math, 1e-10);
  expect_dropout_off_in_eval_and_differentiable(train, loop_nest(/*causal=*/true), q, k, v);
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
        const auto parts = qkv.chunk(3, -1);
        const auto split = [&](const torch::Tensor& t) {
          return t.view({b, n, heads, hd}).transpose(1, 2);  // (b, n, d) -> (b, h, n, hd)
        };
        if (packed) {
          // The packed loop nest by name, on the head views of the projection it reads.
          attnkit::detail::AttentionCall call;
          call.query = split(parts[0]);
          call.key = split(parts[1]);
          call.value = split(parts[2]);
          call.packed_qkv = qkv;
          call.options = F::AttentionOptions()
                             .mask(causal_mask_of(causal))
                             .dropout_p(dropout)
                             .training(dropout > 0.0)
                             .kernel("packed_loop_nest");
          // (b, h, n, hd) -> (b, n, h, hd) -> (b, n, h * hd)
          out = attnkit::detail::run_attention(call).context.transpose(1, 2).reshape({b, n, -1});
        } else {
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

// The fused backend's attention on this LibTorch: LibTorch's own SDPA on >= 2.0, attnkit's
// kernel or the math core on 1.13 (each CI leg tests its own).
AttentionFn fused_backend(bool causal, double dropout_p = 0.0, bool training = false) {
  CoreCall c;
  c.causal = causal;
  c.dropout_p = dropout_p;
  c.training = training;
  return demanded(AttentionBackend::kFused, c);
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
  CoreCall window_of_7;
  window_of_7.causal = true;
  window_of_7.window = 7;
  const auto windowed = demanded(AttentionBackend::kFused, window_of_7);
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
         CoreCall c;
         c.causal = true;
         c.query_offset = offset;
         c.query_block = 5;
         c.key_block = 4;
         return demanded(AttentionBackend::kChunked, c);
       }},
      {"loop-nest kernel", [](int64_t offset) { return loop_nest(/*causal=*/true, offset); }},
      {"fused backend", [](int64_t offset) {
         CoreCall c;
         c.causal = true;
         c.query_offset = offset;
         return demanded(AttentionBackend::kFused, c);
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

TEST(AttentionBackends, EveryBackendComputesTheSameModule) {
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (const bool causal : {true, false}) {
      for (const bool combined : {false, true}) {
        SCOPED_TRACE(c10::str("dtype ", dtype, " causal ", causal, " combined ", combined));
        torch::manual_seed(21);
        const auto options = MultiHeadAttentionOptions(6, 8, 12, 0.0, 2)
                                 .qkv_bias(true)
                                 .causal(causal)
                                 .query_block_size(4)
                                 .key_block_size(3);
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
      [] {
        attnkit::MultiHeadAttention(MultiHeadAttentionOptions(4, 4, 8, 0.0, 2).query_block_size(0));
      },
      "[MultiHeadAttention] option query_block_size must be > 0, got 0");
  expect_error_containing(
      [] {
        attnkit::MultiHeadAttention(MultiHeadAttentionOptions(4, 4, 8, 0.0, 2).key_block_size(-1));
      },
      "[MultiHeadAttention] option key_block_size must be > 0, got -1");
}

// The memory budget (attnkit/memory_budget.h): a math call whose (b, h, n, m) tensors would
// exceed it is refused before they are made, naming the size and the way out; kAuto runs the
// same call on a tiled kernel within it.
TEST(MemoryBudget, TheMathCoreIsRefusedOverTheBudgetAndKAutoTilesInstead) {
  struct RestoreDefault {
    ~RestoreDefault() { attnkit::set_memory_budget(0); }
  } restore;
  EXPECT_EQ(attnkit::memory_budget(), attnkit::physical_memory() / 2);
  // The case: n 200,000 under the default budget asked for 40 GB for the dense mask.
  const auto long_q = torch::randn({1, 1, 200000, 8});
  expect_error_containing(
      [&] {
        F::attention(
            long_q, long_q, long_q,
            F::AttentionOptions().mask(attnkit::Mask::causal()).backend(AttentionBackend::kMath));
      },
      "[attention]: the math backend's scores and weights and dense mask for (batch, heads, n, "
      "m) = (1, 1, 200000, 200000) in Float needs 360 GB, over attnkit's memory budget of ");
  expect_error_containing(
      [&] {
        F::attention(
            long_q, long_q, long_q,
            F::AttentionOptions().mask(attnkit::Mask::causal()).backend(AttentionBackend::kMath));
      },
      " (half of this machine's ");

  attnkit::set_memory_budget(1000000);  // 1 MB: (1, 2, 512, 512) float scores are 2 MB
  EXPECT_EQ(attnkit::memory_budget(), 1000000);
  const auto q = torch::randn({1, 2, 512, 8});
  const auto causal = F::AttentionOptions().mask(attnkit::Mask::causal());
  expect_error_containing(
      [&] { F::attention(q, q, q, F::AttentionOptions(causal).backend(AttentionBackend::kMath)); },
      "(batch, heads, n, m) = (1, 2, 512, 512) in Float needs 4.46 MB, over attnkit's memory "
      "budget of 1.00 MB (attnkit::set_memory_budget); use AttentionBackend::kAuto or kChunked, "
      "which tile the scores in memory linear in n, or raise the budget with "
      "attnkit::set_memory_budget");
  expect_error_containing([&] { F::attention_with_weights(q, q, q, causal); },
                          "the weights are that size themselves: ask for the context alone");
  // kAuto and kChunked stay within it, and agree with the math core run under a larger one.
  const auto tiled = F::attention(q, q, q, causal);
  const auto chunked =
      F::attention(q, q, q, F::AttentionOptions(causal).backend(AttentionBackend::kChunked));
  attnkit::set_memory_budget(0);
  const auto math =
      F::attention(q, q, q, F::AttentionOptions(causal).backend(AttentionBackend::kMath));
  EXPECT_TENSOR_NEAR(tiled, math, 1e-5);
  EXPECT_TENSOR_NEAR(chunked, math, 1e-5);
  expect_error_containing([] { attnkit::set_memory_budget(-1); },
                          "[set_memory_budget] bytes must be > 0 (or 0 for the default, half of "
                          "physical memory), got -1");
}

// A NaN in one key and value under a causal mask (docs/backends.md, "NaN"): every backend
// makes NaN each row that sees it; a row that does not see it is NaN on kMath (0 x NaN in the
// value product, as PyTorch's math SDPA) and finite on the tiled kernels unless it shares a
// tile with the NaN key.
TEST(AttentionBackends, ANaNReachesTheRowsThatSeeItOnEveryBackend) {
  torch::manual_seed(5);
  const auto q = torch::randn({1, 1, 8, 4});
  auto k = torch::randn({1, 1, 8, 4}), v = torch::randn({1, 1, 8, 4});
  k[0][0][5].fill_(NAN);
  v[0][0][5].fill_(NAN);
  const auto nan_rows = [&](F::AttentionOptions options) {
    const auto out = F::attention(q, k, v, options.mask(attnkit::Mask::causal()));
    return out[0][0].isnan().any(/*dim=*/1).to(torch::kInt64);  // (8): 1 where the row is NaN
  };
  const auto rows = [](std::vector<int64_t> flags) { return torch::tensor(flags); };
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kChunked,
                             AttentionBackend::kFused, AttentionBackend::kAuto}) {
    const auto nan = nan_rows(F::AttentionOptions().backend(backend));
    EXPECT_TRUE(nan.slice(0, 5).all().item<bool>()) << attnkit::backend_name(backend) << nan;
  }
  EXPECT_TRUE(torch::equal(nan_rows(F::AttentionOptions().backend(AttentionBackend::kMath)),
                           rows({1, 1, 1, 1, 1, 1, 1, 1})));
  // Tiles of 4 x 4: rows 0-3 never meet keys 4-7 (their tile is wholly masked and skipped);
  // row 4 shares the tile of keys 4-7, where its zero weight meets the NaN value.
  const auto tiled = F::AttentionOptions()
                         .backend(AttentionBackend::kChunked)
                         .query_block_size(4)
                         .key_block_size(4);
  EXPECT_TRUE(torch::equal(nan_rows(tiled), rows({0, 0, 0, 0, 1, 1, 1, 1})));
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
  const auto options =
      F::AttentionOptions().mask(causal_mask_of(/*causal=*/true, /*query_offset=*/2, /*window=*/3));
  const auto grouped = F::attention_with_weights(q, k, v, options);
  for (int64_t h = 0; h < 6; ++h) {
    const auto one = F::attention_with_weights(q.narrow(1, h, 1), k.narrow(1, h / 2, 1),
                                               v.narrow(1, h / 2, 1), options);
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
         CoreCall c;
         c.causal = true;
         c.query_offset = offset;
         c.window = window;
         c.query_block = 5;
         c.key_block = 4;
         return demanded(AttentionBackend::kChunked, c)(q, k, v);
       }},
      {"loop-nest kernel",
       [](auto& q, auto& k, auto& v, int64_t offset, c10::optional<int64_t> window) {
         return loop_nest(/*causal=*/true, offset, window.value_or(0))(q, k, v);
       }},
      {"fused backend",
       [](auto& q, auto& k, auto& v, int64_t offset, c10::optional<int64_t> window) {
         CoreCall c;
         c.causal = true;
         c.query_offset = offset;
         c.window = window;
         return demanded(AttentionBackend::kFused, c)(q, k, v);
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

// The fused tile kernel against the float64 math core: each score variant (none, softcap,
// ALiBi, a relative-position table of one row per head or one shared) under each kind of
// mask, forward and every gradient, the tables' too. Blocks of 16 queries and tiles of up to
// 48 keys over 70 tokens leave partial tiles at ragged edges; the tensor mask leaves a row
// that sees no key; 4 query heads share 2 key/value heads; the value width differs.
TEST(FusedTiles, EveryScoreVariantAndMaskMatchesTheFloat64MathCore) {
  torch::manual_seed(21);
  const int64_t b = 2, h = 4, kv = 2, n = 70, hd = 8, dv = 6;
  auto no_key_row = torch::rand({n, n}) < 0.3;
  no_key_row[9].fill_(false);  // query 9 sees nothing
  const auto document_ids = torch::arange(n).div(23, "floor");
  const std::vector<std::pair<std::string, attnkit::Mask>> masks{
      {"no mask", attnkit::Mask()},
      {"causal", attnkit::Mask::causal()},
      {"window 20", attnkit::Mask::causal().sliding_window(20)},
      {"documents", attnkit::Mask::documents(document_ids, /*causal=*/true)},
      {"prefix-LM documents",
       attnkit::Mask::documents(document_ids) &
           (attnkit::Mask::causal() | attnkit::Mask::from_function([](auto, auto, auto, auto key) {
              return key.remainder(23) < 5;
            }))},
      {"tensor with an empty row", attnkit::Mask::from_tensor(no_key_row)}};
  const auto slopes = attnkit::score_mods::alibi_slopes(h).requires_grad_(true);
  const auto table = (torch::randn({h, 2 * 10 + 1}) * 0.5).requires_grad_(true);
  const auto shared_table = (torch::randn({1, 2 * 3 + 1}) * 0.5).requires_grad_(true);
  const std::vector<std::tuple<std::string, attnkit::ScoreMod, torch::Tensor>> variants{
      {"none", {}, {}},
      {"softcap 2", attnkit::score_mods::softcap(2.0), {}},
      {"alibi", attnkit::score_mods::alibi(slopes), slopes},
      {"relative table", attnkit::score_mods::relative_position_bias(table), table},
      {"shared relative table", attnkit::score_mods::relative_position_bias(shared_table),
       shared_table}};
  const auto q = torch::randn({b, h, n, hd}, torch::kFloat64) * 2;
  const auto k = torch::randn({b, kv, n, hd}, torch::kFloat64) * 2;
  const auto v = torch::randn({b, kv, n, dv}, torch::kFloat64);
  const auto grad_out = torch::randn({b, h, n, dv}, torch::kFloat64);
  for (const auto& [mask_name, mask] : masks) {
    for (const auto& [variant_name, score_mod, parameter] : variants) {
      SCOPED_TRACE(mask_name + ", " + variant_name);
      const auto options =
          F::AttentionOptions().mask(mask).score_mod(score_mod).query_block_size(16).key_block_size(
              48);
      const auto run = [&](torch::ScalarType dtype, const std::string& kernel) {
        std::vector<torch::Tensor> inputs;
        for (const auto* t : {&q, &k, &v})
          inputs.push_back(t->to(dtype).detach().requires_grad_(true));
        if (parameter.defined())
          inputs.push_back(parameter);
        F::KernelRecord record;
        const auto out = F::attention(inputs[0], inputs[1], inputs[2],
                                      F::AttentionOptions(options).kernel(kernel));
        EXPECT_EQ(record.runs().at(0).kernel, kernel);
        auto grads = torch::autograd::grad({out}, inputs, {grad_out.to(dtype)});
        grads.insert(grads.begin(), out);
        return grads;
      };
      const auto expected = run(torch::kFloat64, "math");
      const auto in_float64 = run(torch::kFloat64, "fused_tiles");
      const auto in_float32 = run(torch::kFloat, "fused_tiles");
      const std::vector<std::string> names{"output", "grad q", "grad k", "grad v", "grad table"};
      for (size_t i = 0; i < expected.size(); ++i) {
        // float64: only the sums' order differs; float32: its rounding of the same sums. The
        // tables are float32, and the math core's autograd sums their gradient in float32.
        const bool float32_table = i == 4;
        EXPECT_TRUE(tensors_close(names[i] + " (float64)", in_float64[i], expected[i],
                                  float32_table ? 1e-5 : 1e-10, float32_table ? 1e-5 : 0.0));
        EXPECT_TRUE(tensors_close(names[i] + " (float32)", in_float32[i], expected[i],
                                  i == 0 ? 2e-5 : 2e-4, 1e-4));
      }
    }
  }
}

// Central differences of the fused tile kernel's loss against its gradients, in float64, for
// each score variant and a general graph under a mask with partial tiles: the queries', keys',
// values' and the table's (gradcheck's test, which has no C++ form).
TEST(FusedTiles, EachScoreVariantsGradientsAreTheFiniteDifferences) {
  torch::manual_seed(8);
  const int64_t h = 2, n = 11, hd = 3;
  const auto options = F::AttentionOptions()
                           .mask(attnkit::Mask::causal().sliding_window(6))
                           .query_block_size(4)
                           .key_block_size(8)
                           .kernel("fused_tiles");
  const std::vector<std::pair<std::string, std::function<attnkit::ScoreMod(torch::nn::Module&)>>>
      variants{{"none", [](torch::nn::Module&) { return attnkit::ScoreMod(); }},
               {"softcap", [](torch::nn::Module&) { return attnkit::score_mods::softcap(0.7); }},
               {"alibi",
                [&](torch::nn::Module& m) {
                  return attnkit::score_mods::alibi(
                      m.register_parameter("slopes", torch::rand({h}, torch::kFloat64)));
                }},
               {"relative table",
                [&](torch::nn::Module& m) {
                  return attnkit::score_mods::relative_position_bias(
                      m.register_parameter("table", torch::randn({h, 2 * 3 + 1}, torch::kFloat64)));
                }},
               {"graph: softcap over a per-head bias", [&](torch::nn::Module& m) {
                  return attnkit::ScoreGraph::parse(
                             "index $0 %2\nadd %0 %5\ndiv %6 f:0.9\ntanh %7\nmul %8 f:0.9")
                      .bind({m.register_parameter("bias", torch::randn({h}, torch::kFloat64))});
                }}};
  for (const auto& [name, make] : variants) {
    SCOPED_TRACE(name);
    torch::nn::Module holder;
    const auto score_mod = make(holder);
    auto key = holder.register_parameter("key", torch::randn({1, h, n, hd}, torch::kFloat64));
    auto value = holder.register_parameter("value", torch::randn({1, h, n, hd}, torch::kFloat64));
    expect_gradients_match_finite_differences(
        holder,
        [&](const torch::Tensor& query) {
          F::KernelRecord record;
          auto out =
              F::attention(query, key, value, F::AttentionOptions(options).score_mod(score_mod));
          EXPECT_EQ(record.runs().at(0).kernel, "fused_tiles");
          return out;
        },
        torch::randn({1, h, n, hd}, torch::kFloat64));
  }
}

// General score graphs, which the fused tile kernel compiles for its rows (score_program.h),
// against the float64 math core, whose autograd differentiates the same graph op by op:
// forward and every gradient, the captured tensors' too, under a mask with partial tiles and
// a row that sees no key, with GQA. The graphs cover an additive bias tensor, a softcap over
// a bias, division by a uniform value and by rows (the score's too), integer index
// arithmetic, bool and bitwise operations, where, clamp and the unary and binary functions,
// and a one-element captured tensor.
TEST(FusedTiles, ScoreGraphsMatchTheFloat64MathCore) {
  torch::manual_seed(5);
  const int64_t b = 2, h = 4, kv = 2, n = 37, hd = 8;
  auto allowed = torch::rand({n, n}) < 0.6;
  allowed[4].fill_(false);  // query 4 sees nothing
  const auto mask = attnkit::Mask::from_tensor(allowed) & attnkit::Mask::causal();
  const auto f64 = torch::kFloat64;
  const auto bias = (torch::randn({b, h, n, n}, f64) * 0.5).requires_grad_(true);
  const auto heads_bias = (torch::randn({h, n, n}, f64) * 0.5).requires_grad_(true);
  const auto per_head = torch::randn({h}, f64).requires_grad_(true);
  const auto temperature = torch::full({}, 0.8, f64).requires_grad_(true);
  const auto document_ids = torch::arange(n).div(11, "floor");
  const auto table = (torch::randn({h, 9}, f64) * 0.3).requires_grad_(true);
  const std::vector<std::tuple<std::string, std::string, std::vector<torch::Tensor>>> graphs{
      {"bias tensor", "index $0 %1 %2 %3 %4\nadd %0 %5", {bias}},
      // Written in place by one task per entry, every batch slice in that task.
      {"bias shared by the batch", "index $0 %2 %3 %4\nadd %0 %5", {heads_bias}},
      // Gradients summed over two reads: not written in place.
      {"bias read twice",
       "index $0 %1 %2 %3 %4\nindex $0 %1 %2 %4 %3\nadd %5 %6\nadd %0 %7",
       {bias}},
      {"softcap over a bias",
       "index $0 %2\nadd %0 %5\ndiv %6 f:2.5\ntanh %7\nmul %8 f:2.5",
       {per_head}},
      {"bucketed distance",
       "sub %3 %4\nabs %5\nfloor_divide %6 i:4\nclamp %7 _ i:8\nindex $0 %2 %8\nadd %0 %9",
       {table}},
      {"documents as a bias",
       "index $0 %3\nindex $0 %4\neq %5 %6\nfloat %7\nmul %8 f:1.5\nadd %0 %9",
       {document_ids}},
      {"temperature", "mul %0 $0", {temperature}},
      {"division by rows",
       "remainder %4 i:4\nadd %5 i:1\ndiv %0 %6\nexp %0\ndiv %7 %8\nadd %9 %0",
       {}},
      {"odd keys", "bitwise_and %4 i:1\neq %5 i:1\nmul %0 $0\nwhere %6 %7 %0", {temperature}},
      {"functions",
       "clamp %0 f:-2.0 f:2.0\nsigmoid %5\nmul %6 %0\nmul %0 %0\nadd %8 f:1.0\nlog %9\n"
       "sqrt %9\nsub %7 %10\nadd %12 %11\nmaximum %13 f:-4.0\nremainder %3 i:3\nfloat %15\n"
       "atan2 %0 %16\nsub %14 %17\nexp2 %0\nminimum %19 f:3.0\nadd %18 %20",
       {}}};
  const auto q = torch::randn({b, h, n, hd}, f64);
  const auto k = torch::randn({b, kv, n, hd}, f64);
  const auto v = torch::randn({b, kv, n, hd}, f64);
  const auto grad_out = torch::randn({b, h, n, hd}, f64);
  for (const auto& [name, text, tensors] : graphs) {
    SCOPED_TRACE(name);
    const auto graph = attnkit::ScoreGraph::parse(text);
    // dtype's inputs and captured floating tensors (a float32 call's graph reads float32
    // tensors, as LibTorch's dtype check asks), forward and every gradient.
    const auto run = [&](const std::string& kernel, torch::ScalarType dtype) {
      std::vector<torch::Tensor> inputs, captured;
      for (const auto* t : {&q, &k, &v})
        inputs.push_back(t->to(dtype).detach().requires_grad_(true));
      for (const auto& t : tensors) {
        captured.push_back(
            t.is_floating_point() ? t.to(dtype).detach().requires_grad_(t.requires_grad()) : t);
        if (t.requires_grad())
          inputs.push_back(captured.back());
      }
      const auto options = F::AttentionOptions()
                               .mask(mask)
                               .score_mod(graph.bind(captured))
                               .query_block_size(8)
                               .key_block_size(16)
                               .kernel(kernel);
      F::KernelRecord record;
      const auto out = F::attention(inputs[0], inputs[1], inputs[2], options);
      EXPECT_EQ(record.runs().at(0).kernel, kernel);
      auto grads = torch::autograd::grad({out}, inputs, {grad_out.to(dtype)});
      grads.insert(grads.begin(), out);
      return grads;
    };
    const auto expected = run("math", torch::kFloat64);
    const auto in_float64 = run("fused_tiles", torch::kFloat64);
    const auto in_float32 = run("fused_tiles", torch::kFloat32);
    ASSERT_EQ(in_float64.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      // float64: only the order of the sums differs (both evaluate the graph in float64);
      // float32: its rounding, and tanh in float32.
      EXPECT_TRUE(tensors_close(c10::str("result ", i, " (float64)"), in_float64[i], expected[i],
                                1e-10, 1e-10));
      EXPECT_TRUE(tensors_close(c10::str("result ", i, " (float32)"), in_float32[i], expected[i],
                                i == 0 ? 2e-5 : 2e-4, 1e-4));
    }
  }
}

// What the row programs cannot evaluate stays on the chunked kernel, and a forced fused call
// says why; an index out of range is LibTorch's error in either kernel.
// Which captured tensors backward writes the gradient of in place, each entry once
// (ScoreProgram::reads_an_entry_per_score): one read, at the score's own (b, h, q_idx, kv_idx).
TEST(FusedTiles, OnlyATensorEachScoreReadsItsOwnEntryOfIsWrittenInPlace) {
  const auto bias = torch::zeros({2, 3, 5, 5});
  const auto heads_bias = torch::zeros({3, 5, 5});
  const auto reads_own = [](const std::string& text, const torch::Tensor& tensor,
                            bool slices_in_one_task) {
    std::string why;
    const auto program = attnkit::detail::ScoreProgram::compile(attnkit::ScoreGraph::parse(text),
                                                                {tensor}, false, &why);
    EXPECT_TRUE(program) << why;
    return program && program->reads_an_entry_per_score(0, slices_in_one_task);
  };
  EXPECT_TRUE(reads_own("index $0 %1 %2 %3 %4\nadd %0 %5", bias, false));
  EXPECT_TRUE(reads_own("index $0 %2 %3 %4\nadd %0 %5", heads_bias, true));
  // The same (heads, n, n) bias under a batch of several, each slice in its own task: every
  // batch slice adds to it.
  EXPECT_FALSE(reads_own("index $0 %2 %3 %4\nadd %0 %5", heads_bias, false));
  // Keys and queries swapped, an index computed from kv_idx, two reads.
  EXPECT_FALSE(reads_own("index $0 %1 %2 %4 %3\nadd %0 %5", bias, false));
  EXPECT_FALSE(reads_own("sub %4 i:0\nindex $0 %1 %2 %3 %5\nadd %0 %6", bias, false));
  EXPECT_FALSE(
      reads_own("index $0 %1 %2 %3 %4\nindex $0 %1 %2 %3 %4\nadd %5 %6\nadd %0 %7", bias, false));
}

TEST(FusedTiles, ScoreGraphsItCannotEvaluateGoToTheChunkedKernel) {
  const auto q = torch::randn({1, 2, 40, 8});
  const auto options = F::AttentionOptions().mask(attnkit::Mask::causal());
  const auto graph = [](const std::string& text, std::vector<torch::Tensor> tensors = {}) {
    return attnkit::ScoreGraph::parse(text).bind(std::move(tensors));
  };
  // Graphs LibTorch evaluates (a bool sum is a logical or; a tensor as wide as the keys
  // broadcasts along them) that rows do not.
  const std::vector<std::tuple<std::string, std::vector<torch::Tensor>, std::string>> refused{
      {"gt %4 %3\nge %4 i:30\nadd %5 %6\nwhere %7 f:-1.0 %0", {}, "add of bools"},
      {"mul %0 $0",
       {torch::rand({40})},
       "a captured tensor of more than one element outside an index"}};
  for (const auto& [text, tensors, reason] : refused) {
    SCOPED_TRACE(text);
    const auto mod = graph(text, tensors);
    F::KernelRecord record;
    const auto out = F::attention(q, q, q, F::AttentionOptions(options).score_mod(mod));
    EXPECT_EQ(record.runs().at(0).kernel, "chunked");
    EXPECT_TRUE(tensors_close(
        "chunked", out,
        F::attention(q, q, q, F::AttentionOptions(options).score_mod(mod).kernel("math")), 1e-5));
    expect_error_containing(
        [&] {
          F::attention(q, q, q, F::AttentionOptions(options).score_mod(mod).kernel("fused_tiles"));
        },
        "the fused tile kernel evaluates named score functions and ScoreGraphs only, not " +
            reason);
  }
  // kv_idx past the tensor's 30 entries: the fused kernel raises LibTorch's message.
  const auto short_bias = torch::randn({30});
  expect_error_containing(
      [&] {
        F::attention(q, q, q,
                     F::AttentionOptions(options)
                         .score_mod(graph("index $0 %4\nadd %0 %5", {short_bias}))
                         .kernel("fused_tiles"));
      },
      "[ScoreGraph] index 30 is out of bounds for dimension 0 with size 30");
}

// Dropout in the fused tile kernel and, for the calls it leaves, the chunked kernel: the same
// seed gives the same output, eval has none, the gradients are those of the drawn masks
// (central differences, each call reseeded), under a causal mask with partial tiles and GQA.
// Where each query sees only its own key, an output row is its value row times 0 or
// 1 / (1 - p), dropped at about the rate p.
TEST(FusedTiles, DropoutIsSeededDifferentiableAndDropsAtItsRate) {
  torch::manual_seed(9);
  const auto f64 = torch::kFloat64;
  const auto q = torch::randn({1, 4, 11, 3}, f64), k = torch::randn({1, 2, 11, 3}, f64),
             v = torch::randn({1, 2, 11, 3}, f64);
  for (const std::string kernel : {"fused_tiles", "chunked"}) {
    SCOPED_TRACE(kernel);
    const auto options = F::AttentionOptions()
                             .mask(attnkit::Mask::causal())
                             .query_block_size(4)
                             .key_block_size(8)
                             .kernel(kernel);
    const AttentionFn train = [options](auto& a, auto& b, auto& c) {
      F::KernelRecord record;
      auto out = F::attention(a, b, c, F::AttentionOptions(options).dropout_p(0.3).training(true));
      EXPECT_EQ(record.runs().at(0).kernel, options.kernel());
      return out;
    };
    const AttentionFn eval = [options](auto& a, auto& b, auto& c) {
      return F::attention(a, b, c, options);
    };
    expect_dropout_seeded_off_in_eval_and_differentiable(train, eval, q, k, v);
  }
  const int64_t n = 4000;
  const auto values = torch::rand({1, 1, n, 2}, f64) + 1;
  const auto out =
      F::attention(torch::randn({1, 1, n, 2}, f64), torch::randn({1, 1, n, 2}, f64), values,
                   F::AttentionOptions()
                       .mask(attnkit::Mask::causal().sliding_window(1))
                       .dropout_p(0.25)
                       .training(true)
                       .kernel("fused_tiles"));
  const auto factor = (out / values).select(-1, 0);
  const auto dropped = factor.eq(0);
  EXPECT_TRUE(torch::allclose(factor.masked_select(~dropped), torch::full({}, 1 / 0.75, f64)));
  const double rate = dropped.to(f64).mean().item<double>();
  EXPECT_NEAR(rate, 0.25, 0.03);  // 5 standard deviations of 4,000 draws
}

// Backward's key ranges (core/kernels/key_ranges.h): where they start, which range owns each query
// block's dQ, and the slots the others write; then the kernel with them (4 workers, one
// key/value head: 4 tasks per worker need ranges) against the same call on one worker, which
// splits nothing.
TEST(FusedTiles, KeyRangesSplitBackwardAndGiveOneWorkersGradients) {
  using attnkit::TileKind;
  using attnkit::detail::split_keys;
  using attnkit::detail::TileVisit;
  // Four query blocks of 16 over 64 keys, causal: block qi sees [0, 16 qi) whole and its
  // diagonal block partly, so the keys' weights are 64, 48, 32, 16 rows.
  const auto causal_tiles = [](int64_t qi) {
    std::vector<TileVisit> tiles;
    if (qi > 0)
      tiles.push_back({0, 16 * qi, TileKind::kFull});
    tiles.push_back({16 * qi, 16, TileKind::kPartial});
    return tiles;
  };
  const auto causal =
      split_keys(2, /*most_free=*/2, 16, 64, 4, 16, causal_tiles, /*slot_budget_rows=*/64);
  ASSERT_EQ(causal.ranges.count(), 2);
  EXPECT_EQ(causal.ranges.begin(1), 32);  // 112 of 160 rows' weight before it
  EXPECT_EQ(causal.slot_rows, 32);        // blocks 2 and 3 see both ranges
  for (int64_t qi = 0; qi < 4; ++qi) {
    EXPECT_EQ(causal.owner_of(qi), 0) << qi;
    EXPECT_EQ(causal.slot_of(qi, 0), -1) << qi;
    EXPECT_EQ(causal.slot_of(qi, 1), qi < 2 ? -1 : 16 * (qi - 2)) << qi;
  }
  // Its whole tile of block 3, cut to range 1, keeps the tile it came from.
  const auto parts = causal.ranges.part(causal_tiles(3), 1, 64);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].part.key_begin, 32);
  EXPECT_EQ(parts[0].part.keys, 16);
  EXPECT_EQ(parts[0].whole.key_begin, 0);
  EXPECT_EQ(parts[0].whole.keys, 48);
  // Slots over the budget: fewer ranges (here one, no split).
  EXPECT_EQ(split_keys(2, 2, 16, 64, 4, 16, causal_tiles, 31).ranges.count(), 1);
  // Two causal documents of 32 (weights 32, 16, 32, 16): four ranges would cut block 1's
  // tiles [0, 32) and [32, 64) and need two slots; within a budget of none, two ranges.
  const auto document_tiles = [](int64_t qi) {
    return std::vector<TileVisit>{{qi < 2 ? 0 : 32, 16 * (qi % 2 + 1), TileKind::kPartial}};
  };
  EXPECT_EQ(split_keys(4, 4, 16, 64, 4, 16, document_tiles, 32).ranges.count(), 4);
  const auto documents = split_keys(4, 4, 16, 64, 4, 16, document_tiles, 0);
  ASSERT_EQ(documents.ranges.count(), 2);
  EXPECT_EQ(documents.ranges.begin(1), 32);
  EXPECT_EQ(documents.slot_rows, 0);
  EXPECT_EQ(documents.owner_of(1), 0);
  EXPECT_EQ(documents.owner_of(3), 1);
  // Up to most_free ranges where they take no more slots: not for these documents (four
  // ranges cut block 1's and block 3's keys), but for four documents of 16, one a block,
  // where four ranges take none, even when one range was wanted.
  EXPECT_EQ(split_keys(2, 4, 16, 64, 4, 16, document_tiles, 64).ranges.count(), 2);
  const auto one_block_documents = [](int64_t qi) {
    return std::vector<TileVisit>{{16 * qi, 16, TileKind::kPartial}};
  };
  for (const int64_t wanted : {1, 2}) {
    const auto finer = split_keys(wanted, 4, 16, 64, 4, 16, one_block_documents, 0);
    ASSERT_EQ(finer.ranges.count(), 4) << wanted;
    EXPECT_EQ(finer.slot_rows, 0) << wanted;
    for (int64_t qi = 0; qi < 4; ++qi)
      EXPECT_EQ(finer.owner_of(qi), qi) << wanted;
  }
  EXPECT_EQ(split_keys(2, 2, 16, 64, 4, 16, one_block_documents, 0).ranges.count(), 2);

  const ThreadCountsRestorer restore;
  torch::manual_seed(31);
  const int64_t n = 160;
  const auto q = torch::randn({1, 4, n, 8}, torch::kFloat64);
  const auto k = torch::randn({1, 1, n, 8}, torch::kFloat64);
  const auto v = torch::randn({1, 1, n, 8}, torch::kFloat64);
  const auto probe = torch::randn_like(q);
  const auto table = (torch::randn({4, 2 * 12 + 1}, torch::kFloat64) * 0.5).requires_grad_(true);
  const std::vector<std::pair<std::string, F::AttentionOptions>> cases{
      // Tiles of 48 keys, cut where ranges start: dropout draws each tile whole.
      {"no mask, dropout", F::AttentionOptions().dropout_p(0.3).training(true)},
      {"window 40 (dQ slots)",
       F::AttentionOptions().mask(attnkit::Mask::causal().sliding_window(40))},
      {"documents", F::AttentionOptions().mask(attnkit::Mask::documents(
                        torch::arange(n).div(37, "floor"), /*causal=*/true))},
      {"blocks 1 and 2 see no key",
       F::AttentionOptions().mask(
           attnkit::Mask::from_tensor(torch::ones({n, n}, torch::kBool)
                                          .tril()
                                          .index_put_({torch::indexing::Slice(16, 48)}, false)))},
      {"causal, relative table",
       F::AttentionOptions()
           .mask(attnkit::Mask::causal())
           .score_mod(attnkit::score_mods::relative_position_bias(table))}};
  for (const auto& [name, options] : cases) {
    SCOPED_TRACE(name);
    const auto run = [&, &options = options](int threads) {
      attnkit::set_num_threads(threads);
      torch::manual_seed(5);
      std::vector<torch::Tensor> inputs{q.clone().requires_grad_(true),
                                        k.clone().requires_grad_(true),
                                        v.clone().requires_grad_(true), table};
      const auto out =
          F::attention(inputs[0], inputs[1], inputs[2],
                       F::AttentionOptions(options).query_block_size(16).key_block_size(48).kernel(
                           "fused_tiles"));
      auto grads = torch::autograd::grad({(out * probe).sum()}, inputs, {}, {}, false,
                                         /*allow_unused=*/true);
      grads.insert(grads.begin(), out);
      return grads;
    };
    const auto serial = run(1);
    const auto split = run(4);
    const std::vector<std::string> names{"output", "grad q", "grad k", "grad v", "grad table"};
    for (size_t i = 0; i < serial.size(); ++i) {
      if (!serial[i].defined()) {
        EXPECT_FALSE(split[i].defined()) << names[i];
        continue;
      }
      EXPECT_TRUE(tensors_close(names[i], split[i], serial[i], 1e-12, 0.0));
    }
  }
}

// Documents of one key block each: 2 workers over 4 key/value heads want 4 ranges a head, and
// take 8 (every further start falls between documents, so no dQ slot): the same gradients as
// one worker's, and the math core's.
TEST(FusedTiles, DocumentsSplitIntoMoreRangesGiveOneWorkersGradients) {
  const ThreadCountsRestorer restore;
  torch::manual_seed(13);
  const int64_t h = 4, n = 192, hd = 8;
  const auto q = torch::randn({1, h, n, hd}, torch::kFloat64),
             k = torch::randn({1, h, n, hd}, torch::kFloat64),
             v = torch::randn({1, h, n, hd}, torch::kFloat64), probe = torch::randn_like(q);
  const auto options =
      F::AttentionOptions()
          .mask(attnkit::Mask::documents(torch::arange(n).div(16, "floor"), /*causal=*/true))
          .query_block_size(16)
          .key_block_size(16);
  const auto run = [&](const std::string& kernel, int threads) {
    attnkit::set_num_threads(threads);
    std::vector<torch::Tensor> inputs{q.clone().requires_grad_(true),
                                      k.clone().requires_grad_(true),
                                      v.clone().requires_grad_(true)};
    const auto out =
        F::attention(inputs[0], inputs[1], inputs[2], F::AttentionOptions(options).kernel(kernel));
    auto grads = torch::autograd::grad({(out * probe).sum()}, inputs);
    grads.insert(grads.begin(), out);
    return grads;
  };
  const auto expected = run("math", 1);
  const auto serial = run("fused_tiles", 1);
  const auto split = run("fused_tiles", 2);
  const std::vector<std::string> names{"output", "grad q", "grad k", "grad v"};
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_TRUE(tensors_close(names[i] + " (1 worker)", serial[i], expected[i], 1e-10, 1e-10));
    EXPECT_TRUE(tensors_close(names[i] + " (2 workers)", split[i], serial[i], 1e-12, 0.0));
  }
}

// A bias over (heads, n, n) read by a batch of several: each backward task runs every batch
// slice of its key/value head and key range, so one task writes each entry of the bias's
// gradient, in place, adding the slices in order. The same gradients from 1 and 4 workers
// (the split into key ranges differs), and the math core's.
TEST(FusedTiles, ABiasSharedByTheBatchGetsItsGradientFromOneTaskPerEntry) {
  const ThreadCountsRestorer restore;
  torch::manual_seed(11);
  const int64_t b = 3, h = 2, n = 96, hd = 8;
  const auto q = torch::randn({b, h, n, hd}), k = torch::randn({b, h, n, hd}),
             v = torch::randn({b, h, n, hd}), probe = torch::randn({b, h, n, hd});
  const auto bias = torch::randn({h, n, n}) * 0.5;
  const auto graph = attnkit::ScoreGraph::parse("index $0 %2 %3 %4\nadd %0 %5");
  const auto run = [&](const std::string& kernel, int threads, torch::ScalarType dtype) {
    attnkit::set_num_threads(threads);
    std::vector<torch::Tensor> inputs;
    for (const auto* t : {&q, &k, &v, &bias})
      inputs.push_back(t->to(dtype).requires_grad_(true));
    const auto out = F::attention(inputs[0], inputs[1], inputs[2],
                                  F::AttentionOptions()
                                      .mask(attnkit::Mask::causal())
                                      .score_mod(graph.bind({inputs[3]}))
                                      .query_block_size(16)
                                      .key_block_size(32)
                                      .kernel(kernel));
    auto grads = torch::autograd::grad({(out * probe.to(dtype)).sum()}, inputs);
    grads.insert(grads.begin(), out);
    return grads;
  };
  const auto expected = run("math", 1, torch::kFloat64);
  const auto serial = run("fused_tiles", 1, torch::kFloat32);
  const auto split = run("fused_tiles", 4, torch::kFloat32);
  const std::vector<std::string> names{"output", "grad q", "grad k", "grad v", "grad bias"};
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_TRUE(tensors_close(names[i] + " (1 worker)", serial[i], expected[i], 1e-4, 1e-4));
    // Each entry's terms in the same order whatever the split: equal to float32's rounding.
    EXPECT_TRUE(tensors_close(names[i] + " (4 workers)", split[i], serial[i], 1e-6, 1e-6));
  }
}

// The planner takes the fused tile kernel for CPU float32, float64 (and 16-bit) calls with a
// mask or a named score function, and says why it leaves the others to the chunked kernel.
TEST(FusedTiles, ThePlannerTakesItWhereItCanAndSaysWhyNot) {
  // Past the loop nest's tile (kLoopNestMaxTile), and a mask no fused route takes: causal
  // documents longer than SDPA by segment takes (256 tokens on average).
  const auto q = torch::randn({1, 2, 600, 8}), k = torch::randn({1, 2, 600, 8});
  const auto options = F::AttentionOptions().mask(
      attnkit::Mask::documents(torch::arange(600).div(300, "floor"), /*causal=*/true));
  const auto ran = [&](const torch::Tensor& query, const F::AttentionOptions& o) {
    F::KernelRecord record;
    F::attention(query, query.is_floating_point() ? k.to(query.scalar_type()) : k,
                 k.to(query.scalar_type()), o);
    return record.runs().at(0).kernel;
  };
  EXPECT_EQ(ran(q, options), "fused_tiles");
  EXPECT_EQ(ran(q.to(torch::kBFloat16), options), "fused_tiles");  // computed in float32
  EXPECT_EQ(ran(q, F::AttentionOptions(options).score_mod(attnkit::score_mods::softcap(5))),
            "fused_tiles");
  EXPECT_EQ(ran(q.to(torch::kFloat64), options), "fused_tiles");
  EXPECT_EQ(ran(q, F::AttentionOptions(options).dropout_p(0.1).training(true)), "fused_tiles");
  // Causal documents of 200 tokens without a gradient: SDPA by segment on LibTorch 2.x.
  const auto shorter = F::AttentionOptions().mask(
      attnkit::Mask::documents(torch::arange(600).div(200, "floor"), /*causal=*/true));
  EXPECT_EQ(ran(q, shorter), attnkit::detail::libtorch_has_sdpa() ? "sdpa_varlen" : "fused_tiles");
  if (attnkit::detail::libtorch_has_sdpa()) {
    expect_error_containing(
        [&] { F::attention(q, k, k, F::AttentionOptions(options).kernel("sdpa_varlen")); },
        "the variable-length route runs causal segments only where kFused is demanded, or for "
        "documents of at most 256 tokens on average");
  }
  // A C++ function as the score function stays on the chunked kernel, with a reason.
  const attnkit::ScoreMod general = [](auto s, auto, auto, auto, auto) { return s * 0.5; };
  EXPECT_EQ(ran(q, F::AttentionOptions(options).score_mod(general)), "chunked");
  expect_error_containing(
      [&] {
        F::attention(q, k, k,
                     F::AttentionOptions(options).score_mod(general).kernel("fused_tiles"));
      },
      "the fused tile kernel evaluates named score functions and ScoreGraphs only, not a C++ "
      "function");
  expect_error_containing(
      [&] {
        F::attention(q, k, k,
                     F::AttentionOptions(options)
                         .score_mod(attnkit::score_mods::alibi(torch::ones({3})))
                         .kernel("fused_tiles"));
      },
      "ALiBi's slopes must be one per head (2), not [3]");
}
