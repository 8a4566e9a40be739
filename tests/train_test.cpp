// attnkit_train (src/train/): tasks, determinism, checkpoints and resume, faults, metrics.

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "attnkit/attnkit.h"
#include "attnkit/threads.h"
#include "source_paths.h"
#include "test_support.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/flat_adamw.h"
#include "train/gradient_sync.h"
#include "train/heatmap.h"
#include "train/interrupts.h"
#include "train/run_output.h"
#include "train/tasks.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
namespace T = attnkit::train;
using namespace attnkit::testing;

namespace {

class TrainTest : public TempDirTest {
 protected:
  // A small, quick configuration; dropout on so that resuming must restore the RNG too.
  static T::TrainConfig small_config() {
    T::TrainConfig c;
    c.task = "copy";
    c.model.module = "mha";
    c.model.d_model = 32;
    c.model.heads = 2;
    c.batch_size = 16;
    c.steps = 40;
    c.eval_every = 10;
    c.model.dropout = 0.1;
    c.device = "cpu";
    c.threads = 1;
    c.quiet = true;
    return T::resolve(c);
  }

  std::vector<double> run(const T::TrainConfig& c) {
    std::ostringstream out;
    return T::train(c, out).losses;
  }
};

std::vector<std::string> lines_of(const std::string& file) {
  std::ifstream in(file);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

}  // namespace

TEST(Tasks, CopyScoresOnlyTheCopiedHalf) {
  auto task = T::make_task("copy", 8, 1, "");
  auto generator = at::detail::createCPUGenerator(3);
  const auto batch = task->train_batch(4, generator);
  EXPECT_EQ(batch.inputs.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_TRUE(task->causal());
  // Input: 8 symbols, separator 0, first 7 copies; targets shifted by one.
  EXPECT_TRUE(batch.inputs.select(1, 8).eq(0).all().item<bool>());
  EXPECT_TRUE(torch::equal(batch.targets.slice(1, 8), batch.inputs.slice(1, 0, 8)));
  EXPECT_EQ(batch.loss_mask.sum().item<int64_t>(), 4 * 8);
  EXPECT_FALSE(batch.loss_mask.slice(1, 0, 8).any().item<bool>());
}

TEST(Tasks, ReverseAndRecallTargets) {
  auto generator = at::detail::createCPUGenerator(4);
  const auto reverse = T::make_task("reverse", 6, 1, "")->train_batch(3, generator);
  EXPECT_TRUE(torch::equal(reverse.targets, reverse.inputs.flip({1})));
  EXPECT_FALSE(T::make_task("reverse", 6, 1, "")->causal());

  const auto recall = T::make_task("recall", 4, 1, "")->train_batch(32, generator);
  EXPECT_EQ(recall.inputs.sizes(), (std::vector<int64_t>{32, 9}));
  for (int64_t b = 0; b < 32; ++b) {
    const auto asked = recall.inputs[b][8].item<int64_t>();
    int64_t expected = -1;
    for (int64_t p = 0; p < 4; ++p) {
      if (recall.inputs[b][2 * p].item<int64_t>() == asked) {
        expected = recall.inputs[b][2 * p + 1].item<int64_t>();
      }
    }
    EXPECT_EQ(recall.targets[b][8].item<int64_t>(), expected) << "row " << b;
  }
  EXPECT_EQ(recall.loss_mask.sum().item<int64_t>(), 32);
}

TEST(Tasks, TextEntropiesOfTheVerdict) {
  // shared/data/README.md: unigram 4.49 and bigram (add-one) 3.56 bits/char on validation.
  const auto task = T::make_task("text", 64, 1, std::string(kSourceDir) + "/data/the-verdict.txt");
  EXPECT_NEAR(task->unigram_entropy(), 4.49, 0.005);
  EXPECT_NEAR(task->bigram_entropy(), 3.56, 0.005);
  const auto eval = task->eval_batches(8);
  EXPECT_EQ(eval.front().inputs.sizes(), (std::vector<int64_t>{8, 64}));
  EXPECT_TRUE(torch::equal(eval.front().targets.select(1, 0), eval.front().inputs.select(1, 1)));
}

TEST(Tasks, PackedTextRowsCarryTheirParagraphs) {
  // --pack: a document ends at a blank line; a byte's id counts the blank lines before it.
  const auto task =
      T::make_task("text", 256, 1, std::string(kSourceDir) + "/data/the-verdict.txt", true);
  at::Generator generator = at::detail::createCPUGenerator(3);
  auto batches = task->eval_batches(4);
  batches.push_back(task->train_batch(8, generator));
  int64_t documents_started = 0;
  for (const auto& batch : batches) {
    ASSERT_TRUE(batch.document_ids.defined());
    ASSERT_EQ(batch.document_ids.sizes(), batch.inputs.sizes());
    for (int64_t row = 0; row < batch.inputs.size(0); ++row) {
      const auto bytes = batch.inputs[row], ids = batch.document_ids[row];
      for (int64_t j = 2; j < bytes.size(0); ++j) {
        const bool after_blank_line =
            bytes[j - 1].item<int64_t>() == '\n' && bytes[j - 2].item<int64_t>() == '\n';
        const auto step = ids[j].item<int64_t>() - ids[j - 1].item<int64_t>();
        ASSERT_EQ(step, after_blank_line ? 1 : 0) << "row " << row << " byte " << j;
        documents_started += step;
        // The byte that starts a document is not predicted from the one before it.
        EXPECT_EQ(batch.loss_mask[row][j - 1].item<bool>(), !after_blank_line);
      }
    }
  }
  EXPECT_GT(documents_started, 10);  // 256-byte rows of The Verdict hold several paragraphs
  EXPECT_FALSE(T::make_task("text", 64, 1, std::string(kSourceDir) + "/data/the-verdict.txt")
                   ->eval_batches(1)
                   .front()
                   .document_ids.defined());
}

TEST(Tasks, BadArgumentsAreNamed) {
  expect_error_containing([] { T::make_task("copy", 8, 1, "", true); },
                          "--pack: only the text task has documents to pack, got --task copy");
  expect_error_containing([] { T::make_task("nope", 8, 1, ""); }, "--task: unknown task 'nope'");
  expect_error_containing([] { T::make_task("copy", 0, 1, ""); },
                          "--seq-len: expected 1..512 for task copy, got 0");
  expect_error_containing([] { T::make_task("recall", 20, 1, ""); },
                          "--seq-len: expected 1..16 for task recall, got 20");
  expect_error_containing([] { T::make_task("text", 64, 1, "/nonexistent/file.txt"); },
                          "--data: cannot read '/nonexistent/file.txt'");
}

TEST_F(TrainTest, EmptyOrShortDataFileIsRefused) {
  std::ofstream(path("empty.txt")).close();
  expect_error_containing([&] { T::make_task("text", 64, 1, path("empty.txt")); }, "is empty");
  std::ofstream(path("short.txt")) << "too short";
  expect_error_containing([&] { T::make_task("text", 64, 1, path("short.txt")); },
                          "has 9 bytes; the text task needs more than");
}

TEST_F(TrainTest, SameSeedGivesTheSameLossCurve) {
  const auto config = small_config();
  const auto first = run(config);
  ASSERT_EQ(first.size(), 40u);
  EXPECT_EQ(run(config), first);
  auto other_seed = config;
  other_seed.seed = 2;
  EXPECT_NE(run(other_seed), first);
}

TEST_F(TrainTest, EveryBackendFollowsTheMathLossCurve) {
  // Fused draws the math path's dropout masks, so it follows math with dropout on; chunked
  // draws its own, so it is compared without dropout. Only float32 summation order differs.
  const auto curve = [&](const std::string& backend, double dropout) {
    auto config = small_config();
    config.model.backend = backend;
    config.model.dropout = dropout;
    return run(config);
  };
  const auto expect_close = [](const std::vector<double>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-4) << "step " << i + 1;
  };
  expect_close(curve("fused", 0.1), curve("math", 0.1));
  expect_close(curve("chunked", 0.0), curve("math", 0.0));
  EXPECT_NE(curve("fused", 0.1), curve("fused", 0.0));
}

TEST_F(TrainTest, StepsInSharesFollowTheOneBatchLossCurveAndRepeat) {
  // At N threads on the CPU a step's batch is cut into N shares, each forward and backward
  // on its own worker, and the gradients summed in share order: only float32 summation
  // order differs from one batch, and a run at a given thread count repeats exactly. With
  // dropout the step stays one batch on one thread, so its losses equal the 1-thread run's.
  const int torch_threads = torch::get_num_threads();
  const int blas_threads = attnkit::blas_threads().num_threads;
  const auto curve = [&](int64_t threads, double dropout) {
    auto config = small_config();
    config.threads = threads;  // 16 rows: 3 shares of 5, 5 and 6
    config.model.dropout = dropout;
    return run(config);
  };
  const auto one_batch = curve(1, 0.0);
  const auto shares = curve(3, 0.0);
  ASSERT_EQ(shares.size(), one_batch.size());
  for (size_t i = 0; i < shares.size(); ++i)
    EXPECT_NEAR(shares[i], one_batch[i], 1e-4) << "step " << i + 1;
  EXPECT_NE(shares, one_batch) << "the shares did not run: the curves are bit-identical";
  EXPECT_EQ(curve(3, 0.0), shares);
  EXPECT_EQ(curve(3, 0.1), curve(1, 0.1));
  attnkit::set_num_threads(blas_threads > 0 ? blas_threads : torch_threads);
  torch::set_num_threads(torch_threads);
}

TEST(FlatAdamW, FollowsLibTorchAdamWWithClipping) {
  // Two copies of a small model: LibTorch's AdamW + clip_grad_norm_ on one, FlatAdamW on the
  // other, the same batches; a max norm the gradients exceed, so clipping acts.
  torch::manual_seed(7);
  torch::nn::Sequential reference(torch::nn::Embedding(5, 4), torch::nn::Linear(4, 3));
  auto flat_model = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(reference->clone());
  torch::optim::AdamW adamw(reference->parameters(),
                            torch::optim::AdamWOptions(0.05).weight_decay(0.1));
  T::FlatAdamW flat(flat_model->parameters(), 0.05, 0.1);
  for (int step = 0; step < 6; ++step) {
    const auto tokens = torch::randint(0, 5, {8});
    const auto targets = torch::randint(0, 3, {8});
    adamw.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(tokens), targets).backward();
    const double want_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.1);
    adamw.step();
    flat.zero_grad();
    torch::nn::functional::cross_entropy(flat_model->forward(tokens), targets).backward();
    EXPECT_NEAR(flat.clip_grad_norm(0.1), want_norm, 1e-6);
    flat.step();
  }
  const auto want = reference->named_parameters();
  for (const auto& p : flat_model->named_parameters()) {
    EXPECT_TRUE(tensors_close(p.key(), p.value(), want[p.key()], 1e-6));
  }
  expect_error_containing([] { T::FlatAdamW({}, 0.1, 0.0); }, "expected at least one parameter");
}

TEST_F(TrainTest, ResumeContinuesExactlyAsAnUninterruptedRun) {
  const auto config = small_config();
  const auto uninterrupted = run(config);

  auto first_half = config;
  first_half.steps = 20;
  first_half.save = path("run.pt");
  auto losses = run(first_half);
  ASSERT_TRUE(fs::exists(path("run.pt")));
  EXPECT_TRUE(fs::exists(path("run.best.pt")));

  auto second_half = config;
  second_half.resume = path("run.pt");
  const auto rest = run(second_half);
  losses.insert(losses.end(), rest.begin(), rest.end());
  EXPECT_EQ(losses, uninterrupted);
}

TEST_F(TrainTest, EveryByteFlippedInACheckpointIsReported) {
  auto config = small_config();
  config.steps = 2;
  config.save = path("run.pt");
  run(config);
  auto resumed = config;
  resumed.save.clear();
  resumed.resume = path("damaged.pt");
  // Up to 24 bytes spread over each record (the model's weights are tens of kB).
  expect_every_flip_reported(
      path("run.pt"), path("damaged.pt"), [&](const std::string&) { run(resumed); },
      /*max_positions_per_record=*/24);
}

TEST_F(TrainTest, IncompatibleOrForeignCheckpointIsRefused) {
  auto config = small_config();
  config.steps = 5;
  config.save = path("run.pt");
  run(config);
  auto other = small_config();
  other.model.module = "mha-combined";
  other.resume = path("run.pt");
  expect_error_containing([&] { run(other); },
                          "--resume: incompatible checkpoint '" + path("run.pt") +
                              "': it was trained with --module mha, this run has --module "
                              "mha-combined");
  // --rope either way is named, whichever side has it.
  auto rotary = small_config();
  rotary.model.rope = true;
  rotary.resume = path("run.pt");
  expect_error_containing([&] { run(rotary); },
                          "it was trained with --rope false, this run has --rope true");
  // A checkpoint written before --rope and --qk-norm existed has neither setting: it was
  // trained without them, so it resumes without them and is refused with them.
  attnkit::StateDict older;
  for (const auto& item : attnkit::read_state_dict(path("run.pt"))) {
    if (item.key() != "settings.rope" && item.key() != "settings.qk-norm")
      older.insert(item.key(), item.value());
  }
  attnkit::write_state_dict(older, path("older.pt"));
  auto resumed = small_config();
  resumed.steps = 6;
  resumed.resume = path("older.pt");
  EXPECT_EQ(run(resumed).size(), 1u);  // step 6 only
  resumed.model.qk_norm = true;
  expect_error_containing([&] { run(resumed); },
                          "it was trained with --qk-norm false, this run has --qk-norm true");
  std::ofstream(path("foreign.pt")) << "not a checkpoint";
  auto foreign = small_config();
  foreign.resume = path("foreign.pt");
  expect_error_containing([&] { run(foreign); }, "is not an attnkit-train checkpoint");
}

TEST_F(TrainTest, StopRequestFinishesTheStepSavesAndResumes) {
  auto config = small_config();
  config.steps = 1000000;
  config.save = path("run.pt");
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    stop.store(true);
  });
  std::ostringstream out;
  const auto result = T::train(config, out, &stop);
  stopper.join();
  EXPECT_TRUE(result.interrupted);
  EXPECT_GT(result.last_step, 0);
  EXPECT_LT(result.last_step, config.steps);
  // The saved state resumes at the step it stopped after.
  auto resumed = config;
  resumed.steps = result.last_step + 2;
  resumed.resume = path("run.pt");
  resumed.save.clear();
  EXPECT_EQ(run(resumed).size(), 2u);
}

TEST_F(TrainTest, NonFiniteLossStopsAndKeepsTheLastGoodCheckpoint) {
  auto good = small_config();
  good.steps = 10;
  good.save = path("run.pt");
  run(good);
  const auto saved = lines_of(path("run.pt"));

  auto diverging = small_config();
  diverging.lr = 1e30;  // the first update throws the weights to overflow
  diverging.eval_every = 1;
  diverging.save = path("run.pt");
  try {
    run(diverging);
    FAIL() << "expected NonFiniteLoss";
  } catch (const T::NonFiniteLoss& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("became NaN at step 1; training stopped; nothing was saved"),
              std::string::npos)
        << message;
  }
  // The good checkpoint is untouched. A run that resumes from its --save file says which step
  // that file holds, though this run saved nothing.
  EXPECT_EQ(lines_of(path("run.pt")), saved);
  diverging.resume = path("run.pt");
  diverging.steps = 12;
  try {
    run(diverging);
    FAIL() << "expected NonFiniteLoss";
  } catch (const T::NonFiniteLoss& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("became NaN at step 11; training stopped; the last good checkpoint is " +
                           path("run.pt") + " (step 10)"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(lines_of(path("run.pt")), saved);
  auto resumed = small_config();
  resumed.resume = path("run.pt");
  resumed.steps = 13;
  EXPECT_EQ(run(resumed).size(), 3u);
}

TEST_F(TrainTest, MetricsFilesJsonLinesAndCsv) {
  auto config = small_config();
  config.steps = 20;
  config.metrics = path("metrics.jsonl");
  run(config);
  const auto json = lines_of(path("metrics.jsonl"));
  ASSERT_EQ(json.size(), 3u);  // evaluations at 10 and 20, then the final one
  for (const auto* field :
       {"\"step\": ", "\"loss\": ", "\"accuracy\": ", "\"tokens_per_s\": ", "\"elapsed_s\": "}) {
    EXPECT_NE(json[0].find(field), std::string::npos) << json[0];
  }
  EXPECT_NE(json.back().find("\"final\": true"), std::string::npos) << json.back();
  EXPECT_NE(json[0].find("\"final\": false"), std::string::npos) << json[0];

  config.metrics = path("metrics.csv");
  run(config);
  const auto csv = lines_of(path("metrics.csv"));
  ASSERT_EQ(csv.size(), 4u);
  EXPECT_EQ(csv[0], "step,loss,accuracy,train_loss,tokens_per_s,elapsed_s,final");
  EXPECT_EQ(csv.back().substr(csv.back().rfind(',') + 1), "true");
}

TEST_F(TrainTest, AMetricsLineTheFileDoesNotTakeEndsTheRunNamingTheFile) {
  // /dev/full takes the open and refuses every write, as a full disk does.
  if (!std::filesystem::exists("/dev/full"))
    GTEST_SKIP() << "no /dev/full here";
  T::Evaluation evaluation;
  evaluation.loss = 1.5;
  T::MetricsWriter json("/dev/full", /*text_task=*/false);
  expect_error_containing([&] { json.write(10, evaluation, 1.4, 100.0, 2.0, false); },
                          "--metrics: writing '/dev/full' failed at step 10 (is the disk full?)");
  // A .csv file writes its header first; here it fails there.
  const auto link = path("full.csv");
  std::filesystem::create_symlink("/dev/full", link);
  expect_error_containing([&] { T::MetricsWriter csv(link, /*text_task=*/true); },
                          "--metrics: writing '" + link + "' failed (is the disk full?)");
}

TEST_F(TrainTest, PackedTextTrainsWithTheDocumentMaskOnEveryBackend) {
  // The packed run differs from the plain one (documents kept apart, positions restarted)
  // and its loss falls; kFused hands the document mask to chunked.
  const auto curve = [&](bool pack, const std::string& backend) {
    auto config = small_config();
    config.task = "text";
    config.data = std::string(kSourceDir) + "/data/the-verdict.txt";
    config.seq_len = 128;
    config.model.dropout = 0.0;
    config.steps = 12;
    config.pack = pack;
    config.model.backend = backend;
    return run(T::resolve(config));
  };
  const auto packed = curve(true, "chunked");
  ASSERT_EQ(packed.size(), 12u);
  EXPECT_LT(packed.back(), packed.front() - 0.5);
  EXPECT_NE(packed, curve(false, "chunked"));
  const auto fused = curve(true, "fused"), math = curve(true, "math");
  for (size_t i = 0; i < packed.size(); ++i) {
    EXPECT_NEAR(fused[i], packed[i], 1e-4) << "step " << i + 1;
    EXPECT_NEAR(math[i], packed[i], 1e-4) << "step " << i + 1;
  }
}

// --save through a symbolic link (into another folder, as to a shared disk) saves into the
// link's target and keeps the link, every save and the resume; a FIFO and a safetensors name
// are refused (a checkpoint is a zip file to resume from).
TEST_F(TrainTest, SaveWritesThroughASymlinkAndRefusesWhatIsNoCheckpointFile) {
  std::filesystem::create_directories(path("shared"));
  std::filesystem::create_symlink(path("shared/run.pt"), path("run.pt"));
  auto config = small_config();
  config.steps = 4;
  config.eval_every = 2;
  config.save = path("run.pt");
  run(config);
  EXPECT_TRUE(std::filesystem::is_symlink(std::filesystem::symlink_status(path("run.pt"))));
  EXPECT_TRUE(
      std::filesystem::is_regular_file(std::filesystem::symlink_status(path("shared/run.pt"))));
  config.resume = path("run.pt");
  config.steps = 6;
  run(config);
  EXPECT_TRUE(std::filesystem::is_symlink(std::filesystem::symlink_status(path("run.pt"))));
  EXPECT_EQ(attnkit::read_state_dict(path("shared/run.pt"))["step"].item<int64_t>(), 6);
  for (const auto& entry : std::filesystem::directory_iterator(path("shared")))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();

  ASSERT_EQ(::mkfifo(path("pipe.pt").c_str(), 0600), 0);
  config = small_config();
  config.save = path("pipe.pt");
  expect_error_containing([&] { T::resolve(config); },
                          "--save: '" + path("pipe.pt") + "' is not a regular file");
  EXPECT_TRUE(std::filesystem::is_fifo(std::filesystem::symlink_status(path("pipe.pt"))));
  config.save = path("run.safetensors");
  expect_error_containing([&] { T::resolve(config); },
                          "--save: '" + path("run.safetensors") + "' names a safetensors file");
}

TEST_F(TrainTest, ResolveNamesTheBadFlag) {
  auto config = small_config();
  config.batch_size = 0;
  expect_error_containing([&] { T::resolve(config); }, "--batch-size: expected >= 1, got 0");
  config = small_config();
  config.dump_attention = path("map.jpg");
  expect_error_containing([&] { T::resolve(config); }, "expected a file name ending in .png");
  config = small_config();
  config.device = "tpu";
  expect_error_containing([&] { T::resolve(config); },
                          "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'");
  config = small_config();
  config.model.module = "sa-v2";
  expect_error_containing([&] { run(config); }, "--module sa-v2 has no causal mask");
  config = small_config();
  config.task = "reverse";
  config.model.module = "causal";
  expect_error_containing([&] { run(config); }, "--module causal always applies a causal mask");
  config = small_config();
  config.model.backend = "flash";
  expect_error_containing([&] { run(config); },
                          "--backend: unknown backend 'flash'; expected math, fused or chunked");
  config = small_config();
  config.model.module = "causal";
  config.model.backend = "fused";
  expect_error_containing(
      [&] { run(config); },
      "--backend fused: only mha, mha-combined, gqa, mqa and mla have backends");
  config = small_config();
  config.pack = true;
  expect_error_containing([&] { T::resolve(config); },
                          "--pack: only the text task has documents to pack, got --task copy");
  config.task = "text";
  config.model.module = "causal";
  config.model.backend = "";
  expect_error_containing([&] { T::resolve(config); },
                          "--pack: --module causal takes no mask, so it cannot keep packed "
                          "documents apart; use mha, mha-combined, gqa, mqa or mla");
  config = small_config();
  config.context_parallel = 0;
  expect_error_containing([&] { T::resolve(config); },
                          "--context-parallel: expected >= 1 (1 = none), got 0");
  config.context_parallel = 2;
  config.model.dropout = 0.1;
  expect_error_containing([&] { T::resolve(config); },
                          "--context-parallel: attention dropout is not offered (the split calls' "
                          "backward cannot redraw it); expected --dropout 0, got 0.1");
  config.model.dropout = 0.0;
  config.model.module = "causal";
  config.model.backend = "";
  expect_error_containing([&] { T::resolve(config); },
                          "--context-parallel: --module causal does not run context-parallel");
  config = small_config();
  config.context_parallel = 2;
  config.model.dropout = 0.0;
  expect_error_containing([&] { run(config); },
                          "--context-parallel 2: the ranks form groups of 2 that share a sequence, "
                          "so the number of ranks must be a multiple of it; got 1 (start them "
                          "with --nproc)");
  expect_error_containing([] { T::check_context_parallel_ranks(2, 3); }, "got 3");
  config.task = "reverse";
  config.seq_len = 6;
  config.context_parallel = 4;
  expect_error_containing([&] { T::check_context_parallel_length(config, 6); },
                          "--context-parallel 4: task reverse with --seq-len 6 has sequences of 6 "
                          "tokens, which must divide into 8 equal chunks");
  EXPECT_EQ(T::best_checkpoint_path("dir.v2/run.pt"), "dir.v2/run.best.pt");
  EXPECT_EQ(T::best_checkpoint_path("dir.v2/run"), "dir.v2/run.best");
}

// ---- data-parallel pieces that need no second process (tests/distributed_test.sh runs two) --

TEST(DataParallel, RankEnvironmentIsReadAndBadValuesAreNamed) {
  const auto read = [](std::map<std::string, std::string> variables) {
    return T::read_rank_environment([variables](const char* name) -> const char* {
      const auto it = variables.find(name);
      return it == variables.end() ? nullptr : it->second.c_str();
    });
  };
  const auto none = read({});
  EXPECT_FALSE(none.launched);
  EXPECT_EQ(none.world_size, 1);
  const auto env = read({{"RANK", "1"},
                         {"WORLD_SIZE", "3"},
                         {"LOCAL_RANK", "0"},
                         {"MASTER_ADDR", "10.0.0.1"},
                         {"MASTER_PORT", "29501"}});
  EXPECT_TRUE(env.launched);
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 0);
  EXPECT_EQ(env.local_world_size, 0);  // not said
  EXPECT_EQ(env.master_addr, "10.0.0.1");
  EXPECT_EQ(env.master_port, 29501);
  const std::map<std::string, std::string> rank_one{
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}};
  const auto with = [&](std::string name, std::string value) {
    auto variables = rank_one;
    if (value.empty())
      variables.erase(name);
    else
      variables[name] = value;
    return variables;
  };
  expect_error_containing([&] { read(with("WORLD_SIZE", "0")); },
                          "environment WORLD_SIZE: expected an integer in 1..65536, got '0'");
  expect_error_containing([&] { read(with("LOCAL_RANK", "5")); },
                          "environment LOCAL_RANK: expected an integer in 0..1, got '5'");
  EXPECT_EQ(read(with("LOCAL_WORLD_SIZE", "2")).local_world_size, 2);
  expect_error_containing([&] { read(with("LOCAL_WORLD_SIZE", "3")); },
                          "environment LOCAL_WORLD_SIZE: expected an integer in 2..2, got '3'");
  expect_error_containing([&] { read(with("MASTER_ADDR", "")); },
                          "environment MASTER_ADDR is not set: ranks of a 2-process run need "
                          "rank 0's address");
  expect_error_containing([&] { read(with("MASTER_PORT", "")); },
                          "environment MASTER_PORT is not set");
  expect_error_containing([&] { read(with("MASTER_PORT", "70000")); },
                          "environment MASTER_PORT: expected an integer in 1..65535, got '70000'");
}

TEST(DataParallel, OneProcessCollectivesChangeNothing) {
  const auto group = T::single_process();
  EXPECT_EQ(group->world_size(), 1);
  EXPECT_TRUE(group->is_main());
  auto t = torch::arange(4.0);
  group->sum(t);
  group->broadcast_from_main(t);
  EXPECT_TRUE(t.equal(torch::arange(4.0)));
  EXPECT_EQ(group->gather_all(t).size(), 1u);
  group->check_same_on_every_rank("flags", "anything");
  expect_error_containing([] { T::check_global_batch(3, 4); },
                          "--batch-size 3 is the global batch and must give each of the 4 ranks "
                          "at least one sequence");
  expect_error_containing([] { T::check_global_batch(1, 2, 2); },
                          "--batch-size 1 is the global batch and must give each of the 2 groups "
                          "of 2 ranks (--context-parallel) that share a sequence at least one "
                          "sequence");
}

TEST(DataParallel, ARankWithoutRankZeroGivesUpAfterTheTimeout) {
  T::RankEnvironment env;
  env.rank = 1;
  env.world_size = 2;
  env.master_port = T::free_local_port();
  expect_error_containing([&] { T::join_process_group(env, "gloo", /*timeout_s=*/1); },
                          c10::str("cannot reach the rendezvous store at 127.0.0.1:",
                                   env.master_port, " within 1 s (did rank 0 start?)"));
  expect_error_containing([&] { T::join_process_group(env, "mpi", 1); },
                          "--dist-backend: expected gloo or nccl, got 'mpi'");
}

// Two identical ranks, as one: a sum doubles the tensor. Records when each sum starts and
// whether it was waited for.
class TwoIdenticalRanks : public T::Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string backend() const override { return "test"; }
  void broadcast_from_main(torch::Tensor&) override {}
  std::function<void()> start_sum(torch::Tensor& tensor) override {
    started.push_back({tensor.numel(), in_backward});
    return [this, tensor]() mutable {
      tensor.mul_(2);
      ++waited;
    };
  }
  std::vector<torch::Tensor> gather_all(const torch::Tensor& t) override { return {t, t}; }
  void check_same_on_every_rank(const std::string&, const std::string&) override {}
  std::function<void()> start_send_receive(const std::vector<torch::Tensor>&, int,
                                           std::vector<torch::Tensor>&, int) override {
    throw std::logic_error("data-parallel training sends no tensor from rank to rank");
  }

  struct Start {
    int64_t numel;
    bool during_backward;
  };
  std::vector<Start> started;
  bool in_backward = false;
  int waited = 0;
};

// Context parallelism on one rank, in pieces of 8 tokens: every pair of pieces and every merge
// of the multi-rank path but the transfers (tests/context_parallel_check.cpp runs 2 and 4
// ranks), here also under the sanitizers.
TEST(ContextParallel, OneRankInPiecesEqualsTheWholeCall) {
  torch::manual_seed(3);
  const int64_t n = 64;
  const auto ids = torch::arange(n, torch::kInt64).div(23, "floor");
  const auto allowed = torch::rand({n, n}) < 0.5;
  // Score functions that read positions: each piece must count them in the whole sequence,
  // and their tensors' gradients sum over the pieces.
  const auto table = torch::randn({4, 2 * 10 + 1}, torch::kDouble).requires_grad_();
  const auto bias = torch::randn({4, n, n}, torch::kDouble).requires_grad_();
  struct Case {
    std::string name;
    attnkit::functional::AttentionOptions options;
    torch::Tensor score_tensor;  // wants a gradient; undefined for none
  };
  const std::vector<Case> cases{
      {"causal", attnkit::functional::AttentionOptions().mask(attnkit::Mask::causal()), {}},
      {"documents, softcap",
       attnkit::functional::AttentionOptions()
           .mask(attnkit::Mask::documents(ids, true))
           .score_mod(attnkit::score_mods::softcap(5.0)),
       {}},
      {"block mask",
       attnkit::functional::AttentionOptions().block_mask(
           attnkit::create_block_mask(attnkit::Mask::from_tensor(allowed), 1, 1, n, n,
                                      attnkit::BlockMaskOptions().block_size(16))),
       {}},
      {"ALiBi, causal",
       attnkit::functional::AttentionOptions()
           .mask(attnkit::Mask::causal())
           .score_mod(attnkit::score_mods::alibi(attnkit::score_mods::alibi_slopes(4))),
       {}},
      {"relative-position table, no mask",
       attnkit::functional::AttentionOptions().score_mod(
           attnkit::score_mods::relative_position_bias(table)),
       table},
      {"a graph: bias[h, q_idx, kv_idx], causal",
       attnkit::functional::AttentionOptions()
           .mask(attnkit::Mask::causal())
           .score_mod(attnkit::ScoreGraph::parse("index $0 %2 %3 %4\nadd %0 %5").bind({bias})),
       bias},
  };
  auto one_rank = attnkit::train::single_process();
  for (const auto layout : {attnkit::ShardLayout::kZigzag, attnkit::ShardLayout::kContiguous}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(c.name);
      const auto make = [&](int64_t heads) {
        return torch::randn({2, heads, n, 8}, torch::kDouble).requires_grad_();
      };
      const auto q = make(4), k = make(2), v = make(2);
      std::vector<torch::Tensor> inputs{q, k, v};
      if (c.score_tensor.defined())
        inputs.push_back(c.score_tensor);
      const auto grad = torch::randn({2, 4, n, 8}, torch::kDouble);
      const auto want = attnkit::functional::attention(q, k, v, c.options);
      const auto want_grads = torch::autograd::grad({want}, inputs, {grad});
      // 8 tokens of 2 float64 heads of 8 in a batch of 2: 1,024 bytes.
      const auto got = attnkit::functional::context_parallel_attention(
          q, k, v, *one_rank, c.options,
          attnkit::ContextParallelOptions().layout(layout).piece_bytes(1024));
      const auto got_grads = torch::autograd::grad({got}, inputs, {grad});
      EXPECT_TRUE(torch::allclose(got, want, 1e-12, 1e-12));
      for (size_t i = 0; i < inputs.size(); ++i)
        EXPECT_TRUE(torch::allclose(got_grads[i], want_grads[i], 1e-12, 1e-12)) << "input " << i;
    }
  }
  // A C++ function the split kernels cannot run is refused by name.
  const auto q = torch::randn({1, 2, 8, 4});
  expect_error_containing(
      [&] {
        attnkit::functional::context_parallel_attention(
            q, q, q, *one_rank,
            attnkit::functional::AttentionOptions().score_mod(
                [](const torch::Tensor& score, const torch::Tensor&, const torch::Tensor&,
                   const torch::Tensor&, const torch::Tensor&) { return score; }));
      },
      "[context_parallel_attention] score_mod: a C++ function");
}

// On one rank a scope's shard is the whole sequence in two zigzag chunks, the second rotated
// from position n / 2: the modules' scoped forward and gradients equal their plain ones
// (tests/context_parallel_test.sh compares 2 and 4 ranks through attnkit-train).
TEST(ContextParallel, ModulesInAScopeOnOneRankEqualTheirPlainForward) {
  torch::manual_seed(5);
  const int64_t n = 24, d = 16;
  const auto ids = torch::arange(n, torch::kInt64).div(10, "floor");
  auto one_rank = attnkit::train::single_process();
  const auto rope = attnkit::RopeOptions(n);
  std::vector<std::pair<std::string, std::shared_ptr<attnkit::CachedAttentionLayer>>> modules{
      {"mha, RoPE, QK-norm",
       attnkit::MultiHeadAttention(
           attnkit::MultiHeadAttentionOptions(d, d, n, 0.0, 4).rope(rope).qk_norm(true))
           .ptr()},
      {"gqa, RoPE, window 5",
       attnkit::GroupedQueryAttention(
           attnkit::GroupedQueryAttentionOptions(d, d, 0.0, 4, 2).rope(rope).sliding_window_size(5))
           .ptr()},
      {"mla",
       attnkit::MultiHeadLatentAttention(attnkit::MultiHeadLatentAttentionOptions(d, d, 0.0, 2))
           .ptr()},
  };
  for (const auto& [name, layer] : modules) {
    SCOPED_TRACE(name);
    const auto x = torch::randn({2, n, d}).requires_grad_();
    const auto mask = attnkit::Mask::documents(ids, /*causal=*/false);
    const auto want = layer->forward(x, {}, {}, mask);
    const auto grad = torch::randn_like(want);
    const auto parameters = layer->as_module()->parameters();
    auto inputs = parameters;
    inputs.push_back(x);
    const auto want_grads = torch::autograd::grad({want}, inputs, {grad});
    torch::Tensor got;
    {
      const attnkit::ContextParallelScope scope(*one_rank, n);
      got = layer->forward(x, {}, {}, mask);
    }
    const auto got_grads = torch::autograd::grad({got}, inputs, {grad});
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6));
    for (size_t i = 0; i < inputs.size(); ++i)
      EXPECT_TRUE(torch::allclose(got_grads[i], want_grads[i], 1e-4, 1e-5)) << "input " << i;
  }
}

TEST(ContextParallel, AScopeRefusesWhatItCannotShard) {
  const int64_t n = 16, d = 8;
  auto one_rank = attnkit::train::single_process();
  attnkit::MultiHeadAttention mha(attnkit::MultiHeadAttentionOptions(d, d, n, 0.0, 2));
  const auto x = torch::randn({1, n, d});
  const attnkit::ContextParallelScope scope(*one_rank, n);
  expect_error_containing([&] { mha->forward_with_weights(x); },
                          "[ContextParallelScope] attention weights are not computed by a "
                          "context-parallel call");
  expect_error_containing([&] { mha->forward(x, x); },
                          "cross-attention inside a ContextParallelScope is not offered");
  expect_error_containing(
      [&] {
        mha->forward(torch::randn({1, 8, d}));
      },
      "a module's input must be this rank's shard of 16 tokens (a sequence of "
      "16 over 1 ranks), got 8 tokens");
  mha->eval();
  auto cache = mha->make_kv_cache(1, n);
  expect_error_containing([&] { mha->forward_with_cache(x, cache); },
                          "a KV cache holds one process's whole sequence: call it outside the "
                          "ContextParallelScope");
  EXPECT_EQ(cache.size(), 0);
  mha->train();
  attnkit::MultiHeadAttention with_dropout(attnkit::MultiHeadAttentionOptions(d, d, n, 0.1, 2));
  expect_error_containing([&] { with_dropout->forward(x); }, "dropout is not offered");
  expect_error_containing([&] { attnkit::ContextParallelScope(*one_rank, 15); },
                          "must divide into 2 equal chunks");
}

TEST(DataParallel, GradientBucketsStartDuringBackwardInOrderAndSumEveryGradient) {
  torch::manual_seed(3);
  auto first = torch::nn::Linear(8, 16), second = torch::nn::Linear(16, 4);
  std::vector<torch::Tensor> parameters = first->parameters();
  for (const auto& p : second->parameters())
    parameters.push_back(p);
  T::FlatAdamW optimizer(parameters, 0.1, 0.0);
  const auto x = torch::randn({5, 8});
  const auto loss = [&] { return second(torch::relu(first(x))).square().sum(); };
  // The gradients one process computes, for comparison.
  optimizer.zero_grad();
  loss().backward();
  const auto expected = optimizer.flat_gradients().clone() * 2;

  for (const int64_t bucket_bytes : {int64_t{0}, int64_t{1}, int64_t{300}}) {
    SCOPED_TRACE(c10::str("bucket_bytes ", bucket_bytes));
    TwoIdenticalRanks ranks;
    T::GradientSync sync(parameters, optimizer.flat_gradients(), ranks, bucket_bytes);
    const auto sizes = sync.bucket_sizes();
    int64_t total = 0;
    for (const auto size : sizes)
      total += size;
    EXPECT_EQ(total, optimizer.flat_gradients().numel());
    for (int step = 0; step < 2; ++step) {  // the hooks serve every step
      ranks.started.clear();
      ranks.waited = 0;
      optimizer.zero_grad();
      sync.before_backward();
      ranks.in_backward = true;
      loss().backward();
      ranks.in_backward = false;
      sync.after_backward();
      EXPECT_TRUE(tensors_close("summed gradients", optimizer.flat_gradients(), expected, 0.0));
      ASSERT_EQ(ranks.started.size(), sizes.size());
      EXPECT_EQ(ranks.waited, static_cast<int>(sizes.size()));
      for (size_t b = 0; b < sizes.size(); ++b) {
        EXPECT_EQ(ranks.started[b].numel, sizes[b]) << "bucket " << b << " out of order";
        // One bucket: after backward. Else every bucket but the first parameter's starts
        // during backward (the one holding the first parameter is complete only at its end).
        if (bucket_bytes > 0 && b + 1 < sizes.size()) {
          EXPECT_TRUE(ranks.started[b].during_backward) << "bucket " << b;
        }
      }
    }
  }
  // Buckets of 1 byte: one per parameter, the last parameter's first.
  TwoIdenticalRanks ranks;
  T::GradientSync per_parameter(parameters, optimizer.flat_gradients(), ranks, 1);
  EXPECT_EQ(per_parameter.bucket_sizes(), (std::vector<int64_t>{4, 64, 16, 128}));
  expect_error_containing(
      [&] { T::GradientSync(parameters, optimizer.flat_gradients(), ranks, -1); },
      "[GradientSync] bucket_bytes: expected >= 0, got -1");
}

TEST(DataParallel, BackendFollowsTheDevice) {
  T::TrainConfig config;
  config.device = "cpu";
  EXPECT_EQ(T::resolve(config).dist_backend, "gloo");  // auto, on the CPU
  config.dist_backend = "mpi";
  expect_error_containing([&] { T::resolve(config); },
                          "--dist-backend: expected auto, gloo or nccl, got 'mpi'");
  config.dist_backend = "nccl";
  expect_error_containing([&] { T::resolve(config); },
                          "--dist-backend nccl: NCCL reduces GPU tensors and needs --device cuda, "
                          "got --device cpu; use --dist-backend gloo");
  // A device value needs no GPU: whether nccl can serve one is this build's property.
  if (T::nccl_available()) {
    EXPECT_NO_THROW(T::check_backend_serves("nccl", torch::kCUDA));
  } else {
    expect_error_containing([] { T::check_backend_serves("nccl", torch::kCUDA); },
                            "--dist-backend nccl: this attnkit-train was built without NCCL");
  }
  EXPECT_NO_THROW(T::check_backend_serves("gloo", torch::kCUDA));
  const T::RankEnvironment one;
  EXPECT_EQ(T::choose_dist_backend("auto", torch::kCPU, one), "gloo");
  EXPECT_EQ(T::choose_dist_backend("nccl", torch::kCPU, one), "nccl");  // refused when served
  EXPECT_EQ(T::choose_dist_backend("gloo", torch::kCUDA, one), "gloo");
  expect_error_containing([&] { T::choose_dist_backend("mpi", torch::kCPU, one); },
                          "--dist-backend: expected auto, gloo or nccl, got 'mpi'");
}

TEST(DataParallel, PlainCudaIsTheLocalRanksGpu) {
  T::RankEnvironment env;
  env.launched = true;
  env.world_size = 4;
  env.rank = env.local_rank = 3;
  EXPECT_EQ(T::rank_device(torch::kCPU, env, "gloo"), torch::Device(torch::kCPU));
  const torch::Device second_gpu(torch::kCUDA, 1);
  EXPECT_EQ(T::rank_device(second_gpu, env, "nccl"), second_gpu);  // named: kept
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "CUDA not available: plain cuda's rank device not checked";
  const int gpus = static_cast<int>(torch::cuda::device_count());
  EXPECT_EQ(T::rank_device(torch::kCUDA, env, "gloo"), torch::Device(torch::kCUDA, 3 % gpus));
  env.local_rank = gpus;
  expect_error_containing([&] { T::rank_device(torch::kCUDA, env, "nccl"); },
                          c10::str("--dist-backend nccl: LOCAL_RANK ", gpus, " needs GPU ", gpus,
                                   " but ", gpus, " GPU(s) are visible"));
  // auto: NCCL only when every local rank has its own GPU.
  const std::string nccl = T::nccl_available() ? "nccl" : "gloo";
  env.local_world_size = gpus;
  EXPECT_EQ(T::choose_dist_backend("auto", torch::kCUDA, env), nccl);
  env.local_world_size = gpus + 1;
  EXPECT_EQ(T::choose_dist_backend("auto", torch::kCUDA, env), "gloo");
  EXPECT_EQ(T::choose_dist_backend("auto", torch::Device(torch::kCUDA, 0), env), nccl);
}

// One rank is all a single GPU allows NCCL (two ranks on one GPU are refused); the
// collectives run for real through NCCL on the GPU, and CPU tensors come back on the CPU.
TEST(DataParallel, NcclGroupReducesOnTheGpu) {
  if (!T::nccl_available() || !torch::cuda::is_available())
    GTEST_SKIP() << "needs a CUDA build with NCCL and a GPU";
  T::RankEnvironment env;
  env.launched = true;
  env.master_port = T::free_local_port();
  const torch::Device gpu(torch::kCUDA, 0);
  const auto group = T::join_process_group(env, "nccl", /*timeout_s=*/30, gpu);
  EXPECT_EQ(group->backend(), "nccl");
  auto on_gpu = torch::arange(6.0, torch::TensorOptions().device(gpu));
  group->sum(on_gpu);
  group->broadcast_from_main(on_gpu);
  EXPECT_TRUE(on_gpu.cpu().equal(torch::arange(6.0)));
  auto on_cpu = torch::tensor({1.5, 2.0, 0.0}, torch::kDouble);
  group->sum(on_cpu);
  EXPECT_TRUE(on_cpu.device().is_cpu());
  EXPECT_TRUE(on_cpu.equal(torch::tensor({1.5, 2.0, 0.0}, torch::kDouble)));
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  const auto gathered = group->gather_all(rng);
  ASSERT_EQ(gathered.size(), 1u);
  EXPECT_TRUE(gathered[0].device().is_cpu());
  EXPECT_TRUE(gathered[0].equal(rng));
  group->check_same_on_every_rank("flags", "--lr 0.1\n");
}

TEST_F(TrainTest, AttentionHeatmapIsAPng) {
  auto config = small_config();
  config.steps = 5;
  config.dump_attention = path("attention.png");
  run(config);
  std::ifstream png(path("attention.png"), std::ios::binary);
  std::string signature(8, '\0');
  png.read(signature.data(), 8);
  EXPECT_EQ(signature, std::string("\x89PNG\r\n\x1a\n", 8));
  expect_error_containing(
      [&] {
        T::write_attention_heatmap(path("missing_dir/x.png"), {torch::rand({1, 3, 3})},
                                   {"a", "b", "c"}, "t");
      },
      "--dump-attention: cannot open '" + path("missing_dir/x.png"));
  // A write the disk does not take (a file-size limit of 1 KB, as a full disk refuses it) is
  // an error naming the file, and leaves no partial image behind.
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &limit), 0);
  const auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // else the write kills us
  rlimit small = limit;
  small.rlim_cur = 1024;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::vector<std::string> labels(16, "x");
  bool refused = false;
  std::string message;
  try {
    T::write_attention_heatmap(path("big.png"), {torch::rand({2, 16, 16})}, labels, "t");
  } catch (const c10::Error& e) {
    refused = true;
    message = e.what_without_backtrace();
  }
  setrlimit(RLIMIT_FSIZE, &limit);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_TRUE(refused);
  EXPECT_NE(message.find("--dump-attention: writing '" + path("big.png") + "." +
                         std::to_string(::getpid()) + ".tmp' failed"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("failed (disk full?)"), std::string::npos) << message;
  EXPECT_FALSE(std::filesystem::exists(path("big.png")));
}

// A second signal ends the process at once (train/interrupts.h) and removes its own lock file
// on --save, never another run's: a run refused that path, or a rank that does not save, is
// stopped without taking the saving run's claim away.
TEST(TrainInterrupts, ASecondSignalRemovesOnlyALockThisProcessHolds) {
  const auto dir = fs::temp_directory_path() / ("attnkit_interrupts_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto path = (dir / "run.pt").string();
  const auto lock = path + ".lock";
  const auto stop_twice = [&] {
    T::install_stop_handlers(path, /*announce=*/false);
    std::raise(SIGINT);
    std::raise(SIGINT);
  };
  // Its own claim: the lock file goes with the process.
  EXPECT_EXIT(
      {
        T::SaveClaim claim(path);
        stop_twice();
      },
      ::testing::ExitedWithCode(130), "");
  EXPECT_FALSE(fs::exists(lock));

  // Another process holds the claim (a child, until told to let go): the lock file stays.
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    char byte = 1;
    {
      T::SaveClaim claim(path);
      if (::write(ready[1], &byte, 1) == 1 && ::read(release[0], &byte, 1) == 1) {
      }
    }
    ::_exit(0);
  }
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  EXPECT_EXIT(stop_twice(), ::testing::ExitedWithCode(130), "");
  EXPECT_TRUE(fs::exists(lock)) << "a second signal removed another process's lock file";
  ASSERT_EQ(::write(release[1], &byte, 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(holder, &status, 0), holder);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_FALSE(fs::exists(lock));  // removed by its holder as the claim ended
  for (const int descriptor : {ready[0], ready[1], release[0], release[1]})
    ::close(descriptor);
  fs::remove_all(dir);
}
