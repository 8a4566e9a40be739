#include "checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/base/checks.h"
#include "interrupts.h"

namespace attnkit::train {

namespace {

torch::Tensor text_tensor(const std::string& text) {
  auto tensor = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  if (!text.empty())
    std::memcpy(tensor.data_ptr(), text.data(), text.size());
  return tensor;
}

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

// Typed access to a checkpoint's entries: a missing key or a wrong dtype or shape is one
// clear error naming the file and the key.
class Entries {
 public:
  Entries(const StateDict& dict, const std::string& path) : dict_(dict), path_(path) {}

  const torch::Tensor& get(const std::string& key, torch::ScalarType dtype, int64_t dim) const {
    const auto* tensor = dict_.find(key);
    TORCH_CHECK(tensor != nullptr, "--resume: '", path_,
                "' is not an attnkit-train checkpoint (it has no '", key, "')");
    TORCH_CHECK(tensor->scalar_type() == dtype && tensor->dim() == dim, "--resume: '", path_,
                "' is damaged: '", key, "' is a ", tensor->scalar_type(), " tensor of shape ",
                tensor->sizes(), ", expected ", dtype, " with ", dim, " dimension(s)");
    return *tensor;
  }
  bool has(const std::string& key) const { return dict_.find(key) != nullptr; }
  int64_t integer(const std::string& key) const {
    return get(key, torch::kLong, 0).item<int64_t>();
  }
  std::string text(const std::string& key) const {
    const auto tensor = get(key, torch::kUInt8, 1).contiguous();
    return std::string(static_cast<const char*>(tensor.data_ptr()),
                       static_cast<size_t>(tensor.numel()));
  }
  // Every entry under "prefix.", without the prefix.
  StateDict under(const std::string& prefix) const {
    StateDict part;
    for (const auto& item : dict_) {
      if (item.key().rfind(prefix, 0) == 0)
        part.insert(item.key().substr(prefix.size()), item.value());
    }
    return part;
  }

 private:
  const StateDict& dict_;
  const std::string& path_;
};

}  // namespace

std::string best_checkpoint_path(const std::string& save_path) {
  const auto dot = save_path.rfind('.');
  const auto slash = save_path.rfind('/');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) {
    return save_path + ".best";
  }
  return save_path.substr(0, dot) + ".best" + save_path.substr(dot);
}

SaveClaim::SaveClaim(const std::string& path) {
  if (path.empty())
    return;
  const auto lock_path = path + ".lock";
  descriptor_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(descriptor_ >= 0, "--save: cannot create the lock file '", lock_path,
              "' (does its directory exist?)");
  if (::flock(descriptor_, LOCK_EX | LOCK_NB) != 0) {
    char owner[32] = {};
    const auto count = ::read(descriptor_, owner, sizeof(owner) - 1);
    ::close(descriptor_);
    descriptor_ = -1;
    TORCH_CHECK(false, "--save: '", path, "' is being written by another attnkit-train run",
                count > 0 ? c10::str(" (process ", std::string(owner, count), ")") : std::string(),
                "; wait for it to end or give another --save path");
  }
  const auto id = std::to_string(::getpid());
  if (::ftruncate(descriptor_, 0) != 0 ||
      ::write(descriptor_, id.data(), id.size()) != static_cast<ssize_t>(id.size())) {
    // The lock holds without the id; only a refused second run's message lacks it.
  }
  lock_path_ = lock_path;
  run_progress().holds_save_lock.store(true);
}

SaveClaim::~SaveClaim() {
  if (descriptor_ < 0)
    return;
  run_progress().holds_save_lock.store(false);
  // Removed while still held: no other run can have claimed this file meanwhile.
  ::unlink(lock_path_.c_str());
  ::close(descriptor_);
}

void save_checkpoint(const std::string& path, const CheckpointSettings& settings,
                     AttentionModel& model, const FlatAdamW& optimizer, const TrainingState& state,
                     const at::Generator& data_generator, const torch::Tensor& cpu_rng_by_rank) {
  StateDict dict;
  dict.insert("format", torch::tensor(kCheckpointFormat, torch::kLong));
  for (const auto& [flag, value] : settings)
    dict.insert("settings." + flag, text_tensor(value));
  dict.insert("step", torch::tensor(state.step, torch::kLong));
  dict.insert("best_loss", torch::tensor(state.best_loss, torch::kDouble));
  dict.insert("dtype", text_tensor(state.dtype));
  for (const auto& [flag, value] : state.data)
    dict.insert("data." + flag, text_tensor(value));
  dict.insert("data_rng", data_generator.get_state());
  dict.insert("cpu_rng", at::detail::getDefaultCPUGenerator().get_state());
  if (cpu_rng_by_rank.defined())
    dict.insert("cpu_rng_by_rank", cpu_rng_by_rank);
  for (const auto& item : state_dict(*model))
    dict.insert("model." + item.key(), item.value());
  optimizer.save(dict, "optimizer.");
  // Beside the file it replaces (a symlink's target), synced to disk, then renamed over it: a
  // crash leaves the old checkpoint intact (write_atomically).
  write_state_dict(dict, path);
}

TrainingState restore_checkpoint(const StateDict& dict, const std::string& path,
                                 const CheckpointSettings& settings, AttentionModel& model,
                                 FlatAdamW& optimizer, at::Generator& data_generator, int rank) {
  const Entries entries(dict, path);
  const int64_t format = entries.integer("format");
  TORCH_CHECK(format == kCheckpointFormat, "--resume: '", path, "' has checkpoint format ", format,
              ", expected ", kCheckpointFormat);
  // Name the first setting that differs. A yes/no setting the checkpoint lacks was off (it
  // was written before that flag existed).
  for (const auto& [flag, value] : settings) {
    const std::string key = "settings." + flag;
    const bool yes_no = value == "true" || value == "false";
    const std::string saved = yes_no && !entries.has(key) ? "false" : entries.text(key);
    TORCH_CHECK(saved == value, "--resume: incompatible checkpoint '", path,
                "': it was trained with --", flag, " ", saved, ", this run has --", flag, " ",
                value);
  }
  TrainingState state;
  state.step = entries.integer("step");
  TORCH_CHECK(state.step >= 0, "--resume: '", path, "' is damaged: step ", state.step);
  state.best_loss = entries.get("best_loss", torch::kDouble, 0).item<double>();
  if (entries.has("dtype"))
    state.dtype = entries.text("dtype");
  for (const auto& item : dict) {
    const auto& key = item.key();
    if (key.rfind("data.", 0) == 0)
      state.data.emplace_back(key.substr(5), entries.text(key));
  }
  const auto data_rng = entries.get("data_rng", torch::kUInt8, 1);
  auto own_rng = rank == 0 ? entries.get("cpu_rng", torch::kUInt8, 1) : torch::Tensor();
  if (rank > 0 && entries.has("cpu_rng_by_rank")) {
    const auto& by_rank = entries.get("cpu_rng_by_rank", torch::kUInt8, 2);
    // A tensor of its own: LibTorch 2.11's CPUGeneratorImpl::set_state crashed (SIGSEGV) on
    // a row that is a view into the stacked states (1.13 and 2.6 did not).
    if (by_rank.size(0) > rank)
      own_rng = by_rank[rank].clone();
  }
  try {
    load_state_dict(*model, entries.under("model."), /*strict=*/true);
    optimizer.load(dict, "optimizer.");
    // Generators check their state's size; a wrong one is a c10::Error.
    data_generator.set_state(data_rng.contiguous());
    if (own_rng.defined()) {
      auto default_generator = at::detail::getDefaultCPUGenerator();  // shares the state
      default_generator.set_state(own_rng.contiguous());
    }
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "--resume: '", path, "' does not fit this run (",
                first_line(e.what_without_backtrace()), ")");
  }
  return state;
}

TrainingState load_checkpoint(const std::string& path, const CheckpointSettings& settings,
                              AttentionModel& model, FlatAdamW& optimizer,
                              at::Generator& data_generator, int rank) {
  attnkit::detail::check_not_directory("--resume", path);
  TORCH_CHECK(std::ifstream(path).good(), "--resume: cannot read '", path, "'");
  StateDict dict;
  try {
    dict = read_state_dict(path);
  } catch (const c10::Error& e) {
    std::string reason = first_line(e.what_without_backtrace());
    const std::string prefix = "[read_state_dict] '" + path + "' ";
    if (reason.rfind(prefix, 0) == 0)
      reason = reason.substr(prefix.size());
    TORCH_CHECK(false, "--resume: '", path, "' is not an attnkit-train checkpoint: ", reason);
  }
  return restore_checkpoint(dict, path, settings, model, optimizer, data_generator, rank);
}

}  // namespace attnkit::train
