#pragma once

// Data-parallel attnkit-train: the ranks' process group on LibTorch's c10d (Gloo, or NCCL on
// GPUs where the build has it), rendezvous through a c10d TCPStore at
// MASTER_ADDR:MASTER_PORT, as torchrun sets it up.
// The trainer sees only `Collectives`; a single process gets one whose operations do
// nothing, so its path has no communication in it. The library `attnkit` knows nothing of
// this: only attnkit_train (src/train/) links c10d.

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "attnkit/context_parallel.h"

namespace attnkit::train {

/// Where this process sits in a run: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT.
struct RankEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  /// Ranks on this machine; 0 when the launcher does not say (torchrun and --nproc do).
  int local_world_size = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  /// Whether WORLD_SIZE was set at all (a launcher started this process).
  bool launched = false;
};

/// Reads the launcher's variables through `lookup` (getenv by default). No WORLD_SIZE: one
/// process. A bad or incomplete set (WORLD_SIZE without RANK, RANK out of range, a port
/// that is not 1..65535, ...) is a c10::Error naming the variable and the value.
RankEnvironment read_rank_environment(
    const std::function<const char*(const char*)>& lookup = nullptr);

/// A collective failed: a rank died, or stopped answering for longer than the timeout.
struct RankLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The collective operations the trainer needs, over all ranks, in place, and the transfers
/// of a context-parallel call (attnkit::ShardExchange: rank(), world_size(),
/// start_send_receive()).
class Collectives : public attnkit::ShardExchange {
 public:
  bool is_main() const { return rank() == 0; }
  /// "none" for one process, else the c10d backend ("gloo" or "nccl").
  virtual std::string backend() const = 0;
  /// Every rank's `tensor` becomes rank 0's.
  virtual void broadcast_from_main(torch::Tensor& tensor) = 0;
  /// Every rank's `tensor` becomes the element-wise sum over the ranks.
  void sum(torch::Tensor& tensor) { start_sum(tensor)(); }
  /// Starts that sum and returns at once; the sum is in `tensor` when the returned function
  /// (which waits for it) returns. Every rank must start its collectives in the same order.
  virtual std::function<void()> start_sum(torch::Tensor& tensor) = 0;
  /// Every rank's tensor of the same shape, in rank order (for one process: {tensor}).
  virtual std::vector<torch::Tensor> gather_all(const torch::Tensor& tensor) = 0;
  /// Fails (c10::Error) on every rank unless every rank passed the same `text`; the message
  /// names `what` and the first rank and line that differ.
  virtual void check_same_on_every_rank(const std::string& what, const std::string& text) = 0;
};

/// Ranks [first, first + size) of `group`, numbered from 0: the transfers of one
/// context-parallel group inside a larger run (attnkit-train --context-parallel).
class RankRange : public attnkit::ShardExchange {
 public:
  RankRange(Collectives& group, int first, int size);
  int rank() const override { return group_.rank() - first_; }
  int world_size() const override { return size_; }
  std::function<void()> start_send_receive(const std::vector<torch::Tensor>& send, int to,
                                           std::vector<torch::Tensor>& receive, int from) override {
    return group_.start_send_receive(send, first_ + to, receive, first_ + from);
  }

 private:
  Collectives& group_;
  int first_, size_;
};

/// One process: every operation leaves its arguments as they are.
std::unique_ptr<Collectives> single_process();

/// Whether this build has c10d's NCCL backend (a CUDA LibTorch, nccl.h found by CMake).
bool nccl_available();

/// --dist-backend's value for a rank training on `device`: "auto" is nccl where the build has
/// it, the device is a GPU and this machine has a GPU for each of its ranks, else gloo;
/// "gloo" and "nccl" are kept; anything else fails naming the flag.
std::string choose_dist_backend(const std::string& requested, const torch::Device& device,
                                const RankEnvironment& environment);

/// Fails (c10::Error naming the flag) unless `backend` can serve tensors on `device`: "nccl"
/// needs an NCCL build and a CUDA device; "gloo" serves every device (through host copies).
void check_backend_serves(const std::string& backend, const torch::Device& device);

/// The device a rank trains on: a plain `cuda` in a launched run means GPU LOCAL_RANK (for
/// Gloo wrapping over the visible GPUs; NCCL fails when there are fewer GPUs than local
/// ranks); anything else is kept.
torch::Device rank_device(const torch::Device& device, const RankEnvironment& environment,
                          const std::string& backend);

/// Joins the group of `environment` with `backend`, "gloo" or "nccl" (see
/// check_backend_serves); `device` is where this rank's tensors live (NCCL reduces there).
/// Rank 0 opens the store at MASTER_ADDR:MASTER_PORT, the others connect, within
/// `timeout_s`; a collective waiting longer than `timeout_s` for a rank fails (RankLost)
/// instead of hanging.
std::unique_ptr<Collectives> join_process_group(const RankEnvironment& environment,
                                                const std::string& backend, int timeout_s,
                                                const torch::Device& device = torch::kCPU);

/// A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice).
int free_local_port();

}  // namespace attnkit::train
