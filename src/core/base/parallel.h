#pragma once

// attnkit's threading model (docs/threads.md): a kernel splits its work into independent
// tasks (a head batch, or a head batch's query block) and runs them on at::get_num_threads()
// workers, one level of parallelism only. Inside a task every LibTorch op runs serially
// (ATen does not nest parallel regions) and the BLAS runs on one thread, so that the OpenMP
// workers and OpenBLAS's own threads never compete for the same cores.

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/torch.h>

#include "attnkit/threads.h"

// With an OpenMP LibTorch, at::parallel_for (inline) runs its body serially in code compiled
// without OpenMP: attnkit's tasks would then run one by one while every op inside them
// spreads over the threads, the nested pattern this file exists to avoid.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "LibTorch uses OpenMP: compile attnkit with OpenMP (CMake: OpenMP::OpenMP_CXX)"
#endif

namespace attnkit::detail {

// The BLAS on one thread while one is alive (attnkit/threads.h).
using attnkit::SingleThreadedBlas;

// While one is alive, MKL (which pip's LibTorch links) runs the calling thread's products on
// one thread; nothing without MKL. SingleThreadedBlas cannot do this for MKL: its count is set
// per thread (mkl_set_num_threads_local), and with at::get_num_threads() > 1 a product called
// from a parallel region's worker takes MKL's threaded driver, which then runs alone and is
// about 9% slower per call than its sequential path (the fused tile kernel's GEMMs, 2 threads).
class OneMklThreadHere {
 public:
  OneMklThreadHere();
  ~OneMklThreadHere();
  OneMklThreadHere(const OneMklThreadHere&) = delete;
  OneMklThreadHere& operator=(const OneMklThreadHere&) = delete;

 private:
  int previous_ = -1;  // the thread's own count before (0: MKL's global count); -1: no MKL
};

// Workers for num_tasks tasks on `device`: at::get_num_threads() capped by num_tasks; 1 on
// a GPU (CUDA's current device and stream are per thread, and the host side is not the
// bottleneck there) and inside a parallel region (ATen does not nest them).
inline int64_t worker_count(int64_t num_tasks, const torch::Device& device) {
  if (!device.is_cpu() || at::in_parallel_region())
    return 1;
  return std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(num_tasks, 1));
}

// Runs task(t) for every t in [0, num_tasks) on worker_count() workers. Workers take the
// next task as they finish one, so list the costly tasks first. With several workers, each
// has the caller's thread-local state (inference mode, dispatch keys: an OpenMP worker starts
// without them, and an in-place op on an inference tensor there was refused), grad mode is
// off in them and the BLAS (MKL included) is single-threaded.
template <typename Task>
void run_tasks(int64_t num_tasks, const torch::Device& device, const Task& task) {
  const int64_t workers = worker_count(num_tasks, device);
  if (workers == 1) {
    for (int64_t t = 0; t < num_tasks; ++t)
      task(t);
    return;
  }
  SingleThreadedBlas single_threaded_blas;
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, workers, /*grain_size=*/1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard caller_state_guard(caller_state);
    const OneMklThreadHere one_mkl_thread;
    torch::NoGradGuard no_grad;
    for (int64_t t = next++; t < num_tasks; t = next++)
      task(t);
  });
}

}  // namespace attnkit::detail
