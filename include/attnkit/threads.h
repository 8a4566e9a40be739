#pragma once

/// Thread counts: LibTorch's intra-op threads and the BLAS its matrix products call.
///
/// `torch::set_num_threads` sets LibTorch's OpenMP pool (and MKL, where LibTorch has it), but
/// not OpenBLAS or BLIS, which Debian's LibTorch calls through libblas.so.3 and which start
/// one thread per core by default. `attnkit::set_num_threads` sets both, so that "N threads"
/// means N threads. attnkit's kernels take their parallelism from `at::get_num_threads()`
/// (see docs/threads.md).
///
/// Example: `attnkit::set_num_threads(4); std::cout << attnkit::blas_threads().name;`

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>

#include <c10/core/Device.h>

namespace attnkit {

/// The BLAS that LibTorch's matrix products reach, as found in the running process.
struct BlasThreads {
  /// "OpenBLAS", "BLIS", or "unknown" (for example the reference BLAS, or MKL linked into
  /// LibTorch, whose threads torch::set_num_threads already sets).
  std::string name;
  /// Its thread count; -1 when `name` is "unknown".
  int num_threads = -1;
};

/// "OpenBLAS, 2 threads", or "BLAS threads unknown".
std::ostream& operator<<(std::ostream& out, const BlasThreads& blas);

/// Which BLAS the process calls and how many threads it uses.
BlasThreads blas_threads();

/// The CPU cores this process may run on (its affinity mask, else the machine's): the largest
/// thread count worth asking for, since more threads than cores only spin in OpenMP (a --threads
/// flag's limit). Example: `attnkit::set_num_threads(attnkit::usable_cores());`.
int usable_cores();

/// Sets LibTorch's intra-op threads (torch::set_num_threads) and, where the BLAS is one of
/// those blas_threads() knows, the BLAS's threads, both to `num_threads` (>= 1).
void set_num_threads(int num_threads);

/// While one is alive, the BLAS (OpenBLAS or BLIS) runs on one thread; the last one to go
/// restores the count it found. Holders may nest and overlap across threads; BLAS calls that
/// other threads of the process make meanwhile also run single-threaded. For code that runs
/// its own parallel tasks, each with BLAS calls (docs/threads.md).
/// Example: `{ attnkit::SingleThreadedBlas one; model->forward(x); }`.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;
};

/// Runs task(t) for every t in [0, num_tasks) on at::get_num_threads() workers (capped by
/// num_tasks; one on a GPU or inside a parallel region), as attnkit's kernels run theirs:
/// workers take the next task as they finish one, so list the costly tasks first. With
/// several workers, grad mode is off in them (it is per thread) and the BLAS runs on one
/// thread. Example: `attnkit::run_tasks(4, torch::kCPU, [&](int64_t t) { part(t); });`.
void run_tasks(int64_t num_tasks, const c10::Device& device,
               const std::function<void(int64_t)>& task);

}  // namespace attnkit
