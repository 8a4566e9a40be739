// The planner (src/core/plan/planner.cpp) and its routes: every kernel it picks answers as the
// math core, a kernel that claims too much is caught, demands and preferences, the kernel
// record; 16-bit inputs, LibTorch's flash route, autocast and the variable-length segments.

#include "core/plan/planner.h"
#include "attnkit/autocast.h"
#include "attnkit/functional.h"
#include "attnkit/grouped_query_attention.h"
#include "attnkit/latent_attention.h"
#include "attnkit/multi_head_attention.h"
#include "attnkit/score_graph.h"
#include "core/base/matrix_units.h"
#include "core/kernels/loop_nest_attention.h"
#include "core/kernels/math_kernel.h"
#include "core/kernels/sdpa_kernel.h"
#include "core/kernels/varlen_kernel.h"
#include "test_support.h"

#include <cstdlib>

#include <limits>
#include <set>

#include <torch/version.h>

namespace F = attnkit::functional;
using attnkit::AttentionBackend;
using attnkit::MultiHeadAttentionOptions;
using namespace attnkit::testing;

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
    // A score function that is no named variant (score_variants.h): the chunked kernel's.
    const attnkit::ScoreMod distance = [](const torch::Tensor& score, const torch::Tensor&,
                                          const torch::Tensor&, const torch::Tensor& q_idx,
                                          const torch::Tensor& kv_idx) {
      return score - (q_idx - kv_idx).abs() * 0.25;
    };
    const auto call = sequence(F::AttentionOptions().score_mod(distance));
    const auto group = call.query.size(1) / call.key.size(1);
    const auto positions = torch::arange(12);
    const auto scores =
        torch::matmul(call.query, call.key.repeat_interleave(group, 1).transpose(-2, -1)) /
            std::sqrt(static_cast<double>(hd)) -
        (positions.view({-1, 1}) - positions.view({1, -1})).abs() * 0.25;
    cases.push_back(PlannerCase{
        "score_mod distance", call,
        torch::matmul(torch::softmax(scores, -1), call.value.repeat_interleave(group, 1)),
        torch::Tensor(), torch::ones({1, 1, 12, 1}, torch::kBool)});
  }
  {
    auto call = sequence(F::AttentionOptions().mask(Mask::causal()));
    call.with_weights = true;
    add("with weights", call, causal_allowed(12, 12, 0, 0, 12));
  }
  // Attention sinks, causal: a whole sequence and a cached decode step. A kernel that ignores
  // them gives every row weights that sum to 1.
  const auto sinks = torch::tensor({0.5, -1.0, 2.0, 0.0});
  for (const bool cached : {false, true}) {
    const int64_t n = cached ? 1 : 12, offset = cached ? 8 : 0;
    auto call =
        sequence(F::AttentionOptions().mask(Mask::causal(offset)).sinks(sinks), n, cached ? 9 : 12);
    if (cached)
      call.step = StepKind::kCached;
    const auto group = call.query.size(1) / call.key.size(1);
    auto scores =
        torch::matmul(call.query, call.key.repeat_interleave(group, 1).transpose(-2, -1)) /
        std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(
        causal_allowed(n, call.key.size(2), offset, 0, call.key.size(2)).logical_not(),
        -std::numeric_limits<double>::infinity());
    // (b, h, n, m) and each head's sink as one more column, which has no value.
    const auto column = sinks.view({1, h, 1, 1}).expand({b, h, n, 1});
    const auto weights =
        torch::softmax(torch::cat({scores, column}, -1), -1).narrow(-1, 0, scores.size(-1));
    cases.push_back(PlannerCase{cached ? "cached decode, sinks" : "sinks", call,
                                torch::matmul(weights, call.value.repeat_interleave(group, 1)),
                                torch::Tensor(), torch::ones({1, 1, n, 1}, torch::kBool)});
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

const std::vector<AttentionBackend> kBackendsWithAuto{
    AttentionBackend::kAuto, AttentionBackend::kMath, AttentionBackend::kFused,
    AttentionBackend::kChunked};

}  // namespace

// Every kernel the planner picks, for every kind of call and backend, as a module's
// preference and as a demand, answers as the math core does; and every kernel that can be
// picked on this LibTorch is picked by some case.
TEST(Planner, EveryPlannedKernelAnswersAsTheMathCore) {
  std::set<std::string> picked;
  for (const auto& c : planner_cases()) {
    for (const auto backend : kBackendsWithAuto) {
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
  std::set<std::string> expected{
      "decode", "ragged_loop_nest", "sdpa", "fused_tiles", "chunked", "sinks", "math"};
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

// A NaN reaches every output that attends to it, on every kernel the planner picks, as in
// the math core and in PyTorch's flex_attention (docs/masks.md, "NaN and infinity"): a NaN in
// a query, in a key or in a modified score; a masked key's NaN is skipped. Some kernels
// dropped it: their exponential turned NaN into 0.
TEST(Planner, EveryPlannedKernelSpreadsANaNAsTheMathCore) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  int64_t partly_nan = 0;  // calls where the math core's NaN reaches some rows and not others
  for (const auto& c : planner_cases()) {
    if (c.call.packed_qkv.defined())
      continue;  // the query and key are views of the packed projection the kernel reads
    torch::Tensor key_nan_rows;  // the rows that see the NaN key (from the NaN key's call)
    for (const char* where : {"query", "key", "score", "value"}) {
      auto call = c.call;
      if (std::string(where) == "query") {
        call.query = call.query.clone();
        call.query.select(2, call.query.size(2) - 1).select(2, 0).fill_(nan);  // the last row
      } else if (std::string(where) == "key") {
        if (call.key.is_same(call.value))
          continue;  // a NaN value reaches the rows whose weights multiply it, even by 0
        call.key = call.key.clone();
        call.key.select(2, std::min<int64_t>(2, call.key.size(2) - 1)).fill_(nan);
      } else if (std::string(where) == "value") {
        // A NaN value reaches every row that sees its key, and may reach rows whose tiles
        // multiply it by a weight of 0 (the math core's every row): checked below against the
        // NaN key's rows and the clean answer.
        if (!key_nan_rows.defined())
          continue;
        call.value = call.value.clone();
        call.value.select(2, std::min<int64_t>(2, call.value.size(2) - 1)).fill_(nan);
      } else {
        // ALiBi with one head's slope NaN: that head's scores are NaN on every route.
        if (call.options.score_mod() || call.options.sinks().defined())
          continue;
        auto slopes = torch::linspace(0.25, 1.0, call.query.size(1));
        slopes[1] = nan;
        call.options.score_mod(attnkit::score_mods::alibi(slopes));
      }
      if (std::string(where) == "value") {
        for (const auto backend : kBackendsWithAuto) {
          SCOPED_TRACE(c.name + ", NaN in the value, backend " + attnkit::backend_name(backend));
          call.options.backend(backend);
          call.backend_is_preference = true;
          const torch::NoGradGuard no_grad;
          const auto out = attnkit::detail::run_attention(call).context;
          const auto rows = c.counted_rows.expand_as(out);
          const auto nan_rows = out.isnan().any(-1, /*keepdim=*/true).expand_as(out);
          EXPECT_TRUE(nan_rows.masked_select(key_nan_rows.logical_and(rows)).all().item<bool>());
          const auto finite = nan_rows.logical_not().logical_and(rows);
          EXPECT_TRUE(torch::allclose(out.masked_select(finite), c.expected.masked_select(finite),
                                      1e-4, 1e-5));
        }
        continue;
      }
      auto math = call;
      math.options.backend(AttentionBackend::kMath).kernel("math");
      const torch::NoGradGuard no_grad;
      const auto expected = attnkit::detail::run_attention(math).context;
      const auto rows = c.counted_rows.expand_as(expected);
      if (std::string(where) == "key")
        key_nan_rows = expected.isnan().any(-1, /*keepdim=*/true).expand_as(expected);
      const auto expected_nan = expected.isnan().masked_select(rows);
      partly_nan += expected_nan.any().item<bool>() && !expected_nan.all().item<bool>();
      for (const auto backend : kBackendsWithAuto) {
        SCOPED_TRACE(c.name + ", NaN in the " + where + ", backend " +
                     attnkit::backend_name(backend));
        call.options.backend(backend);
        call.backend_is_preference = true;
        const auto out = attnkit::detail::run_attention(call).context;
        SCOPED_TRACE(c10::str("kernel ", attnkit::detail::plan_attention(call).name));
        const auto got_nan = out.isnan().masked_select(rows);
        EXPECT_TRUE(torch::equal(got_nan, expected_nan))
            << got_nan.sum().item<int64_t>() << " NaN against the math core's "
            << expected_nan.sum().item<int64_t>();
        const auto finite = expected.isnan().logical_not().logical_and(rows);
        EXPECT_TRUE(
            torch::allclose(out.masked_select(finite), expected.masked_select(finite), 1e-4, 1e-5));
      }
    }
  }
  EXPECT_GE(partly_nan, 10);  // masks that hide the NaN key from some rows
}

// A split call (the PyTorch operators' form) runs forward and backward apart, on every
// sequence case: forward answers as the math core, backward's gradients are the math core's
// autograd ones. LibTorch's CPU flash kernel (2.5 on) takes no mask and causal from query 0,
// with its log-sum-exp the chunked kernel's; the chunked kernel takes the rest.
TEST(Planner, ASplitCallRunsForwardAndBackwardApartAsTheMathCore) {
  const bool cpu_flash =
      TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5);
  const std::set<std::string> flash_cases{"no mask", "causal", "long causal", "scale 0.3",
                                          "packed projection"};
  std::set<std::string> seen;
  for (const auto& c : planner_cases()) {
    // Sinks are not a split call's: the sinks kernel builds on one.
    if (c.call.step != StepKind::kSequence || c.call.with_weights ||
        c.call.options.sinks().defined())
      continue;
    for (const bool bfloat16 : {false, true}) {
      SCOPED_TRACE(c.name + (bfloat16 ? ", bfloat16" : ""));
      seen.insert(c.name);
      auto call = c.call;
      call.split = true;
      call.backend_is_preference = true;
      call.packed_qkv = torch::Tensor();
      const auto dtype = bfloat16 ? torch::kBFloat16 : torch::kFloat;
      call.query = call.query.to(dtype), call.key = call.key.to(dtype),
      call.value = call.value.to(dtype);
      // bfloat16: its inputs rounded (8 bits), computed in float32.
      const double tolerance = bfloat16 ? 3e-2 : 1e-5, rtol = bfloat16 ? 3e-2 : 0.0;
      F::KernelRecord record;
      const auto forward = attnkit::detail::run_split_forward(call);
      // bfloat16 on a CPU with matrix units for it: the fused tile kernel in its own dtype,
      // where LibTorch's flash kernel would compute a call of enough keys in float32.
      const bool units = bfloat16 && attnkit::detail::cpu_16bit_matmul_lacks(dtype).empty() &&
                         call.key.size(-2) >= attnkit::detail::kMatrixUnitsFromKeys;
      const std::string expected_kernel = cpu_flash && flash_cases.count(c.name) && !units ? "sdpa"
                                          : c.name == "score_mod distance" ? "chunked"
                                                                           : "fused_tiles";
      EXPECT_EQ(std::string(forward.kernel), expected_kernel);
      ASSERT_EQ(record.runs().size(), 1u);
      EXPECT_EQ(record.runs()[0].kernel, expected_kernel);
      EXPECT_EQ(forward.out.scalar_type(), dtype);
      EXPECT_EQ(forward.lse.scalar_type(), torch::kFloat);
      EXPECT_EQ(forward.lse.sizes(), c.expected.sizes().slice(0, 3));
      EXPECT_TRUE(tensors_close("out", forward.out.to(torch::kFloat), c.expected, tolerance, rtol));
      // FlexAttention's max_scores: the fused tile kernel keeps each row's maximum, whatever
      // kernel took the call without it; max <= lse <= max + log(keys) where a row sees keys.
      auto with_max = call;
      with_max.wants_row_max = true;
      if (expected_kernel == "chunked") {
        expect_error_containing([&] { attnkit::detail::run_split_forward(with_max); },
                                "largest score (max_scores) was asked for, which only the fused "
                                "tile kernel keeps (on the CPU): no kernel runs it as a split "
                                "call (fused_tiles: ");
      } else {
        const auto kept = attnkit::detail::run_split_forward(with_max);
        EXPECT_EQ(std::string(kept.kernel), "fused_tiles");
        ASSERT_EQ(kept.row_max.sizes(), kept.lse.sizes());
        const auto sees_keys = kept.lse.isfinite();
        const auto max = kept.row_max.masked_select(sees_keys),
                   lse = kept.lse.masked_select(sees_keys);
        EXPECT_TRUE(max.le(lse + 1e-5).all().item<bool>());
        EXPECT_TRUE(lse.le(max + std::log(static_cast<double>(call.key.size(-2))) + 1e-5)
                        .all()
                        .item<bool>());
        EXPECT_TRUE(
            kept.row_max.masked_select(sees_keys.logical_not()).eq(-INFINITY).all().item<bool>());
      }
      if (expected_kernel == "sdpa") {
        auto chunked = call;
        chunked.options.kernel("chunked");
        EXPECT_TRUE(tensors_close("lse against the chunked kernel's", forward.lse,
                                  attnkit::detail::run_split_forward(chunked).lse, 1e-4));
      }
      // The math core's gradients, through autograd, on the float32 inputs.
      std::vector<torch::Tensor> inputs;
      for (const auto* t : {&c.call.query, &c.call.key, &c.call.value})
        inputs.push_back(t->detach().requires_grad_(true));
      auto reference = c.call;
      reference.query = inputs[0], reference.key = inputs[1], reference.value = inputs[2];
      reference.packed_qkv = torch::Tensor();
      reference.options.kernel("math");
      const auto grad_out = torch::randn_like(c.expected);
      const auto expected_grads = torch::autograd::grad(
          {attnkit::detail::run_attention(reference).context}, inputs, {grad_out});
      const auto grads = attnkit::detail::run_split_backward(
          call, {forward.out, forward.lse, grad_out.to(dtype), {}});
      ASSERT_EQ(grads.size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(grads[i].scalar_type(), dtype);
        EXPECT_TRUE(tensors_close(c10::str("gradient ", i), grads[i].to(torch::kFloat),
                                  expected_grads[i], bfloat16 ? 6e-2 : 1e-4, rtol));
      }
    }
  }
  EXPECT_EQ(seen.size(), 11u);  // every sequence case without weights
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
      for (const auto backend : kBackendsWithAuto) {
        for (const bool demanded : {false, true})
          failures += planner_error(c, backend, demanded, mutant).empty() ? 0 : 1;
      }
    }
    EXPECT_GT(failures, 0) << table[i].name << " claimed every case and answered them all";
  }
}

// The math core's additive bias (MathMasking::bias, what sdpa_masked falls back to without
// SDPA): softmax(scale q k^T + bias, masked) v, the bias converted to the scores' dtype, a
// row that sees no key zero.
TEST(MathCore, AnAdditiveBiasIsAddedBeforeTheMaskAndTheSoftmax) {
  torch::manual_seed(3);
  const int64_t b = 2, h = 3, n = 5, m = 7, hd = 4;
  const auto q = torch::randn({b, h, n, hd}, torch::kFloat64);
  const auto k = torch::randn({b, h, m, hd}, torch::kFloat64);
  const auto v = torch::randn({b, h, m, hd}, torch::kFloat64);
  const auto bias = torch::randn({1, h, n, m}, torch::kFloat32);  // float32 into float64 scores
  auto allowed = torch::rand({b, 1, n, m}) < 0.7;
  allowed.index_put_({0, 0, 2}, false);  // batch 0's query 2 sees nothing
  attnkit::detail::MathMasking masking;
  masking.allowed = allowed;
  masking.bias = bias;
  const auto out = attnkit::detail::math_attention(q, k, v, masking, 0.5, 0.0, false).context;
  const auto scores = (torch::matmul(q, k.transpose(-2, -1)) * 0.5 + bias.to(torch::kFloat64))
                          .masked_fill(allowed.logical_not(), -INFINITY);
  const auto weights = torch::softmax(scores, -1).nan_to_num(0.0);
  EXPECT_TRUE(tensors_close("context", out, torch::matmul(weights, v), 1e-12));
  EXPECT_TRUE(out[0][0][2].abs().max().item<double>() == 0.0);
  // bfloat16 scores take the float32 bias in their own dtype.
  const auto out16 =
      attnkit::detail::math_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16),
                                      v.to(torch::kBFloat16), masking, 0.5, 0.0, false)
          .context;
  EXPECT_EQ(out16.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(tensors_close("bfloat16 context", out16.to(torch::kFloat64), out, 5e-2));
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
    for (const auto backend : kBackendsWithAuto) {
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
// LibTorch 2.x a demanded fused backend runs a document mask by segment on SDPA; on the CPU a
// preference (and kAuto) does so for short causal documents with no gradient to keep, and
// keeps the faster fused tile kernel where one is kept.
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
  const char* by_segment = attnkit::detail::libtorch_has_sdpa() ? "sdpa_varlen" : "fused_tiles";
  EXPECT_STREQ(attnkit::detail::plan_attention(c.call).name, by_segment);
  auto automatic = c.call;
  automatic.options.backend(AttentionBackend::kAuto);
  EXPECT_STREQ(attnkit::detail::plan_attention(automatic).name, by_segment);
  automatic.query = automatic.query.clone().requires_grad_();
  EXPECT_STREQ(attnkit::detail::plan_attention(automatic).name, "fused_tiles");
  c.call.with_weights = true;
  EXPECT_STREQ(attnkit::detail::plan_attention(c.call).name, "math");
}

// The public record names the kernel each call ran, with the dtype it computed in: demanded
// backends, the weights, a 16-bit call, a module and a decode step. Records
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
    EXPECT_EQ(inner.runs()[1].kernel, "fused_tiles");
    // bfloat16 in its own dtype on a CPU with matrix units for it, else float32 inside.
    EXPECT_EQ(inner.runs()[1].computed_in,
              attnkit::detail::cpu_16bit_matmul_lacks(torch::kBFloat16).empty() ? torch::kBFloat16
                                                                                : torch::kFloat);
    EXPECT_EQ(inner.runs()[2].computed_in, torch::kDouble);
    EXPECT_EQ(inner.runs()[2].device, torch::Device(torch::kCPU));
  }
  const auto padding = F::AttentionOptions().mask(Mask::key_padding(torch::tensor({5})));
  if (attnkit::detail::libtorch_has_sdpa()) {
    F::attention(q, k, v, F::AttentionOptions(padding).backend(AttentionBackend::kFused));
    EXPECT_EQ(outer.runs().back().kernel, "sdpa_varlen");
  }
  // kAuto on the CPU: where a gradient is kept, the fused tile kernel runs masks faster; with
  // none, LibTorch 2.x's SDPA by segments runs non-causal padding.
  const auto q_trained = q.clone().requires_grad_();
  F::attention(q_trained, k, v, padding);
  EXPECT_EQ(outer.runs().back().kernel, "fused_tiles");
  F::attention(q, k, v, padding);
  EXPECT_EQ(outer.runs().back().kernel,
            attnkit::detail::libtorch_has_sdpa() ? "sdpa_varlen" : "fused_tiles");
  attnkit::MultiHeadAttention mha(
      MultiHeadAttentionOptions(4, 8, 16, 0.0, 2).backend(AttentionBackend::kChunked));
  mha->eval();
  const torch::NoGradGuard no_grad;
  const auto x = torch::randn({1, 3, 4});
  mha(x);
  EXPECT_EQ(outer.runs().back().kernel, "fused_tiles");
  auto cache = mha->make_kv_cache(1, 4);
  mha->forward_with_cache(x, cache);
  mha->forward_with_cache(torch::randn({1, 1, 4}), cache);
  EXPECT_EQ(outer.runs().back().kernel, "decode");
  EXPECT_EQ(outer.runs().front().kernel, "fused_tiles");
  EXPECT_EQ(outer.runs().size(), attnkit::detail::libtorch_has_sdpa() ? 7u : 6u);
}

TEST(Planner, ANamedKernelRunsTheCallOrSaysWhyItCannot) {
  // 12 queries x 400 keys: past the loop nest's tile (kLoopNestMaxTile), where the planner
  // leaves a call to faster kernels, yet the loop nest computes it when named.
  torch::manual_seed(10);
  const auto q = torch::randn({2, 3, 12, 8}), k = torch::randn({2, 3, 400, 8}),
             v = torch::randn({2, 3, 400, 8});
  ASSERT_GT(12 * 400, attnkit::detail::kLoopNestMaxTile);
  const auto causal = F::AttentionOptions().mask(Mask::causal(388));
  const auto expected =
      F::attention(q, k, v, F::AttentionOptions(causal).backend(AttentionBackend::kMath));
  F::KernelRecord record;
  for (const std::string kernel : {"loop_nest", "chunked", "math"}) {
    SCOPED_TRACE(kernel);
    const auto got = F::attention(q, k, v, F::AttentionOptions(causal).kernel(kernel));
    EXPECT_EQ(record.runs().back().kernel, kernel);
    EXPECT_TRUE(tensors_close(kernel, got, expected, 1e-5));
  }
  // The backend is not read; a kernel is refused where it cannot compute the call.
  F::attention(q, k, v,
               F::AttentionOptions(causal).backend(AttentionBackend::kChunked).kernel("math"));
  EXPECT_EQ(record.runs().back().kernel, "math");
  const auto padding = F::AttentionOptions().mask(Mask::key_padding(torch::tensor({5, 9})));
  expect_error_containing(
      [&] { F::attention(q, k, v, F::AttentionOptions(padding).kernel("loop_nest")); },
      "[attention] kernel loop_nest cannot run this: the fused backend takes only causal and "
      "sliding-window masks");
  expect_error_containing(
      [&] { F::attention_with_weights(q, k, v, F::AttentionOptions().kernel("chunked")); },
      "[attention] kernel chunked cannot run this");
  expect_error_containing(
      [&] { F::attention(q, k, v, F::AttentionOptions().kernel("flashy")); },
      "[attention] kernel: no kernel is named 'flashy'; expected one of decode, ragged_loop_nest");
  if (!torch::cuda::is_available()) {
    expect_error_containing(
        [&] {
          F::attention(q.to(torch::kDouble), k.to(torch::kDouble), v.to(torch::kDouble),
                       F::AttentionOptions().kernel("flash"));
        },
        "[attention] kernel flash cannot run this");
  }
}

TEST(Planner, AnEmptyCallAnswersAlikeOnEveryBackend) {
  // No batch entry or no query: the math core answers with an empty context, whatever the
  // backend or mask, and gradients flow; no key at all is refused alike.
  for (const auto backend : {AttentionBackend::kMath, AttentionBackend::kFused,
                             AttentionBackend::kChunked, AttentionBackend::kAuto}) {
    for (const bool causal : {false, true}) {
      const auto options =
          F::AttentionOptions().mask(causal ? Mask::causal() : Mask()).backend(backend);
      for (const auto& [batch, queries] : {std::pair<int64_t, int64_t>{0, 5}, {2, 0}}) {
        SCOPED_TRACE(c10::str("b ", batch, " n ", queries, " ", attnkit::backend_name(backend),
                              causal ? " causal" : ""));
        const auto q = torch::randn({batch, 2, queries, 4}, torch::requires_grad());
        const auto k = torch::randn({batch, 2, 5, 4}, torch::requires_grad());
        const auto v = torch::randn({batch, 2, 5, 4}, torch::requires_grad());
        F::KernelRecord record;
        const auto out = F::attention(q, k, v, options);
        EXPECT_EQ(out.sizes(), q.sizes());
        ASSERT_EQ(record.runs().size(), 1u);
        EXPECT_EQ(record.runs()[0].kernel, "math");
        out.sum().backward();
        EXPECT_EQ(q.grad().sizes(), q.sizes());
      }
      const auto q = torch::randn({2, 2, 5, 4}), none = torch::randn({2, 2, 0, 4});
      expect_error_containing([&] { F::attention(q, none, none, options); },
                              "[attention] key must hold at least one token, got [2, 2, 0, 4]");
    }
  }
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
  EXPECT_STREQ(attnkit::detail::plan_attention(call).name, "fused_tiles");
}

namespace {

// The largest error of `got` against `reference`, relative to the reference's largest value.
double relative_error(const torch::Tensor& got, const torch::Tensor& reference) {
  const auto exact = reference.to(torch::kDouble);
  return ((got.to(torch::kDouble) - exact).abs().max() / exact.abs().max()).item<double>();
}

}  // namespace

// While alive, 16-bit CPU calls are computed in float32 whatever the CPU has
// (ATTNKIT_CPU_16BIT_MATMUL=float32, which the planner reads per call).
class Float32ForSixteenBit {
 public:
  Float32ForSixteenBit() { setenv("ATTNKIT_CPU_16BIT_MATMUL", "float32", 1); }
  ~Float32ForSixteenBit() { unsetenv("ATTNKIT_CPU_16BIT_MATMUL"); }
  Float32ForSixteenBit(const Float32ForSixteenBit&) = delete;
  Float32ForSixteenBit& operator=(const Float32ForSixteenBit&) = delete;
};

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
// On a CPU with matrix units for the dtype (matrix_units.h) the fused tile kernel runs it in
// its own dtype (P and dS rounded to it for their products, as FlexAttention's math does):
// bound 2.5x. The CPU cases run twice, on that path and forced to float32.
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
  for (const bool forced_float32 : {false, true}) {
    if (forced_float32 && on_cuda)
      break;
    std::optional<Float32ForSixteenBit> forced;
    if (forced_float32)
      forced.emplace();
    for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
      // Grouped-query attention too: 2 key/value heads for the 4 query heads.
      const bool grouped = dtype == torch::kHalf;
      // Scores of a few units, as trained models have: the softmax is far from uniform.
      const auto q = (2 * torch::randn({b, h, n, hd})).to(on.dtype(dtype));
      const int64_t kv_heads = grouped ? 2 : h;
      const auto k = (2 * torch::randn({b, kv_heads, n, hd})).to(on.dtype(dtype));
      const auto v = torch::randn({b, kv_heads, n, hd}).to(on.dtype(dtype));
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
        for (const auto backend : kBackendsWithAuto) {
          if (!F::unsupported_reason(backend, q, k, v, c.options).empty())
            continue;  // the fused backend's masks and score functions, on LibTorch 1.x
          SCOPED_TRACE(c10::str(c.name, ", ", dtype, ", backend ", attnkit::backend_name(backend)));
          F::KernelRecord record;
          const auto got = run(q, k, v, backend);
          ASSERT_EQ(record.runs().size(), 1u);
          const std::string kernel = record.runs()[0].kernel;
          const bool fused_16bit = kernel == "sdpa" || kernel == "flash" ||
                                   kernel == "sdpa_masked" || kernel == "sdpa_varlen";
          if (on_cuda && backend == AttentionBackend::kAuto && dtype == torch::kBFloat16 &&
              attnkit::detail::flash_kernel_available(device())) {
            EXPECT_EQ(kernel, c.cuda_route);
          }
          const bool units = !on_cuda && kernel == "fused_tiles" &&
                             attnkit::detail::cpu_16bit_matmul_lacks(dtype).empty();
          EXPECT_EQ(record.runs()[0].computed_in,
                    (on_cuda && fused_16bit) || units ? dtype : torch::ScalarType(torch::kFloat));
          EXPECT_EQ(record.runs()[0].sixteen_bit.rfind("float32: ", 0) == 0,
                    record.runs()[0].computed_in == torch::kFloat)
              << record.runs()[0].sixteen_bit;
          const double bound = on_cuda && fused_16bit ? 5.0 : units ? 2.5 : 2.0;
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
}

ATTNKIT_INSTANTIATE_DEVICE_TESTS(SixteenBitDevices);

// The planner's record says how a 16-bit CPU call multiplied and why: on the matrix units
// where the CPU and LibTorch have them (the instructions named), else float32 and the reason;
// ATTNKIT_CPU_16BIT_MATMUL=float32 forces float32 and says so.
TEST(SixteenBitCpu, TheRecordNamesTheUnitsOrWhyFloat32) {
  const auto q = torch::randn({1, 2, 64, 16}).to(torch::kBFloat16);
  // A softcap: the fused tile kernel's (LibTorch's SDPA takes plain causal calls and windows).
  const auto options =
      F::AttentionOptions().mask(Mask::causal()).score_mod(attnkit::score_mods::softcap(20.0));
  const auto lacks = attnkit::detail::cpu_16bit_matmul_lacks(torch::kBFloat16);
  {
    F::KernelRecord record;
    F::attention(q, q, q, options);
    ASSERT_EQ(record.runs().size(), 1u);
    const auto& run = record.runs()[0];
    EXPECT_EQ(run.kernel, "fused_tiles");
    if (lacks.empty()) {
      EXPECT_EQ(run.computed_in, torch::kBFloat16);
      EXPECT_NE(run.sixteen_bit.find(attnkit::detail::cpu_16bit_matmul_units(torch::kBFloat16)),
                std::string::npos)
          << run.sixteen_bit;
    } else {
      EXPECT_EQ(run.computed_in, torch::kFloat);
      EXPECT_EQ(run.sixteen_bit, "float32: " + lacks);
    }
  }
  {
    Float32ForSixteenBit forced;
    F::KernelRecord record;
    F::attention(q, q, q, options);
    ASSERT_EQ(record.runs().size(), 1u);
    EXPECT_EQ(record.runs()[0].computed_in, torch::kFloat);
    EXPECT_EQ(record.runs()[0].sixteen_bit,
              "float32: ATTNKIT_CPU_16BIT_MATMUL=float32 asks for float32");
  }
  F::KernelRecord record;
  F::attention(q.to(torch::kFloat), q.to(torch::kFloat), q.to(torch::kFloat), options);
  EXPECT_EQ(record.runs().at(0).sixteen_bit, "");
}

// Dropout on the matrix units draws the masks the float32 path draws (the same seed gives the
// same tiles' factors), forward and backward: the two agree to the bfloat16 rounding of their
// results, where another mask would differ by whole weights. Grouped-query attention (2
// key/value heads for 4 query heads) and a window's partial tiles; at 2 threads the key-range
// split backward.
TEST(SixteenBitCpu, DropoutDrawsTheFloat32PathsMasks) {
  const auto dtype = torch::kBFloat16;
  const auto lacks = attnkit::detail::cpu_16bit_matmul_lacks(dtype);
  if (!lacks.empty())
    GTEST_SKIP() << "no 16-bit products on this machine: " << lacks;
  torch::manual_seed(3);
  const auto q = torch::randn({2, 4, 320, 32}).to(dtype);
  const auto k = torch::randn({2, 2, 320, 32}).to(dtype);
  const auto v = torch::randn({2, 2, 320, 32}).to(dtype);
  const auto probe = torch::randn({2, 4, 320, 32}).to(dtype);
  const auto options = F::AttentionOptions()
                           .mask(Mask::causal().sliding_window(70))
                           .dropout_p(0.3)
                           .training(true)
                           .query_block_size(64)
                           .key_block_size(64)
                           .kernel("fused_tiles");  // one kernel's draws, in either dtype
  const auto run = [&] {
    torch::manual_seed(17);  // the call's dropout seed
    F::KernelRecord record;
    auto result = output_and_grads(
        [&](auto& a, auto& b, auto& c) { return F::attention(a, b, c, options); }, q, k, v, probe);
    result.push_back(torch::tensor(record.runs().at(0).computed_in == dtype));
    return result;
  };
  const auto native = run();
  std::vector<torch::Tensor> in_float32;
  {
    Float32ForSixteenBit forced;
    in_float32 = run();
  }
  ASSERT_TRUE(native.back().item<bool>()) << "the matrix units did not run the call";
  ASSERT_FALSE(in_float32.back().item<bool>());
  const char* names[] = {"output", "dq", "dk", "dv"};
  for (size_t i = 0; i < 4; ++i) {
    const auto reference = in_float32[i].to(torch::kDouble);
    const double error =
        ((native[i].to(torch::kDouble) - reference).abs().max() / reference.abs().max())
            .item<double>();
    EXPECT_LE(error, 1.0 / 64) << names[i];  // bfloat16 keeps 8 bits: 1/256 per rounding
  }
}

// The split calls (attention_forward, attention_backward: ring attention's pieces) keep a
// 16-bit forward's output before its rounding where gradients are wanted, and backward reads it
// for D = rowsum(dO * O): a per-head bias's gradient (0 in exact arithmetic) stays within 10x
// of its size with float32 inputs. From the rounded output it is far off (the check that this
// test can tell them apart). merge_attention merges the unrounded outputs; without a gradient
// to keep, there is none.
TEST(SixteenBitCpu, TheSplitBackwardReadsTheOutputBeforeItsRounding) {
  torch::manual_seed(41);
  const int64_t b = 2, h = 4, n = 256, e = 16;
  const auto q = (2 * torch::randn({b, h, n, e})).to(torch::kBFloat16).requires_grad_();
  const auto k = (2 * torch::randn({b, h, n, e})).to(torch::kBFloat16).requires_grad_();
  const auto v = torch::randn({b, h, n, e}).to(torch::kBFloat16).requires_grad_();
  const auto probe = torch::randn({b, h, n, e}).to(torch::kBFloat16);
  const auto bias = torch::randn({h}).requires_grad_();
  const auto options =
      F::AttentionOptions()
          .mask(Mask::causal())
          .score_mod(attnkit::ScoreGraph::parse("index $0 %2\nadd %0 %5").bind({bias}));
  const auto bias_gradient = [&](const torch::Tensor& q_in, const torch::Tensor& k_in,
                                 const torch::Tensor& v_in, bool rounded_out) {
    auto forward = F::attention_forward(q_in, k_in, v_in, options);
    if (rounded_out)
      forward.out_for_backward = torch::Tensor();
    const auto grads =
        F::attention_backward(q_in, k_in, v_in, forward, probe.to(q_in.scalar_type()), options);
    return grads.score_tensors.at(0).abs().max().item<double>();
  };
  const auto forward = F::attention_forward(q, k, v, options);
  ASSERT_TRUE(forward.out_for_backward.defined());
  EXPECT_EQ(forward.out_for_backward.scalar_type(), torch::kFloat);
  EXPECT_TRUE(forward.out.equal(forward.out_for_backward.to(torch::kBFloat16)));
  const auto as_float = [](const torch::Tensor& t) {
    return t.detach().to(torch::kFloat).requires_grad_();
  };
  const double floor = bias_gradient(as_float(q), as_float(k), as_float(v), false);
  const double unrounded = bias_gradient(q, k, v, false);
  const double rounded = bias_gradient(q, k, v, true);
  EXPECT_LE(unrounded, 10 * floor) << "float32 inputs: " << floor;
  EXPECT_GT(rounded, 10 * floor) << "the rounded output: " << rounded;
  // Two key shards merged: the merged output before its rounding, as the whole call's.
  std::vector<F::AttentionWithLse> parts;
  for (const int64_t begin : {int64_t{0}, n / 2})
    parts.push_back(F::attention_forward(q, k.narrow(2, begin, n / 2), v.narrow(2, begin, n / 2)));
  const auto merged = F::merge_attention(parts);
  const auto whole = F::attention_forward(q, k, v);
  ASSERT_TRUE(merged.out_for_backward.defined());
  EXPECT_TRUE(tensors_close("merged", merged.out_for_backward, whole.out_for_backward, 1e-5));
  {
    const torch::NoGradGuard no_grad;
    EXPECT_FALSE(F::attention_forward(q, k, v, options).out_for_backward.defined());
  }
  EXPECT_FALSE(F::attention_forward(q.detach(), k.detach(), v.detach(),
                                    F::AttentionOptions().mask(Mask::causal()))
                   .out_for_backward.defined());
}

// A 16-bit module's decode step reads its cache in place on any CPU, with or without matrix
// units (no float32 copy of the cache per step), and its record says so; the float32 path
// (ATTNKIT_CPU_16BIT_MATMUL=float32) gives the same step to the 16-bit rounding of the result.
TEST(SixteenBitCpu, ADecodeStepReadsItsCacheInPlace) {
  torch::manual_seed(31);
  const torch::NoGradGuard no_grad;
  attnkit::GroupedQueryAttention gqa(
      attnkit::GroupedQueryAttentionOptions(32, 32, 0.0, 4, 2).sliding_window_size(4));
  gqa->eval();
  gqa->to(torch::kBFloat16);
  const auto x = torch::randn({2, 7, 32}).to(torch::kBFloat16);
  const auto step = [&] {
    auto cache = gqa->make_kv_cache(2, 8);
    gqa->forward_with_cache(x.narrow(1, 0, 6), cache);
    F::KernelRecord record;
    const auto y = gqa->forward_with_cache(x.narrow(1, 6, 1), cache);
    EXPECT_EQ(record.runs().size(), 1u);
    return std::make_pair(y, record.runs().at(0));
  };
  const auto [in_place, run] = step();
  EXPECT_EQ(run.kernel, "decode");
  EXPECT_EQ(run.computed_in, torch::kBFloat16);
  EXPECT_EQ(run.sixteen_bit, "BFloat16 read in place, float32 arithmetic");
  ASSERT_EQ(in_place.scalar_type(), torch::kBFloat16);
  Float32ForSixteenBit forced;
  const auto [copied, float32_run] = step();
  EXPECT_EQ(float32_run.kernel, "decode");
  EXPECT_EQ(float32_run.computed_in, torch::kFloat);
  EXPECT_EQ(float32_run.sixteen_bit, "float32: ATTNKIT_CPU_16BIT_MATMUL=float32 asks for float32");
  // Both round the attention once; the output projection then rounds again in bfloat16.
  EXPECT_TRUE(
      tensors_close("decode step", in_place.to(torch::kFloat), copied.to(torch::kFloat), 2e-2));
}

// On the matrix units, forward rounds the weights P to the input dtype once before they meet
// the values (as FlexAttention's math does) and sums them unrounded. With one key tile the
// kernel's output is then the float64 emulation of exactly that, rounded to bfloat16: equal
// bits but for the rare weight whose float32 value sits at a rounding boundary. The same
// emulation without the rounding of P, or with P rounded twice (through float16), matches far
// fewer outputs: the test tells them apart (checked below), so a kernel that skips the
// rounding or rounds twice fails.
TEST(SixteenBitCpu, WeightsAreRoundedOnceBeforeTheValues) {
  const auto dtype = torch::kBFloat16;
  const auto lacks = attnkit::detail::cpu_16bit_matmul_lacks(dtype);
  if (!lacks.empty())
    GTEST_SKIP() << "no 16-bit products on this machine: " << lacks;
  const int64_t h = 2, n = 128, m = 256, hd = 64;
  torch::manual_seed(5);
  // Scores c_i t_j, exact in float32: one feature each, bfloat16 values.
  auto q = torch::zeros({1, h, n, hd});
  auto k = torch::zeros({1, h, m, hd});
  q.select(3, 0).copy_(torch::randint(1, 9, {1, h, n}).to(torch::kFloat) / 4);
  k.select(3, 0).copy_(torch::rand({1, h, m}) * -4);
  q = q.to(dtype);
  k = k.to(dtype);
  const auto v = torch::randn({1, h, m, hd}).to(dtype);
  F::KernelRecord record;
  const auto out = F::attention(q, k, v, F::AttentionOptions().scale(1.0).key_block_size(1024));
  ASSERT_EQ(record.runs().at(0).kernel, "fused_tiles");
  ASSERT_EQ(record.runs().at(0).computed_in, dtype);
  // (1, h, n, m) float32 scores and weights against each row's maximum.
  const auto scores = torch::matmul(q.to(torch::kFloat), k.to(torch::kFloat).transpose(-1, -2));
  const auto weights = (scores - std::get<0>(scores.max(-1, true))).exp();
  const auto emulated = [&](const torch::Tensor& p, const torch::Tensor& summed) {
    return (torch::matmul(p.to(torch::kDouble), v.to(torch::kDouble)) /
            summed.to(torch::kDouble).sum(-1, true))
        .to(dtype);
  };
  const auto matching = [&](const torch::Tensor& reference) {
    return out.eq(reference).to(torch::kDouble).mean().item<double>();
  };
  const auto rounded = weights.to(dtype);
  const double rounded_once = matching(emulated(rounded, weights));
  const double unrounded = matching(emulated(weights, weights));
  const double rounded_twice = matching(emulated(weights.to(torch::kHalf).to(dtype), weights));
  EXPECT_GE(rounded_once, 0.99);  // 1.0 on AVX-512 BF16 (2026-12-06)
  EXPECT_LT(unrounded, 0.95) << "the test cannot tell an unrounded P apart";         // 0.57
  EXPECT_LT(rounded_twice, 0.95) << "the test cannot tell a P rounded twice apart";  // 0.61
}

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
    for (const auto backend : kBackendsWithAuto) {
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
