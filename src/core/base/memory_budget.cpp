// attnkit's memory budget (attnkit/memory_budget.h) and the check every quadratic allocation
// makes against it (core/base/checks.h).

#include "attnkit/memory_budget.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <sstream>

#include "core/base/checks.h"

namespace attnkit {

namespace {

std::atomic<int64_t> g_budget{0};  // 0: the default

}  // namespace

int64_t physical_memory() {
  // Read once: sysconf(_SC_PHYS_PAGES) is a system call, and every math call asks.
  static const int64_t bytes = [] {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page_size = ::sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : int64_t{0};
  }();
  return bytes;
}

int64_t memory_budget() {
  const auto set = g_budget.load();
  if (set > 0)
    return set;
  const auto physical = physical_memory();
  // A machine that does not say: no budget, as before there was one.
  return physical > 0 ? physical / 2 : INT64_MAX;
}

void set_memory_budget(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "[set_memory_budget] bytes must be > 0 (or 0 for the default, half of ",
              "physical memory), got ", bytes);
  g_budget.store(bytes);
}

namespace detail {

std::string format_bytes(double bytes) {
  static const char* const units[] = {"bytes", "kB", "MB", "GB", "TB", "PB", "EB"};
  int unit = 0;
  while (bytes >= 1000.0 && unit < 6) {
    bytes /= 1000.0;
    ++unit;
  }
  std::ostringstream text;
  // Three significant digits: 1.07 GB, 68.7 GB, 160 GB.
  text << std::setprecision(unit == 0     ? 0
                            : bytes < 10  ? 2
                            : bytes < 100 ? 1
                                          : 0)
       << std::fixed << bytes << " " << units[unit];
  return text.str();
}

void check_memory_budget(const std::string& who, const std::string& what, double bytes,
                         const std::string& way_out, const char* setter) {
  const auto budget = memory_budget();
  if (bytes <= static_cast<double>(budget))
    return;
  const bool is_default = g_budget.load() == 0;
  TORCH_CHECK(false, who, ": ", what, " needs ", format_bytes(bytes),
              ", over attnkit's memory budget of ", format_bytes(static_cast<double>(budget)),
              is_default ? c10::str(" (half of this machine's ",
                                    format_bytes(static_cast<double>(physical_memory())), ")")
                         : c10::str(" (", setter, ")"),
              "; ", way_out);
}

}  // namespace detail

}  // namespace attnkit
