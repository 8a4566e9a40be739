// The training loop: setup, steps (forward and backward in shares on the CPU: batch_passes.cpp;
// gradients summed across ranks, AdamW on the flat buffer), evaluations with their
// checkpoints, and the report; the threads and ranks a step runs on. The configuration (and the
// model's config and memory check drawn from it) is run_config.cpp's, what a run writes besides
// checkpoints run_output.cpp's.

#include "trainer.h"

#include <fcntl.h>
#if AT_PARALLEL_OPENMP
#include <omp.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <thread>

#include "attnkit/memory_budget.h"
#include "attnkit/threads.h"
#include "batch_passes.h"
#include "checkpoint.h"
#include "core/base/checks.h"
#include "flat_adamw.h"
#include "gradient_sync.h"
#include "interrupts.h"
#include "line.h"
#include "mixed_precision.h"
#include "run_output.h"

namespace attnkit::train {

namespace {

// LibTorch on one thread while it lives (the BLAS is pinned by the caller). With OpenMP it
// sets the calling thread's OpenMP count, which at::get_num_threads() reads: LibTorch 1.13's
// at::set_num_threads also rebuilds a pthread pool each call, which cost 7-10% of a step.
class OneThread {
 public:
  OneThread() : saved_(at::get_num_threads()) { set(1); }
  ~OneThread() { set(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  static void set(int threads) {
#if AT_PARALLEL_OPENMP
    omp_set_num_threads(threads);
#else
    at::set_num_threads(threads);
#endif
  }
  int saved_;
};

// Ranks of this run on this machine: the launcher's count, else (not told) every rank.
int local_ranks(int world_size) {
  const auto environment = read_rank_environment();
  return environment.local_world_size > 0 ? environment.local_world_size : world_size;
}

// The threads a run uses: --threads, or for 0 the cores this process may run on, shared
// among the run's ranks on this machine.
int run_threads(const TrainConfig& c, int ranks_here) {
  if (c.threads > 0)
    return static_cast<int>(c.threads);
  return std::max(1, usable_cores() / std::max(1, ranks_here));
}

// Parts a training step's batch is cut into, each run on its own worker
// (forward_backward_in_shares): one per thread on the CPU; 1 on a GPU, and with dropout (its
// masks come from LibTorch's one CPU generator, which workers would draw from in no fixed
// order, so a seed would no longer repeat a run).
int64_t step_shares(const TrainConfig& c, const torch::Device& device, int threads) {
  if (!device.is_cpu() || c.model.dropout > 0)
    return 1;
  return std::min<int64_t>(threads, std::max<int64_t>(c.batch_size, 1));
}

// One call of train(): setup (the constructor), then steps, evaluations with their
// checkpoints, and the report.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& config, std::ostream& out, const std::atomic<bool>* stop,
              Collectives* ranks);
  TrainResult run();

 private:
  void print_setup();
  // One optimisation step: this rank's share of the batch forward and backward, the ranks'
  // gradients summed, the update, the running figures and the progress bar.
  void step(int64_t step);
  // The held-out evaluation (main rank), its metrics and line, and a checkpoint.
  void evaluate(int64_t step);
  void save(bool improved);
  // The final evaluation, metrics, summary, sample and heatmap (main rank).
  TrainResult report();
  bool stop_requested() const { return stop_ != nullptr && stop_->load(); }
  // The model that runs forward and backward: the 16-bit working copy with --dtype
  // bfloat16 | float16, else the float32 model the optimizer updates.
  AttentionModel& working_model() {
    return mixed_ && mixed_->has_working_copy() ? mixed_->model() : model_;
  }

  const TrainConfig& config_;
  std::ostream& out_;
  const std::atomic<bool>* stop_;
  const Clock::time_point wall_start_ = Clock::now();
  const torch::Device device_;
  const std::unique_ptr<Collectives> one_process_;
  Collectives& group_;
  const int rank_, world_size_;
  // --context-parallel: groups of context_ranks_ consecutive ranks share each sequence; the
  // groups are the data-parallel ranks (data_rank_ of data_ranks_).
  int context_ranks_ = 1, data_ranks_ = 1, data_rank_ = 0;
  std::unique_ptr<RankRange> context_group_;  // this rank's group; null without
  int threads_ = 1;
  int64_t shares_ = 1, eval_shares_ = 1;
  std::optional<attnkit::SingleThreadedBlas> blas_on_one_thread_;
  at::Generator data_generator_;
  std::unique_ptr<Task> task_;
  AttentionModel model_{nullptr};
  std::optional<FlatAdamW> optimizer_;
  std::optional<MixedPrecision> mixed_;
  std::vector<Batch> eval_batches_;
  bool text_ = false, main_rank_ = false, verbose_ = false;
  TrainingState state_;
  std::unique_ptr<GradientSync> gradient_sync_;
  std::optional<MetricsWriter> metrics_;
  std::optional<SaveClaim> save_claim_;  // the main rank's claim on --save
  TrainResult result_;
  double train_seconds_ = 0.0;
  int64_t tokens_ = 0;
  double smoothed_loss_ = 0.0, smoothed_accuracy_ = 0.0;
  int64_t first_step_ = 1;
  int64_t saved_step_ = 0;    // the step --save holds: this run's last, or the one resumed from
  bool stop_agreed_ = false;  // some rank was asked to stop during the last step
};

TrainingRun::TrainingRun(const TrainConfig& config, std::ostream& out,
                         const std::atomic<bool>* stop, Collectives* ranks)
    : config_(config),
      out_(out),
      stop_(stop),
      device_(resolve_device(config.device)),
      one_process_(single_process()),
      group_(ranks != nullptr ? *ranks : *one_process_),
      rank_(group_.rank()),
      world_size_(group_.world_size()) {
  group_.check_same_on_every_rank("flags", rank_agreement_text(config));
  check_context_parallel_ranks(config.context_parallel, world_size_);
  context_ranks_ = static_cast<int>(config.context_parallel);
  data_ranks_ = world_size_ / context_ranks_;
  data_rank_ = rank_ / context_ranks_;
  check_global_batch(config.batch_size, data_ranks_, context_ranks_);
  if (context_ranks_ > 1)
    context_group_ =
        std::make_unique<RankRange>(group_, data_rank_ * context_ranks_, context_ranks_);
  threads_ = run_threads(config, local_ranks(world_size_));
  attnkit::set_num_threads(threads_);
  // A context-parallel step is one sequence of transfers: no shares on worker threads.
  shares_ = context_group_ ? 1 : step_shares(config, device_, threads_);
  eval_shares_ = device_.is_cpu() ? threads_ : 1;  // no dropout there
  // With shares every BLAS call runs inside a worker, on one thread; pinned for the whole run
  // (evaluation and sampling too), so that no BLAS thread spins on a worker's core.
  if (device_.is_cpu() && threads_ > 1)
    blas_on_one_thread_.emplace();
  torch::manual_seed(config.seed);
  data_generator_ = at::detail::createCPUGenerator(config.seed);

  task_ = make_task(config.task, config.seq_len, config.seed, config.data, config.pack);
  const auto model_config = model_config_of(config, *task_);
  if (context_group_)
    check_context_parallel_length(config, task_->input_length());
  if (config.memory_budget_gb > 0)
    attnkit::set_memory_budget(static_cast<int64_t>(config.memory_budget_gb * 1e9));
  if (device_.is_cpu())
    check_run_memory(config, model_config, world_size_);
  model_ = AttentionModel(model_config);
  model_->to(device_);
  optimizer_.emplace(model_->parameters(), config.lr, config.weight_decay);
  // Each rank its own dropout stream; rank 0 keeps the one a single process has.
  if (rank_ > 0)
    torch::manual_seed(config.seed + static_cast<uint64_t>(rank_));
  eval_batches_ = task_->eval_batches(256);
  text_ = config.task == "text";
  main_rank_ = group_.is_main();
  verbose_ = !config.quiet && main_rank_;
  if (main_rank_)
    save_claim_.emplace(config.save);  // before any step: a second run on one --save is refused

  if (!config.resume.empty()) {
    state_ = load_checkpoint(config.resume, checkpoint_settings(config), model_, *optimizer_,
                             data_generator_, rank_);
    optimizer_->set_lr(config.lr);  // this run's --lr and --weight-decay
    optimizer_->set_weight_decay(config.weight_decay);
    std::error_code no_file;
    if (!config.save.empty() && std::filesystem::equivalent(config.resume, config.save, no_file)) {
      saved_step_ = state_.step;  // --save already holds the step this run resumed from
      run_progress().saved_step.store(saved_step_);
    }
    if (verbose_) {
      Line line(out);
      line << "resumed from " << config.resume << " at step " << state_.step;
      if (state_.dtype != config.dtype) {
        line << " (its steps ran in " << state_.dtype << "; this run continues in " << config.dtype
             << ")";
      }
      // The data stream may change on a resume, but not unsaid.
      for (const auto& [flag, value] : data_settings(config)) {
        for (const auto& [saved_flag, saved] : state_.data) {
          if (saved_flag == flag && saved != value) {
            line << "; it was trained with --" << flag << " " << saved << ", this run has --"
                 << flag << " " << value;
          }
        }
      }
      line << "\n";
    }
  }
  state_.dtype = config.dtype;
  state_.data = data_settings(config);
  group_.broadcast_from_main(optimizer_->flat_values());  // the same start on every rank
  const auto dtype = parse_train_dtype(config.dtype);
  if (dtype != torch::kFloat) {
    check_dtype_ranks(config.dtype, config.autocast, world_size_);
    if (config.autocast) {
      mixed_.emplace(model_, dtype);
    } else {
      // Building the working copy draws initial weights it then overwrites: the dropout
      // stream stays the one the float32 run (and a resumed one) has.
      auto generator = at::detail::getDefaultCPUGenerator();
      const auto dropout_stream = generator.get_state();
      mixed_.emplace(model_config_of(config, *task_), dtype, device_, optimizer_->flat_values());
      generator.set_state(dropout_stream);
    }
  }
  if (world_size_ > 1) {
    gradient_sync_ = std::make_unique<GradientSync>(
        model_->parameters(), optimizer_->flat_gradients(), group_,
        static_cast<int64_t>(std::llround(config.bucket_mb * (1 << 20))));
  }
  if (verbose_)
    print_setup();
  metrics_.emplace(main_rank_ ? config.metrics : std::string(), text_);
  result_.world_size = world_size_;
}

void TrainingRun::print_setup() {
  print_config_table(out_, config_, *task_);
  if (device_.is_cpu()) {
    // What really runs: LibTorch's threads, the BLAS's, and how a step uses them.
    Line line(out_);
    line << "threads: LibTorch " << torch::get_num_threads() << ", " << attnkit::blas_threads();
    if (shares_ > 1)
      line << "; each step's batch in " << shares_ << " shares, one per thread";
    else if (threads_ > 1)
      line << "; a step with dropout on 1 (its masks need one order of draws)";
    line << "\n";
  }
  if (context_group_) {
    Line(out_) << "context-parallel: each sequence of " << task_->input_length() << " tokens over "
               << context_ranks_ << " ranks (zigzag shards of "
               << task_->input_length() / context_ranks_ << "), attention over point-to-point "
               << "transfers\n";
  }
  if (world_size_ > 1) {
    const auto buckets = gradient_sync_->bucket_sizes();
    Line(out_) << "data-parallel: " << data_ranks_
               << (!context_group_    ? " ranks ("
                   : data_ranks_ == 1 ? " group of ranks ("
                                      : " groups of ranks (")
               << group_.backend() << "), " << config_.batch_size << " sequences per step in all, "
               << optimizer_->flat_gradients().numel() << " gradients summed in " << buckets.size()
               << (buckets.size() == 1 ? " allreduce after backward\n"
                                       : " buckets started during backward\n");
  }
}

void TrainingRun::save(bool improved) {
  if (config_.save.empty())
    return;
  // Every rank takes part in gathering the dropout streams; rank 0 writes.
  torch::Tensor cpu_rng_by_rank;
  if (world_size_ > 1) {
    cpu_rng_by_rank =
        torch::stack(group_.gather_all(at::detail::getDefaultCPUGenerator().get_state()));
  }
  if (main_rank_) {
    const CheckpointWrite writing;  // not cut short by a stop's grace period (interrupts.h)
    save_checkpoint(config_.save, checkpoint_settings(config_), model_, *optimizer_, state_,
                    data_generator_, cpu_rng_by_rank);
    if (improved) {
      save_checkpoint(best_checkpoint_path(config_.save), checkpoint_settings(config_), model_,
                      *optimizer_, state_, data_generator_, cpu_rng_by_rank);
    }
  }
  saved_step_ = state_.step;
  run_progress().saved_step.store(saved_step_);
}

void TrainingRun::step(int64_t step) {
  run_progress().step.store(step);
  const auto step_start = Clock::now();
  // Every rank draws the whole global batch from the shared stream and keeps its share.
  const auto batch = task_->train_batch(config_.batch_size, data_generator_);
  const auto share = part_of(batch, data_rank_, data_ranks_);
  // A step with dropout runs on one thread: one batch's ops at toy sizes are slower spread
  // over cores (0.6x at 2 threads here), and shares are not an option (step_shares).
  std::optional<OneThread> serial_step;
  if (shares_ == 1 && device_.is_cpu() && threads_ > 1)
    serial_step.emplace();
  auto& model = working_model();
  const double loss_scale = mixed_ ? mixed_->loss_scale() : 1.0;
  // The shares' gradients are summed into the optimizer's float32 buffer whatever --dtype is.
  // The whole batch's scored positions, which each rank's loss is a share of; one process's
  // step counts them itself (s.scored).
  const int64_t batch_scored = world_size_ > 1 ? batch.loss_mask.sum().item<int64_t>() : 0;
  BatchScore s;
  if (context_group_) {
    // The forward inside the scope; its backward (below) exchanges through the group.
    const attnkit::ContextParallelScope scope(*context_group_, task_->input_length());
    s = score(model, sequence_shard(share, scope.shards(), context_group_->rank()), device_,
              config_.progress_bar, /*divide_by=*/std::max<int64_t>(batch_scored, 1));
  } else if (shares_ > 1) {
    s = forward_backward_in_shares(model, share, device_, config_.progress_bar, shares_,
                                   optimizer_->flat_gradients(), loss_scale);
  } else {
    s = score(model, share, device_, /*count_correct=*/config_.progress_bar);
  }
  // This rank's part of the mean over the whole batch's scored positions: the parts'
  // gradients then sum to the whole batch's.
  const auto loss_part =
      world_size_ == 1 || context_group_
          ? s.loss
          : s.loss * (static_cast<double>(s.scored) / std::max<int64_t>(batch_scored, 1));
  const int64_t scored = world_size_ > 1 ? batch_scored : s.scored;
  double loss = loss_part.item<double>();
  double correct = static_cast<double>(s.correct);
  if (world_size_ > 1) {
    // One small collective: the batch's loss and correct count, and whether to stop.
    auto totals = torch::tensor({loss, correct, stop_requested() ? 1.0 : 0.0}, torch::kDouble);
    group_.sum(totals);
    loss = totals[0].item<double>();
    correct = totals[1].item<double>();
    stop_agreed_ = totals[2].item<double>() > 0;
  }
  if (!std::isfinite(loss)) {
    throw NonFiniteLoss(non_finite_message("loss", loss, step, config_, saved_step_));
  }
  if (shares_ == 1) {  // else forward_backward_in_shares has written the gradients
    if (!mixed_ || !mixed_->has_working_copy())
      optimizer_->zero_grad();  // the working copy's are zeroed as they are taken
    if (gradient_sync_)
      gradient_sync_->before_backward();
    (loss_scale == 1.0 ? loss_part : loss_part * loss_scale).backward();
    if (mixed_)
      mixed_->move_gradients_into(optimizer_->flat_gradients());
  } else if (gradient_sync_) {
    gradient_sync_->before_backward();  // no hook fires now: after_backward sums every bucket
  }
  if (gradient_sync_)
    result_.allreduce_seconds += gradient_sync_->after_backward();  // what backward did not hide
  // A 16-bit step whose gradients overflowed changes nothing (mixed_precision.h).
  if (!mixed_ || mixed_->unscale(optimizer_->flat_gradients())) {
    optimizer_->clip_grad_norm(config_.clip_norm);
    optimizer_->step();
    if (mixed_)
      mixed_->copy_weights_from(optimizer_->flat_values());
  }
  serial_step.reset();
  state_.step = step;
  train_seconds_ += seconds_since(step_start);
  tokens_ += batch.inputs.numel();
  result_.losses.push_back(loss);
  smoothed_loss_ = step == first_step_ ? loss : 0.95 * smoothed_loss_ + 0.05 * loss;
  const double accuracy = scored ? correct / static_cast<double>(scored) : 0.0;
  smoothed_accuracy_ = step == first_step_ ? accuracy : 0.95 * smoothed_accuracy_ + 0.05 * accuracy;
  if (verbose_ && config_.progress_bar) {
    const double eta = train_seconds_ / (step - first_step_ + 1) * (config_.steps - step);
    draw_progress(out_, step, config_.steps, smoothed_loss_, smoothed_accuracy_, text_,
                  tokens_ / std::max(train_seconds_, 1e-9), eta);
  }
}

void TrainingRun::evaluate(int64_t step) {
  bool improved = false;
  if (main_rank_) {
    const auto evaluation =
        ::attnkit::train::evaluate(working_model(), eval_batches_, device_, eval_shares_);
    if (!std::isfinite(evaluation.loss)) {
      // The update broke the weights: stop before they overwrite a good checkpoint.
      throw NonFiniteLoss(
          non_finite_message("held-out loss", evaluation.loss, step, config_, saved_step_));
    }
    improved = evaluation.loss < state_.best_loss;
    if (improved)
      state_.best_loss = evaluation.loss;
    const double tokens_per_s = tokens_ / std::max(train_seconds_, 1e-9);
    metrics_->write(step, evaluation, smoothed_loss_, tokens_per_s, seconds_since(wall_start_),
                    /*final=*/false);
    if (verbose_) {
      Line(out_) << (config_.progress_bar ? "\n" : "") << "step " << step << "/" << config_.steps
                 << " | train loss " << std::fixed << std::setprecision(4) << smoothed_loss_
                 << " | " << format_eval(evaluation, text_) << " | " << std::setprecision(0)
                 << tokens_per_s << " tok/s\n";
    }
  }
  save(improved);
}

TrainResult TrainingRun::run() {
  working_model()->train();
  first_step_ = state_.step + 1;
  for (int64_t step = first_step_; step <= config_.steps; ++step) {
    if (world_size_ == 1 ? stop_requested() : stop_agreed_) {
      result_.interrupted = true;
      break;
    }
    this->step(step);
    if (step % config_.eval_every == 0 || step == config_.steps)
      evaluate(step);
  }
  if (result_.interrupted)
    save(/*improved=*/false);
  return report();
}

TrainResult TrainingRun::report() {
  auto& result = result_;
  result.last_step = state_.step;
  result.evaluated = std::isfinite(state_.best_loss);
  result.train_seconds = train_seconds_;
  result.tokens_per_second = tokens_ / std::max(train_seconds_, 1e-9);
  if (!main_rank_)
    return result;
  result.skipped_steps = mixed_ ? mixed_->skipped_steps() : 0;
  result.final_evaluation =
      ::attnkit::train::evaluate(working_model(), eval_batches_, device_, eval_shares_);
  result.wall_seconds = seconds_since(wall_start_);
  metrics_->write(state_.step, result.final_evaluation, smoothed_loss_, result.tokens_per_second,
                  result.wall_seconds, /*final=*/true);
  {
    Line summary(out_);  // the summary, baselines and sample in one write
    summary << (result.interrupted ? "interrupted" : "done") << " after step " << state_.step
            << ": " << format_eval(result.final_evaluation, text_) << " | " << std::fixed
            << std::setprecision(1) << result.wall_seconds << " s wall, " << std::setprecision(0)
            << result.tokens_per_second << " tokens/s";
    if (world_size_ > 1) {
      summary << " on " << world_size_ << " ranks, gradient allreduce " << std::setprecision(1)
              << 100.0 * result.allreduce_seconds / std::max(train_seconds_, 1e-9)
              << "% of the steps";
    }
    if (result.skipped_steps > 0) {
      summary << ", " << result.skipped_steps << " step(s) skipped for non-finite " << config_.dtype
              << " gradients";
    }
    summary << "\n";
    if (text_) {
      summary << std::setprecision(2) << "corpus baselines: unigram " << task_->unigram_entropy()
              << ", bigram " << task_->bigram_entropy() << " bits/byte; model "
              << result.final_evaluation.bits_per_byte << " ("
              << task_->bigram_entropy() - result.final_evaluation.bits_per_byte
              << " below bigram)\n";
      if (config_.sample > 0 && config_.prompts.empty()) {
        summary << sample_text(working_model(), *task_, device_, config_) << "\n";
      } else if (config_.sample > 0) {
        summary << sample_prompts(working_model(), device_, config_) << "\n";
      }
    }
  }
  if (!config_.dump_attention.empty()) {
    dump_attention(config_.dump_attention, model_, *task_, device_);
    if (verbose_)
      Line(out_) << "attention heatmap written to " << config_.dump_attention << "\n";
  }
  return result;
}

}  // namespace

TrainResult train(const TrainConfig& config, std::ostream& out, const std::atomic<bool>* stop,
                  Collectives* ranks) {
  return TrainingRun(config, out, stop, ranks).run();
}

}  // namespace attnkit::train
