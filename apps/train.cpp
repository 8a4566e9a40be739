// attnkit-train: fits an attnkit attention module on a toy sequence task, on CPU or CUDA.
// A thin front on the attnkit_train library (src/train/): flags, signals, exit codes.
//
// Exit codes: 0 done, 1 training failed (loss became NaN/Inf, or a rank of a data-parallel
// run was lost), 2 bad usage or input, 130 interrupted by SIGINT/SIGTERM: after the step,
// saving with --save; a step that has not ended 3 s after the signal, or a second signal, ends
// the run at once and keeps the last checkpoint (src/train/interrupts.h).

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "attnkit/version.h"
#include "command_line.h"
#include "train/checkpoint.h"
#include "train/interrupts.h"
#include "train/launcher.h"
#include "train/line.h"
#include "train/tasks.h"
#include "train/trainer.h"

namespace {

attnkit::cli::CommandLine make_command_line() {
  attnkit::cli::CommandLine cli("attnkit-train",
                                "Fit an attnkit attention module on a toy sequence task and report "
                                "held-out accuracy (or bits per byte for text).");
  cli.value("Task", "task",
            "copy (causal): tokens, separator, the same tokens again | reverse "
            "(bidirectional): output i is input n-1-i | recall (causal): key-value pairs "
            "then a key, predict its value | text (causal): next byte of --data",
            "copy")
      .value("Task", "seq-len",
             "task size: tokens to copy/reverse (8), pairs to recall (4), bytes of "
             "context for text (64); 0 = the task's default",
             "0")
      .value("Task", "data", "text task: the corpus (first 90% train, rest held out)",
             "data/the-verdict.txt")
      .flag("Task", "pack",
            "text task: treat each paragraph (ended by a blank line) as a document and train on "
            "rows packed with them; a byte attends only within its document (Mask::documents), "
            "positions restart at each one, and a document's first byte is not scored. Needs "
            "mha, mha-combined, gqa, mqa or mla")
      .value("Task", "sample",
             "text task: after training, generate N bytes from a held-out prompt and print "
             "them with the tokens/s",
             "0")
      .value("Task", "prompts",
             "text task, with --sample N: continue each non-empty line of FILE by N bytes, "
             "all lines decoded together in one batch (prompts of different lengths, each at "
             "its own positions)",
             "")
      .flag("Task", "no-kv-cache",
            "generate --sample by recomputing the sequence for every byte, not with KV "
            "caches (needed for modules without one: sa-v1, sa-v2, causal, mha-wrapper)");
  cli.value("Model", "module",
            "attention: sa-v1 | sa-v2 (no mask: bidirectional tasks) | causal | "
            "mha-wrapper (causal tasks) | mha | mha-combined (either) | gqa (grouped-query) | "
            "mqa (multi-query) | mla (multi-head latent; the last three causal tasks)",
            "mha")
      .value("Model", "backend",
             "mha, mha-combined, gqa, mqa, mla: math (the book's path) | fused (one kernel per "
             "head on CPU for short sequences) | chunked (memory-efficient)",
             "fused")
      .value("Model", "kv-groups",
             "gqa: key/value heads, shared by heads / kv-groups query heads each; 0 = 2", "0")
      .value("Model", "window",
             "mha, mha-combined, gqa, mqa: sliding window W, each token attends to itself and "
             "the W - 1 before it; 0 = full causal attention",
             "0")
      .value("Model", "latent-dim",
             "mla: width of the latent that the KV cache holds; 0 = max(16, d-model / 8)", "0")
      .value("Model", "d-model", "embedding width", "64")
      .value("Model", "heads", "attention heads (every module but sa-v1, sa-v2, causal)", "4")
      .value("Model", "layers", "attention blocks; 0 = 2 for recall and text, 1 otherwise", "0")
      .flag("Model", "ffn", "add a feed-forward block after each attention")
      .flag("Model", "rope",
            "mha, mha-combined, gqa, mqa: rotary position embeddings in the attention "
            "(Llama's split-half layout, theta 10000) instead of a position embedding table")
      .flag("Model", "qk-norm",
            "mha, mha-combined, gqa, mqa: RMSNorm of each head's queries and keys before "
            "attention (Qwen3, Gemma 3)")
      .value("Model", "dropout", "dropout on attention weights (and the feed-forward block)", "0");
  cli.value("Training", "steps",
            "training steps; 0 = the task's default (text 500, the others 600)", "0")
      .value("Training", "batch-size", "sequences per step (the global batch with --nproc)", "64")
      .value("Training", "lr", "AdamW learning rate", "0.003")
      .value("Training", "weight-decay", "AdamW weight decay", "0.01")
      .value("Training", "seed", "seed for weights, data and dropout", "1")
      .value("Training", "memory-budget",
             "GB the run may plan for: a run whose model and batch need more (a lower bound, "
             "checked before step 1) is refused at once, as are attention calls and modules "
             "whose n^2 tensors would exceed it; 0 = half of physical memory",
             "0")
      .value("Training", "dtype",
             "float32 | bfloat16 | float16: the dtype of forward and backward; the weights "
             "and AdamW state stay float32 (mixed precision), float16 with dynamic loss "
             "scaling (float16 on the CPU needs LibTorch 2.x)",
             "float32")
      .flag("Training", "autocast",
            "with --dtype bfloat16 | float16: no 16-bit working copy; the float32 model's "
            "forward runs under LibTorch's autocast in that dtype (linear layers), and "
            "--nproc works with it")
      .value("Training", "device", "auto | cpu | cuda | cuda:N (auto = CUDA when available)",
             "auto")
      .value("Training", "threads",
             "CPU threads: each step's batch is cut into this many shares, trained at once, "
             "one per thread (with --dropout a step runs on one); 0 = the cores this process "
             "may use, shared among this machine's ranks; more than those cores is refused",
             "0")
      .value("Training", "eval-every", "steps between held-out evaluations; 0 = steps / 10", "0")
      .value("Training", "resume",
             "continue from a checkpoint written with --save (same task and model flags)");
  cli.value("Data-parallel", "nproc",
            "start N ranks of one data-parallel run on this machine (c10d over loopback); "
            "--batch-size stays the global batch. Processes started by another launcher "
            "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set) join that run "
            "without it",
            "1")
      .value("Data-parallel", "dist-backend",
             "auto | gloo | nccl: gloo reduces in host memory (any device; CUDA tensors are "
             "copied), nccl on the GPUs (CUDA builds with NCCL; one GPU per rank); auto = nccl "
             "for --device cuda where built with it, else gloo",
             "auto")
      .value("Data-parallel", "dist-timeout",
             "seconds a rank waits for the others: for all of them to join the run, and in "
             "each collective (a rank that waits longer ends the run with an error)",
             "60")
      .value("Data-parallel", "bucket-mb",
             "0 = one allreduce of all gradients after backward; else buckets of this many MB "
             "whose allreduce starts while backward still runs",
             "0")
      .value("Data-parallel", "context-parallel",
             "R ranks share each sequence (context parallelism): each holds 1/R of its tokens "
             "(zigzag shards) and attention exchanges keys and values point to point; --nproc "
             "must be a multiple of R (the rest is data-parallel). CPU, --dropout 0, a module "
             "with masks, sequences that divide into 2R chunks",
             "1");
  cli.value("Output", "save",
            "checkpoint path: latest state there, best held-out loss at NAME.best.EXT; one run "
            "at a time per path")
      .value("Output", "metrics",
             "write one line per evaluation: JSON Lines, or CSV if the name ends in .csv")
      .value("Output", "dump-attention",
             "after training, write a PNG heatmap of every head's attention on a held-out "
             "example")
      .flag("Output", "quiet", "print only the final report")
      .flag("Output", "h,help", "show this help")
      .flag("Output", "version", "print the version");
  cli.example("attnkit-train --task reverse --module sa-v2 --dump-attention reverse.png",
              "a bidirectional task, and a heatmap of what the model attends to")
      .example("attnkit-train --task text --ffn --nproc 2 --save run.pt --sample 200",
               "two data-parallel ranks on the text task; a checkpoint; 200 sampled bytes")
      .example("attnkit-train --task text --rope --seq-len 256 --nproc 2 --context-parallel 2",
               "each sequence split over two ranks (context parallelism)");
  return cli;
}

// Every training step frees and reallocates the same few hundred KB tensors. By default glibc
// serves blocks that size with mmap or hands freed heap back to the system, so each step
// page-faults about a thousand fresh pages (perf stat: ~1000 page faults per step of the
// default copy run). Keeping freed memory in the heap for reuse removes those faults.
void keep_freed_memory_for_reuse() {
#ifdef __GLIBC__
  mallopt(M_MMAP_THRESHOLD, 256 << 20);  // blocks below 256 MiB come from the heap
  mallopt(M_TRIM_THRESHOLD, 1 << 30);    // and up to 1 GiB of freed heap is kept
#endif
}

std::string g_error_prefix = "attnkit-train: ";  // "attnkit-train: rank R: " in a group

int fail(const std::string& message, int code = 2) {
  attnkit::train::Line(std::cerr) << g_error_prefix << message << "\n";
  return code;
}

// The arguments for the ranks that --nproc starts: these, without --nproc.
std::vector<std::string> rank_arguments(int argc, char** argv) {
  std::vector<std::string> arguments;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--nproc") {
      ++i;  // and its value
    } else if (word.rfind("--nproc=", 0) != 0) {
      arguments.push_back(word);
    }
  }
  return arguments;
}

}  // namespace

int main(int argc, char** argv) {
  namespace T = attnkit::train;
  auto cli = make_command_line();
  T::TrainConfig config;
  int64_t nproc = 1, dist_timeout_s = 60;
  try {
    cli.parse(argc, argv);
    if (cli.given("help")) {
      T::Line(std::cout) << cli.help() << "\n";
      return 0;
    }
    if (cli.given("version")) {
      T::Line(std::cout) << "attnkit-train " << ATTNKIT_VERSION << "\n";
      return 0;
    }
    config.task = cli.text("task");
    config.seq_len = cli.integer("seq-len");
    config.data = cli.text("data");
    config.pack = cli.given("pack");
    config.sample = cli.integer("sample");
    config.kv_cache = !cli.given("no-kv-cache");
    config.prompts = cli.text("prompts");
    config.model.module = cli.text("module");
    // Given explicitly only: the other modules have no backend, so the default is not theirs.
    if (cli.given("backend"))
      config.model.backend = cli.text("backend");
    config.model.kv_groups = cli.integer("kv-groups");
    config.model.window = cli.integer("window");
    config.model.latent_dim = cli.integer("latent-dim");
    config.model.rope = cli.given("rope");
    config.model.qk_norm = cli.given("qk-norm");
    config.model.d_model = cli.integer("d-model");
    config.model.heads = cli.integer("heads");
    config.model.layers = cli.integer("layers");
    config.model.ffn = cli.given("ffn");
    config.model.dropout = cli.number("dropout");
    config.steps = cli.integer("steps");
    config.batch_size = cli.integer("batch-size");
    config.lr = cli.number("lr");
    config.memory_budget_gb = cli.number("memory-budget");
    config.weight_decay = cli.number("weight-decay");
    config.seed = cli.unsigned_integer("seed");
    config.dtype = cli.text("dtype");
    config.autocast = cli.given("autocast");
    config.device = cli.text("device");
    config.threads = cli.integer("threads");
    config.eval_every = cli.integer("eval-every");
    config.save = cli.text("save");
    config.resume = cli.text("resume");
    config.metrics = cli.text("metrics");
    config.dump_attention = cli.text("dump-attention");
    config.dist_backend = cli.text("dist-backend");
    config.bucket_mb = cli.number("bucket-mb");
    config.context_parallel = cli.integer("context-parallel");
    nproc = cli.integer("nproc");
    dist_timeout_s = cli.integer("dist-timeout");
    config.quiet = cli.given("quiet");
    config.progress_bar = ::isatty(STDOUT_FILENO) == 1;
  } catch (const attnkit::cli::UsageError& e) {
    return fail(e.what());
  }

  std::unique_ptr<T::Collectives> ranks;
  const std::atomic<bool>* stop_requested = nullptr;
  try {
    const std::string requested_backend = config.dist_backend;
    config = T::resolve(config);
    // From here a stop request lets the step finish, within a grace period (a rank also while
    // it joins its group); a second one ends the run at once. A data-parallel run's rank 0
    // speaks for the run.
    const char* rank = std::getenv("RANK");
    stop_requested =
        T::install_stop_handlers(config.save, rank == nullptr || std::string(rank) == "0");
    TORCH_CHECK(nproc >= 1, "--nproc: expected >= 1, got ", nproc);
    TORCH_CHECK(dist_timeout_s >= 1 && dist_timeout_s <= 86400,
                "--dist-timeout: expected 1..86400 seconds, got ", dist_timeout_s);
    if (nproc > 1) {
      const char* world_size = std::getenv("WORLD_SIZE");
      TORCH_CHECK(world_size == nullptr, "--nproc ", nproc, " with WORLD_SIZE set (", world_size,
                  "): this process is a rank of another launcher's run; drop one of them");
      T::check_context_parallel_ranks(config.context_parallel, static_cast<int>(nproc));
      if (config.context_parallel > 1) {  // once here, not once per rank
        const auto task =
            T::make_task(config.task, config.seq_len, config.seed, config.data, config.pack);
        T::check_context_parallel_length(config, task->input_length());
      }
      T::check_global_batch(config.batch_size, static_cast<int>(nproc / config.context_parallel),
                            config.context_parallel);
      T::check_dtype_ranks(config.dtype, config.autocast, static_cast<int>(nproc));
      return T::launch_local_ranks(static_cast<int>(nproc), rank_arguments(argc, argv), std::cerr);
    }
    const auto environment = T::read_rank_environment();
    if (environment.world_size > 1) {
      g_error_prefix = c10::str("attnkit-train: rank ", environment.rank, ": ");
      const auto requested_device = T::resolve_device(config.device);
      config.dist_backend =
          T::choose_dist_backend(requested_backend, requested_device, environment);
      // Plain `cuda`: this rank's own GPU, LOCAL_RANK.
      const auto device = T::rank_device(requested_device, environment, config.dist_backend);
      config.device = device.str();
      ranks = T::join_process_group(environment, config.dist_backend,
                                    static_cast<int>(dist_timeout_s), device);
    }
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  }

  keep_freed_memory_for_reuse();
  try {
    const auto result = T::train(config, std::cout, stop_requested, ranks.get());
    T::run_progress().ended.store(true);
    if (result.interrupted) {
      if (ranks == nullptr || ranks->is_main()) {
        T::Line line(std::cerr);
        line << "attnkit-train: interrupted at step " << result.last_step
             << (config.save.empty() ? " (no --save given, nothing saved)"
                                     : "; saved to " + config.save);
        // The best checkpoint is the best held-out loss's: none before the first evaluation.
        if (!config.save.empty() && !result.evaluated) {
          line << " (no held-out evaluation ran yet, so there is no "
               << T::best_checkpoint_path(config.save) << ")";
        }
        line << "\n";
      }
      return 130;
    }
    // A report that did not reach standard output (a full disk) is not a success.
    std::cout.flush();
    if (!std::cout)
      return fail("writing the report to standard output failed (is the disk full?)", 1);
    return 0;
  } catch (const T::NonFiniteLoss& e) {
    return fail(e.what(), 1);
  } catch (const T::RankLost& e) {
    return fail(e.what(), 1);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
