// The BLAS is found at run time (dlsym in the process's global scope), not linked: LibTorch
// reaches it through libblas.so.3, which Debian's alternatives point at OpenBLAS, BLIS or the
// reference BLAS, so attnkit cannot know at build time which one it will meet.

#include "attnkit/threads.h"

#include <dlfcn.h>
#include <sched.h>

#include <mutex>
#include <thread>

#include "core/base/parallel.h"

namespace attnkit {

namespace {

struct BlasControl {
  const char* name = "unknown";
  int (*get)() = nullptr;
  void (*set)(int) = nullptr;
};

template <typename Fn>
Fn find_symbol(const char* symbol) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, symbol));
}

const BlasControl& blas_control() {
  static const BlasControl control = [] {
    BlasControl c;
    if (auto get = find_symbol<int (*)()>("openblas_get_num_threads")) {
      if (auto set = find_symbol<void (*)(int)>("openblas_set_num_threads"))
        c = {"OpenBLAS", get, set};
    } else if (auto bli_get = find_symbol<int (*)()>("bli_thread_get_num_threads")) {
      if (auto bli_set = find_symbol<void (*)(int)>("bli_thread_set_num_threads"))
        c = {"BLIS", bli_get, bli_set};
    }
    return c;
  }();
  return control;
}

// MKL's per-thread count, mkl_set_num_threads_local (it returns the thread's previous count,
// 0 meaning MKL's global one); null without MKL. Its C entry point is MKL_Set_Num_Threads_Local
// (mkl_service.h maps the lower-case name to it): the lower-case symbol is the Fortran one,
// which takes a pointer. pip's LibTorch links MKL into libtorch_cpu,
// which Python loads into a local scope: looked up there too, through the library that holds
// a LibTorch function.
using MklSetLocal = int (*)(int);

MklSetLocal mkl_set_local() {
  static const MklSetLocal set = [] {
    constexpr const char* kSymbol = "MKL_Set_Num_Threads_Local";
    if (auto found = find_symbol<MklSetLocal>(kSymbol))
      return found;
    Dl_info libtorch{};
    if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &libtorch) == 0 ||
        libtorch.dli_fname == nullptr)
      return MklSetLocal{nullptr};
    void* handle = dlopen(libtorch.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return handle != nullptr ? reinterpret_cast<MklSetLocal>(dlsym(handle, kSymbol))
                             : MklSetLocal{nullptr};
  }();
  return set;
}

std::mutex single_threaded_mutex;
int single_threaded_holders = 0;
int threads_before_single = 1;

}  // namespace

BlasThreads blas_threads() {
  const auto& blas = blas_control();
  return {blas.name, blas.get ? blas.get() : -1};
}

std::ostream& operator<<(std::ostream& out, const BlasThreads& blas) {
  if (blas.num_threads < 0)
    return out << "BLAS threads unknown";
  return out << blas.name << ", " << blas.num_threads
             << (blas.num_threads == 1 ? " thread" : " threads");
}

int usable_cores() {
  cpu_set_t allowed;
  return sched_getaffinity(0, sizeof(allowed), &allowed) == 0
             ? CPU_COUNT(&allowed)
             : static_cast<int>(std::thread::hardware_concurrency());
}

void set_num_threads(int num_threads) {
  TORCH_CHECK(num_threads >= 1, "[attnkit::set_num_threads] num_threads must be >= 1, got ",
              num_threads);
  torch::set_num_threads(num_threads);
  if (const auto& blas = blas_control(); blas.set)
    blas.set(num_threads);
}

SingleThreadedBlas::SingleThreadedBlas() {
  const auto& blas = blas_control();
  if (!blas.set)
    return;
  std::lock_guard<std::mutex> lock(single_threaded_mutex);
  if (single_threaded_holders++ == 0) {
    threads_before_single = blas.get();
    if (threads_before_single != 1)
      blas.set(1);
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  const auto& blas = blas_control();
  if (!blas.set)
    return;
  std::lock_guard<std::mutex> lock(single_threaded_mutex);
  if (--single_threaded_holders == 0 && threads_before_single != 1)
    blas.set(threads_before_single);
}

namespace detail {

OneMklThreadHere::OneMklThreadHere() {
  if (const auto set = mkl_set_local())
    previous_ = set(1);
}

OneMklThreadHere::~OneMklThreadHere() {
  if (previous_ >= 0)
    mkl_set_local()(previous_);
}

}  // namespace detail

void run_tasks(int64_t num_tasks, const c10::Device& device,
               const std::function<void(int64_t)>& task) {
  detail::run_tasks(num_tasks, device, task);
}

}  // namespace attnkit
