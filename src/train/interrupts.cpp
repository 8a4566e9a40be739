// attnkit-train's SIGINT and SIGTERM (interrupts.h): a flag for the run, a grace period on a
// thread of its own, and an exit at once that leaves no temporary file behind.

#include "interrupts.h"

#include <semaphore.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <thread>

#include "checkpoint.h"
#include "io/file_io.h"

namespace attnkit::train {

namespace {

std::atomic<bool> g_stop_requested{false};
std::atomic<int> g_signals{0};
sem_t g_first_signal;  // posted by the handler (sem_post is async-signal-safe)
bool g_announce = false;
std::string g_save_path;

// What an exit at once removes, and what it says: filled before the handlers are installed,
// since a handler may not allocate.
constexpr int kLeftovers = 3;
char g_leftovers[kLeftovers][4096] = {};
char g_second_signal_message[4096 + 160] = {};

void copy_into(char* buffer, size_t size, const std::string& text) {
  const auto length = std::min(text.size(), size - 1);
  std::memcpy(buffer, text.data(), length);
  buffer[length] = '\0';
}

// Async-signal-safe: unlink, write and _exit only. The lock file (the last leftover) goes only
// when this process holds it: a run refused --save, or a rank that does not save, must leave
// the saving run's lock alone.
void exit_at_once(const char* message) {
  const int removable = run_progress().holds_save_lock.load() ? kLeftovers : kLeftovers - 1;
  for (int i = 0; i < removable; ++i) {
    if (g_leftovers[i][0] != '\0')
      ::unlink(g_leftovers[i]);
  }
  if (g_announce && message != nullptr) {
    const auto length = std::strlen(message);
    if (::write(STDERR_FILENO, message, length) < 0) {
      // Nothing left to report it to.
    }
  }
  ::_exit(130);
}

extern "C" void on_stop_signal(int) {
  if (g_signals.fetch_add(1) == 0) {
    g_stop_requested.store(true);
    ::sem_post(&g_first_signal);
    return;
  }
  exit_at_once(g_second_signal_message);
}

std::string abandoned_message() {
  const auto& progress = run_progress();
  const auto step = progress.step.load();
  std::string message =
      "attnkit-train: interrupted: the run did not reach the end of a step within " +
      std::to_string(kStopGraceSeconds) + " s of the signal, so " +
      (step == 0 ? std::string("its setup") : "step " + std::to_string(step)) + " was abandoned; ";
  if (g_save_path.empty()) {
    message += "no --save given, nothing saved";
  } else if (progress.saved_step.load() < 0) {
    message += "this run had not saved " + g_save_path + " yet";
  } else {
    message += g_save_path + " holds step " + std::to_string(progress.saved_step.load()) +
               ", the last checkpoint saved";
  }
  return message + "\n";
}

// Waits for the first signal, then gives the run its grace period; a checkpoint being written
// when it ends is let to finish.
void watch_grace_period() {
  while (::sem_wait(&g_first_signal) != 0) {
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kStopGraceSeconds);
  while (std::chrono::steady_clock::now() < deadline || run_progress().writing.load() > 0) {
    if (run_progress().ended.load())
      return;  // the run stopped in time and says so itself
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (run_progress().ended.load())
    return;
  // Formatted here, outside any handler; the exit removes the files as the handler's does.
  static std::string message;
  message = abandoned_message();
  exit_at_once(message.c_str());
}

}  // namespace

RunProgress& run_progress() {
  static RunProgress progress;
  return progress;
}

const std::atomic<bool>* install_stop_handlers(const std::string& save_path, bool announce) {
  static bool installed = false;
  if (installed)
    return &g_stop_requested;
  installed = true;
  g_announce = announce;
  g_save_path = save_path;
  if (!save_path.empty()) {
    copy_into(g_leftovers[0], sizeof(g_leftovers[0]), attnkit::detail::temporary_path(save_path));
    copy_into(g_leftovers[1], sizeof(g_leftovers[1]),
              attnkit::detail::temporary_path(best_checkpoint_path(save_path)));
    copy_into(g_leftovers[2], sizeof(g_leftovers[2]), save_path + ".lock");
  }
  copy_into(g_second_signal_message, sizeof(g_second_signal_message),
            save_path.empty()
                ? "attnkit-train: a second signal: stopped at once (no --save given, nothing "
                  "saved)\n"
                : "attnkit-train: a second signal: stopped at once; the step in progress was "
                  "dropped and " +
                      save_path + " is as the last checkpoint left it\n");
  ::sem_init(&g_first_signal, /*pshared=*/0, /*value=*/0);
  std::thread(watch_grace_period).detach();
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  return &g_stop_requested;
}

}  // namespace attnkit::train
