// Context-parallel attention on R processes over loopback (c10d, Gloo), against the
// single-process call: outputs and gradients for each mask, layout and dtype, the steps each
// mask exchanges, and the refusals. Run without RANK it starts its own R ranks.
// Usage: attnkit-context-parallel-check [--ranks R] [--fault die] [--timeout S] [--data PATH]
//        attnkit-context-parallel-check --bench N [--ranks R | --single] [--threads T]
//                                       [--rounds K] [--piece-kib P]
//   Each rank also trains attnkit-train's model 50 steps context-parallel (the copy and reverse
//   tasks, and with --data, the text file, the text task with packed documents) and compares
//   every step's loss with one process's run.
//   --fault die: rank 1 exits before the call; the others must stop within the timeout,
//   naming it (the run then fails, as it should).
//   --bench N: times causal forward+backward at b 1, h 8, hd 64, n N, float32 (K rounds, 3) on
//   R ranks, or as one attention call (--single), and reports each rank's time, the time it
//   waited for transfers, and its peak memory above its inputs.

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <attnkit/attnkit.h>

#include "train/distributed.h"
#include "train/launcher.h"
#include "train/trainer.h"

namespace {

using attnkit::Mask;
using attnkit::SequenceShards;
using attnkit::ShardLayout;
using attnkit::functional::AttentionOptions;

// Counts the transfers a call starts, to check which steps it takes.
class CountingExchange : public attnkit::ShardExchange {
 public:
  explicit CountingExchange(attnkit::ShardExchange& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int to,
                                           std::vector<torch::Tensor>& receive, int from) override {
    ++transfers;
    auto wait = inner_.start_send_receive(send, to, receive, from);
    return [this, wait] {
      const auto start = std::chrono::steady_clock::now();
      wait();
      waited_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
  }
  int transfers = 0;
  double waited_s = 0.0;

 private:
  attnkit::ShardExchange& inner_;
};

struct Case {
  std::string name;
  AttentionOptions options;
  // Key/value transfers of the forward with the contiguous layout; -1: not checked.
  int contiguous_steps = -1;
  // A tensor the score function reads that wants a gradient (undefined: none): each rank's
  // gradient is its queries' share, and the shares sum to the single call's.
  torch::Tensor score_tensor = torch::Tensor();
};

// ||got - want|| / ||want|| (Frobenius): the relative error of the tensor as a whole. The
// largest entry's error over the largest entry is reported beside it: in float32 it reaches
// 1.2e-6 here, where the single call's own float32 output is 1.3e-6 from its float64 value
// (each part's lse carries float32's rounding into its weight).
double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  const auto wanted = want.to(torch::kDouble);
  const double scale = wanted.norm().item<double>();
  return (got.to(torch::kDouble) - wanted).norm().item<double>() / (scale > 0 ? scale : 1.0);
}

double largest_error(const torch::Tensor& got, const torch::Tensor& want) {
  const double scale = want.abs().max().item<double>();
  return (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>() /
         (scale > 0 ? scale : 1.0);
}

// This process's resident memory in MiB: "VmRSS" now, or "VmHWM" its peak since the last
// reset_peak().
double memory_mib(const char* field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field, 0) == 0)
      return std::stod(line.substr(line.find(':') + 1)) / 1024.0;  // kB
  }
  return 0.0;
}

void reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
}

// Causal forward+backward at n tokens, `rounds` times: on this rank's shard (group given) or as one
// call. Prints the median time, the time spent waiting for transfers, and the peak memory
// above the inputs.
int bench(int64_t n, int rounds, int64_t piece_bytes, attnkit::train::Collectives* group) {
  const int ranks = group == nullptr ? 1 : group->world_size();
  const int rank = group == nullptr ? 0 : group->rank();
  const SequenceShards shards(n, ranks, ShardLayout::kZigzag);
  torch::manual_seed(rank);
  const auto make = [&] { return torch::randn({1, 8, n / ranks, 64}).requires_grad_(); };
  const auto q = make(), k = make(), v = make();
  const auto grad = torch::randn({1, 8, n / ranks, 64});
  const auto options = AttentionOptions().mask(Mask::causal());
  const double inputs_mib = 4.0 * static_cast<double>(q.numel() * q.element_size()) / (1 << 20);
  // Per round: seconds, seconds waiting, and MiB above the inputs: the forward's peak, what it
  // keeps for the backward (the output, and what autograd saves), and the backward's peak.
  std::vector<double> times, waits, forward_peaks, kept, backward_peaks;
  for (int round = 0; round < rounds; ++round) {
    for (auto* t : {&q, &k, &v})
      t->mutable_grad() = torch::Tensor();
    const double before = memory_mib("VmRSS");
    reset_peak();
    const auto start = std::chrono::steady_clock::now();
    std::optional<CountingExchange> counting;
    if (group != nullptr)
      counting.emplace(*group);
    auto out = group == nullptr ? attnkit::functional::attention(q, k, v, options)
                                : attnkit::functional::context_parallel_attention(
                                      q, k, v, *counting, options,
                                      attnkit::ContextParallelOptions().piece_bytes(piece_bytes));
    forward_peaks.push_back(memory_mib("VmHWM") - before);
    kept.push_back(memory_mib("VmRSS") - before);
    reset_peak();
    out.backward(grad);
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    backward_peaks.push_back(memory_mib("VmHWM") - before);
    waits.push_back(counting.has_value() ? counting->waited_s : 0.0);
  }
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  std::cout << c10::str(group == nullptr ? "one call" : c10::str("rank ", rank, " of ", ranks),
                        ", n ", n, ", ", torch::get_num_threads(), " thread(s) (",
                        attnkit::blas_threads(), "): forward+backward ", median(times),
                        " s (median of ", rounds, ": ", times, "), waiting ", median(waits),
                        " s, busy ", median(times) - median(waits),
                        " s; MiB above the inputs (q, k, v, grad: ", inputs_mib, "): forward peak ",
                        median(forward_peaks), ", kept ", median(kept), ", backward peak ",
                        median(backward_peaks), "\n")
            << std::flush;
  return 0;
}

// attnkit-train's runs, context-parallel over `group` (groups of `context_parallel` ranks)
// against one process: every step's loss within 1e-5 relative ("ok " and the largest
// difference), or what differs.
std::string train_difference(attnkit::train::TrainConfig config, int64_t context_parallel,
                             attnkit::train::Collectives& group) {
  namespace T = attnkit::train;
  config.quiet = true;
  config.steps = 50;
  config.device = "cpu";
  std::ostringstream quiet;
  const auto one = T::train(T::resolve(config), quiet, nullptr, nullptr).losses;
  config.context_parallel = context_parallel;
  const auto split = T::train(T::resolve(config), quiet, nullptr, &group).losses;
  if (split.size() != one.size())
    return c10::str(split.size(), " steps against ", one.size());
  double worst = 0.0;
  size_t worst_step = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    const double error = std::abs(split[i] - one[i]) / std::max(1.0, std::abs(one[i]));
    if (error > worst) {
      worst = error;
      worst_step = i + 1;
    }
  }
  std::ostringstream text;
  text << "largest difference " << worst << " at step " << worst_step << " (losses " << one.front()
       << " -> " << one.back() << ")";
  return (worst <= 1e-5 ? "ok " : "") + text.str();
}

int run_rank(int ranks, const std::string& fault, int timeout_s, int64_t bench_length, int rounds,
             int64_t piece_bytes, const std::string& data) {
  const auto environment = attnkit::train::read_rank_environment();
  auto group = attnkit::train::join_process_group(environment, "gloo", timeout_s);
  if (bench_length > 0)
    return bench(bench_length, rounds, piece_bytes, group.get());
  const int rank = group->rank();
  int failures = 0;
  const auto fail = [&](const std::string& what) {
    std::ostringstream line;
    line << "FAIL: rank " << rank << ": " << what << "\n";
    std::cout << line.str() << std::flush;
    ++failures;
  };
  const auto pass = [&](const std::string& what) {
    if (rank == 0)
      std::cout << "ok: " + what + "\n" << std::flush;
  };

  const int64_t batch = 2, heads = 4, kv_heads = 2, head_dim = 16, chunk = 32;
  const int64_t n = 2 * ranks * chunk;

  if (fault == "die") {
    torch::manual_seed(0);
    const auto q = torch::randn({1, 2, n / ranks, 8});
    if (rank == 1)
      std::_Exit(3);
    try {
      attnkit::functional::context_parallel_attention(q, q, q, *group);
      fail("a call without rank 1 returned");
    } catch (const attnkit::train::RankLost& e) {
      std::cout << "rank " << rank << ": " << e.what() << "\n" << std::flush;
    }
    return 4;  // the run fails: rank 1 died
  }

  // Document ids: documents of 1 to 70 tokens, drawn once, alike on every rank.
  torch::manual_seed(7);
  std::vector<int64_t> ids;
  for (int64_t doc = 0; static_cast<int64_t>(ids.size()) < n; ++doc) {
    const int64_t length = torch::randint(1, 71, {1}).item<int64_t>();
    for (int64_t t = 0; t < length && static_cast<int64_t>(ids.size()) < n; ++t)
      ids.push_back(doc);
  }
  const auto document_ids = torch::tensor(ids, torch::kInt64);
  // A random block mask: entries allowed with probability 0.3 and a quarter of the 16 x 16
  // blocks emptied, so that its lists hold empty, partial and full blocks.
  auto allowed = torch::rand({n, n}) < 0.3;
  const auto empty_blocks =
      (torch::rand({n / 16, n / 16}) < 0.25).repeat_interleave(16, 0).repeat_interleave(16, 1);
  allowed.masked_fill_(empty_blocks, false);
  allowed.slice(0, 0, 16).slice(1, 0, 16).fill_(true);
  const auto random_blocks = attnkit::create_block_mask(Mask::from_tensor(allowed), 1, 1, n, n,
                                                        attnkit::BlockMaskOptions().block_size(16));

  const std::vector<Case> cases{
      {"no mask", AttentionOptions(), ranks - 1},
      {"causal", AttentionOptions().mask(Mask::causal()), ranks - 1},
      {"documents", AttentionOptions().mask(Mask::documents(document_ids, true))},
      // A window shorter than a contiguous shard: only the neighbour's keys move.
      {"sliding window 20", AttentionOptions().mask(Mask::causal().sliding_window(20)), 1},
      {"softcap 20, causal",
       AttentionOptions().mask(Mask::causal()).score_mod(attnkit::score_mods::softcap(20.0)),
       ranks - 1},
      {"random block mask", AttentionOptions().block_mask(random_blocks)},
      // Score functions that read positions: q_idx and kv_idx in the whole sequence.
      {"ALiBi, causal",
       AttentionOptions()
           .mask(Mask::causal())
           .score_mod(attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(heads)))},
  };
  // Built per dtype: a learnable relative-position table (no mask) and a graph reading a
  // (h, n, n) bias under a sliding window.
  const auto with_score_tensors = [&](c10::ScalarType dtype) {
    auto all = cases;
    const auto table = torch::randn({heads, 2 * 24 + 1}, torch::dtype(dtype)).requires_grad_();
    all.push_back({"relative-position table (D 24)",
                   AttentionOptions().score_mod(attnkit::score_mods::relative_position_bias(table)),
                   -1, table});
    const auto bias = torch::randn({heads, n, n}, torch::dtype(dtype)).requires_grad_();
    all.push_back(
        {"a graph, bias[h, q_idx, kv_idx], sliding window 20",
         AttentionOptions()
             .mask(Mask::causal().sliding_window(20))
             .score_mod(attnkit::ScoreGraph::parse("index $0 %2 %3 %4\nadd %0 %5").bind({bias})),
         1, bias});
    return all;
  };
  for (const auto dtype : {torch::kDouble, torch::kFloat}) {
    const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-6;
    torch::manual_seed(11);
    const auto make = [&](int64_t h) {
      return torch::randn({batch, h, n, head_dim}, torch::dtype(dtype)).requires_grad_();
    };
    const auto q = make(heads), k = make(kv_heads), v = make(kv_heads);
    const auto grad = torch::randn({batch, heads, n, head_dim}, torch::dtype(dtype));
    for (const auto& c : with_score_tensors(dtype)) {
      // The single-process call.
      for (auto* t : {&q, &k, &v}) {
        if (t->grad().defined())
          t->mutable_grad().zero_();
      }
      const auto out = attnkit::functional::attention(q, k, v, c.options);
      out.backward(grad);
      const std::vector<torch::Tensor> want{out, q.grad(), k.grad(), v.grad()};
      const auto want_score_grad =
          c.score_tensor.defined() ? c.score_tensor.grad().clone() : torch::Tensor();
      for (const auto layout : {ShardLayout::kZigzag, ShardLayout::kContiguous}) {
        const SequenceShards shards(n, ranks, layout);
        const auto mine = [&](const torch::Tensor& whole) {
          return shards.shard(whole.detach(), rank, 2).requires_grad_();
        };
        const auto q_s = mine(q), k_s = mine(k), v_s = mine(v);
        if (c.score_tensor.defined())
          c.score_tensor.mutable_grad().zero_();
        CountingExchange counting(*group);
        // Zigzag runs take other ranks' chunks in pieces of 8 (float64) or 16 tokens.
        const auto parallel = attnkit::ContextParallelOptions().layout(layout).piece_bytes(
            layout == ShardLayout::kZigzag ? 4096 : 8 << 20);
        const auto out_s = attnkit::functional::context_parallel_attention(q_s, k_s, v_s, counting,
                                                                           c.options, parallel);
        const int forward_transfers = counting.transfers - (ranks - 1);  // less the shapes'
        out_s.backward(shards.shard(grad, rank, 2));
        const std::vector<torch::Tensor> got{out_s, q_s.grad(), k_s.grad(), v_s.grad()};
        const char* names[] = {"output", "query gradient", "key gradient", "value gradient"};
        const std::string label = c10::str(c.name, ", ", dtype, ", ",
                                           layout == ShardLayout::kZigzag ? "zigzag" : "contiguous",
                                           ", ", ranks, " ranks");
        double worst = 0.0, worst_entry = 0.0;
        for (size_t i = 0; i < got.size(); ++i) {
          const auto wanted = shards.shard(want[i].detach(), rank, 2);
          const double error = relative_error(got[i], wanted);
          worst = std::max(worst, error);
          worst_entry = std::max(worst_entry, largest_error(got[i], wanted));
          if (!(error <= tolerance))
            fail(c10::str(label, ": ", names[i], " differs by ", error, " (relative) > ",
                          tolerance));
        }
        if (c.score_tensor.defined()) {
          auto summed = c.score_tensor.grad().clone();  // this rank's share, summed over ranks
          group->sum(summed);
          const double error = relative_error(summed, want_score_grad);
          worst = std::max(worst, error);
          worst_entry = std::max(worst_entry, largest_error(summed, want_score_grad));
          if (!(error <= tolerance))
            fail(c10::str(label,
                          ": the score tensor's gradient, summed over the ranks, differs by ",
                          error, " (relative) > ", tolerance));
        }
        if (layout == ShardLayout::kContiguous && c.contiguous_steps >= 0 &&
            forward_transfers != c.contiguous_steps) {
          fail(c10::str(label, ": the forward exchanged keys ", forward_transfers,
                        " times, expected ", c.contiguous_steps));
        }
        if (worst <= tolerance)
          pass(c10::str(label, ": output and gradients within ", worst, " relative (<= ", tolerance,
                        "; largest entry ", worst_entry, "); forward transfers ",
                        forward_transfers));
      }
    }
  }

  // bfloat16 (computed in float32, merged in float32): against the float64 call on the same
  // values, within 1.25x of the single bfloat16 call's own error, output and gradients.
  for (const auto& c : {cases[1], cases.back()}) {  // causal; ALiBi
    torch::manual_seed(17);
    const auto make = [&](int64_t h) {
      return torch::randn({batch, h, n, head_dim}).to(torch::kBFloat16).requires_grad_();
    };
    const auto q = make(heads), k = make(kv_heads), v = make(kv_heads);
    const auto grad = torch::randn({batch, heads, n, head_dim}).to(torch::kBFloat16);
    const auto run = [&](const torch::Tensor& q_in, const torch::Tensor& k_in,
                         const torch::Tensor& v_in, const torch::Tensor& grad_in, bool split) {
      const auto out = split ? attnkit::functional::context_parallel_attention(
                                   q_in, k_in, v_in, *group, c.options,
                                   attnkit::ContextParallelOptions().piece_bytes(4096))
                             : attnkit::functional::attention(q_in, k_in, v_in, c.options);
      const auto grads = torch::autograd::grad({out}, {q_in, k_in, v_in}, {grad_in});
      return std::vector<torch::Tensor>{out, grads[0], grads[1], grads[2]};
    };
    const auto wide = [](const torch::Tensor& t) {
      return t.detach().to(torch::kDouble).requires_grad_();
    };
    const auto exact = run(wide(q), wide(k), wide(v), grad.to(torch::kDouble), false);
    const auto single = run(q, k, v, grad, false);
    const SequenceShards shards(n, ranks, ShardLayout::kZigzag);
    const auto mine = [&](const torch::Tensor& whole) {
      return shards.shard(whole.detach(), rank, 2).requires_grad_();
    };
    const auto split = run(mine(q), mine(k), mine(v), shards.shard(grad, rank, 2), true);
    const char* names[] = {"output", "query gradient", "key gradient", "value gradient"};
    double worst_ratio = 0.0;
    bool bad = false;
    for (size_t i = 0; i < exact.size(); ++i) {
      const auto reference = shards.shard(exact[i], rank, 2);
      const double single_error =
          relative_error(shards.shard(single[i], rank, 2).to(torch::kDouble), reference);
      const double split_error = relative_error(split[i].to(torch::kDouble), reference);
      worst_ratio = std::max(worst_ratio, split_error / single_error);
      if (!(split_error <= 1.25 * single_error)) {
        bad = true;
        fail(c10::str(c.name, ", bfloat16: the ", names[i], " is ", split_error,
                      " from float64, the single call's ", single_error, " (more than 1.25x)"));
      }
    }
    if (!bad)
      pass(c10::str(c.name, ", bfloat16, zigzag, ", ranks, " ranks: output and gradients within ",
                    worst_ratio, "x the single bfloat16 call's error against float64"));
  }

  // RoPE at each shard's positions in the whole sequence: each chunk rotated from its start
  // gives the shard of the whole sequence's rotation, so the attention equals the whole call.
  {
    torch::manual_seed(13);
    const auto q = torch::randn({batch, heads, n, head_dim}, torch::kDouble);
    const auto k = torch::randn({batch, kv_heads, n, head_dim}, torch::kDouble);
    const auto v = torch::randn({batch, kv_heads, n, head_dim}, torch::kDouble);
    const auto [cos, sin] = attnkit::functional::compute_rope_params(head_dim, 10000.0, n,
                                                                     c10::nullopt, torch::kDouble);
    const auto options = AttentionOptions().mask(Mask::causal());
    const auto whole =
        attnkit::functional::attention(attnkit::functional::apply_rope(q, cos, sin),
                                       attnkit::functional::apply_rope(k, cos, sin), v, options);
    const SequenceShards shards(n, ranks, ShardLayout::kZigzag);
    const auto rotated_shard = [&](const torch::Tensor& x) {
      const auto mine = shards.shard(x, rank, 2);
      std::vector<torch::Tensor> pieces;
      for (const auto& part : shards.chunks(rank)) {
        pieces.push_back(attnkit::functional::apply_rope(
            mine.narrow(2, part.local_start, part.length), cos, sin, part.start));
      }
      return torch::cat(pieces, 2);
    };
    const auto out = attnkit::functional::context_parallel_attention(
        rotated_shard(q), rotated_shard(k), shards.shard(v, rank, 2), *group, options);
    const double error = relative_error(out, shards.shard(whole, rank, 2));
    if (error <= 1e-12)
      pass(c10::str("RoPE at each chunk's start, causal, zigzag, ", ranks, " ranks: within ", error,
                    " relative"));
    else
      fail(c10::str("RoPE at each chunk's start: differs by ", error, " (relative) > 1e-12"));
  }

  // attnkit-train: 50 steps context-parallel against one process.
  {
    namespace T = attnkit::train;
    std::vector<std::pair<std::string, T::TrainConfig>> runs;
    T::TrainConfig copy;
    copy.model.module = "mha";
    copy.model.layers = 2;
    runs.emplace_back("copy, mha, 2 layers", copy);
    T::TrainConfig reverse;
    reverse.task = "reverse";
    reverse.model.module = "mha-combined";
    runs.emplace_back("reverse (bidirectional), mha-combined", reverse);
    if (!data.empty()) {
      T::TrainConfig text;
      text.task = "text";
      text.data = data;
      text.pack = true;
      text.batch_size = 8;
      text.model.module = "gqa";
      text.model.rope = true;
      text.model.qk_norm = true;
      text.model.ffn = true;
      runs.emplace_back("text, packed documents, gqa, RoPE, QK-norm", text);
    }
    // (--context-parallel, run): every run on 2 ranks; on 4 (4 ranks take 4x the time on 2
    // cores), the copy task on all 4 and the last run on 2 data-parallel groups of 2.
    std::vector<std::pair<int64_t, size_t>> picked;
    for (size_t i = 0; i < runs.size(); ++i) {
      if (ranks == 2)
        picked.emplace_back(2, i);
    }
    if (ranks == 4) {
      picked.emplace_back(4, 0);
      picked.emplace_back(2, runs.size() - 1);
    }
    for (const auto& [cp, index] : picked) {
      const auto& [name, config] = runs[index];
      const auto result = train_difference(config, cp, *group);
      const auto what = c10::str("attnkit-train, ", name, ", --context-parallel ", cp, " of ",
                                 ranks, " ranks, 50 steps' losses against one process: ");
      if (result.rfind("ok ", 0) == 0)
        pass(what + result.substr(3));
      else
        fail(what + result);
    }
  }

  // Refusals, before any transfer of tensors.
  const auto expect_refusal = [&](const std::string& what, const std::string& needle,
                                  const std::function<void()>& call) {
    try {
      call();
      fail(what + ": accepted");
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      if (message.find(needle) == std::string::npos)
        fail(what + ": the message lacks '" + needle + "': " + message);
      else
        pass(what + ": " + message.substr(0, message.find('\n')));
    }
  };
  const auto odd = torch::randn({1, 2, 2 * chunk + 1, 8});
  expect_refusal("a shard of an odd length (zigzag)", "equal chunks",
                 [&] { attnkit::functional::context_parallel_attention(odd, odd, odd, *group); });
  // The last rank's head_dim differs: every rank refuses, naming it.
  const auto q_bad = torch::randn({1, 2, 2 * chunk, rank == ranks - 1 ? 4 : 8});
  expect_refusal("ranks with different shards", c10::str("rank ", ranks - 1, " has"), [&] {
    attnkit::functional::context_parallel_attention(q_bad, q_bad, q_bad, *group);
  });
  const auto q_ok = torch::randn({1, 2, 2 * chunk, 8});
  expect_refusal("a C++ function as the score function", "score_mod: a C++ function", [&] {
    attnkit::functional::context_parallel_attention(
        q_ok, q_ok, q_ok, *group,
        AttentionOptions().score_mod([](const torch::Tensor& score, const torch::Tensor&,
                                        const torch::Tensor&, const torch::Tensor&,
                                        const torch::Tensor&) { return score * 2; }));
  });
  expect_refusal("a mask for another length", "document_ids must have shape", [&] {
    attnkit::functional::context_parallel_attention(
        q_ok, q_ok, q_ok, *group,
        AttentionOptions().mask(Mask::documents(torch::zeros({5}, torch::kInt64))));
  });
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 2, timeout_s = 60, threads = 1, rounds = 3;
  int64_t bench_length = 0, piece_bytes = attnkit::ContextParallelOptions().piece_bytes();
  bool single = false;
  std::string fault, data;
  std::vector<std::string> arguments;
  const char* usage =
      "usage: attnkit-context-parallel-check [--ranks R] [--fault die] [--timeout S] "
      "[--data PATH]\n"
      "       attnkit-context-parallel-check --bench N [--ranks R | --single] [--threads T]\n"
      "       [--rounds K] [--piece-kib P]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--single") {
      single = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::cerr << usage;
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--ranks") {
      ranks = std::stoi(value);
    } else if (flag == "--data") {
      data = value;
    } else if (flag == "--fault") {
      fault = value;
    } else if (flag == "--timeout") {
      timeout_s = std::stoi(value);
    } else if (flag == "--bench") {
      bench_length = std::stoll(value);
    } else if (flag == "--threads") {
      threads = std::stoi(value);
    } else if (flag == "--rounds") {
      rounds = std::stoi(value);
    } else if (flag == "--piece-kib") {
      piece_bytes = std::stoll(value) << 10;
    } else {
      std::cerr << usage;
      return 2;
    }
    arguments.push_back(flag);
    arguments.push_back(value);
  }
  try {
    attnkit::set_num_threads(threads);  // LibTorch's threads and the BLAS's
    if (single)
      return bench(bench_length, rounds, piece_bytes, nullptr);
    if (std::getenv("WORLD_SIZE") == nullptr)
      return attnkit::train::launch_local_ranks(ranks, arguments, std::cerr, 30);
    return run_rank(ranks, fault, timeout_s, bench_length, rounds, piece_bytes, data);
  } catch (const std::exception& e) {
    std::cerr << "attnkit-context-parallel-check: " << e.what() << "\n";
    return 1;
  }
}
