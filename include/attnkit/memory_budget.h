#pragma once

/// attnkit's memory budget: the most memory that one quadratic allocation may ask for on the
/// CPU, checked before it is made. Two things allocate memory that grows with the square of
/// the sequence: the math backend's (batch, heads, n, m) scores, weights and dense mask, and the
/// book's CausalAttention, whose (context_length, context_length) `mask` buffer its constructor
/// fills. Either is refused at once, with its size, the option that sets it and the way out,
/// when it would take more than the budget, instead of failing late with the allocator's
/// message (or swapping the machine to a halt). kAuto stays within the budget by choosing the
/// tiled kernels, which take memory linear in n; the math core is its choice only where they
/// cannot run a call (the weights themselves are asked for, a one-query ragged step).
///
/// The default is half of the machine's physical memory. On CUDA the device's allocator
/// refuses with its own message, which names the size.
///
/// Example: `attnkit::set_memory_budget(int64_t{4} << 30);  // 4 GiB`

#include <cstdint>

namespace attnkit {

/// The budget in bytes: set_memory_budget's value, else half of physical memory.
int64_t memory_budget();

/// Sets the budget to `bytes` (> 0); 0 restores the default.
void set_memory_budget(int64_t bytes);

/// The machine's physical memory in bytes (sysconf), the default budget's reference.
int64_t physical_memory();

}  // namespace attnkit
