#pragma once

/// Which kernel ran each attention call: the planner's record, for tests and tools.

#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace attnkit::detail {
struct KernelRecordAccess;
}  // namespace attnkit::detail

namespace attnkit::functional {

/// One attention call as the planner ran it.
struct KernelRun {
  /// The kernel: "decode", "ragged_loop_nest", "packed_loop_nest", "loop_nest", "flash",
  /// "sdpa" (LibTorch's SDPA; on 1.13 its stand-in, docs/backends.md), "sdpa_varlen",
  /// "sdpa_masked", "chunked" or "math".
  std::string kernel;
  /// The dtype it computed in: a 16-bit call's own where its kernel runs it so (LibTorch's
  /// CUDA kernels; the fused tile kernel on a CPU with matrix units; the decode kernel, which
  /// reads 16-bit caches in place), else float32; the inputs' for other calls (under autocast,
  /// the autocast dtype's).
  c10::ScalarType computed_in;
  /// The inputs' device.
  c10::Device device;
  /// For a 16-bit call, how its products ran and why: "BFloat16 products on AVX-512 BF16
  /// (oneDNN's brgemm), float32 accumulation", "BFloat16 read in place, float32 arithmetic"
  /// (the decode kernel), or "float32: " and the reason (a CPU without
  /// AMX or AVX-512 BF16/FP16, a LibTorch without brgemm, ...); empty for other calls.
  std::string sixteen_bit;
};

/// The planner's record: while one is alive, every attention call that this thread makes
/// (`attention`, the modules, decode steps) is appended to it, so a test or a tool can check
/// which route ran. Records nest: each sees the calls made while it is the innermost.
/// Example: `KernelRecord record; mha(x); EXPECT_EQ(record.runs().at(0).kernel, "chunked");`
class KernelRecord {
 public:
  KernelRecord();
  ~KernelRecord();
  KernelRecord(const KernelRecord&) = delete;
  KernelRecord& operator=(const KernelRecord&) = delete;
  const std::vector<KernelRun>& runs() const { return runs_; }

 private:
  friend struct detail::KernelRecordAccess;  // the planner appends
  std::vector<KernelRun> runs_;
  KernelRecord* outer_;
};

}  // namespace attnkit::functional
