// The planner's table (plan/planner.h, kernel_table()): every kernel's spec, in the order the
// planner asks them, fast paths first. The planner includes no kernel header; adding a kernel
// touches its own files and this list.

#include "core/kernels/chunked.h"
#include "core/kernels/decode_attention.h"
#include "core/kernels/fused_tiles.h"
#include "core/kernels/loop_nest_attention.h"
#include "core/kernels/math_kernel.h"
#include "core/kernels/sdpa_kernel.h"
#include "core/kernels/sink_attention.h"
#include "core/kernels/varlen_kernel.h"
#include "core/plan/planner.h"

namespace attnkit::detail {

const KernelTable& kernel_table() {
  static const KernelTable table{
      decode_spec(),
      ragged_loop_nest_spec(),
      packed_loop_nest_spec(),
      loop_nest_spec(),
      flash_spec(),
      sdpa_spec(),
      sdpa_varlen_spec(),
      sdpa_masked_spec(),
      sinks_spec(),
      fused_tiles_spec(),
      chunked_spec(),
      // It takes every call: the last.
      math_spec(),
  };
  return table;
}

}  // namespace attnkit::detail
