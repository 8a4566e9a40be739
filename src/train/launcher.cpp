#include "launcher.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "distributed.h"
#include "line.h"

namespace attnkit::train {

namespace {

// The ranks' process ids, for the signal handler (fixed size: no allocation in a handler).
constexpr int kMaxLocalRanks = 1024;
pid_t g_ranks[kMaxLocalRanks];
std::atomic<int> g_rank_count{0};
std::atomic<int> g_forwarded_signal{0};

extern "C" void forward_to_ranks(int signal) {
  g_forwarded_signal.store(signal);
  const int count = g_rank_count.load();
  for (int r = 0; r < count; ++r) {
    if (g_ranks[r] > 0)
      ::kill(g_ranks[r], signal);
  }
}

// Starts rank `rank`: this executable with `arguments` and the launcher's environment.
pid_t start_rank(int rank, int nproc, int port, const std::vector<std::string>& arguments) {
  std::vector<std::string> words{"attnkit-train"};
  words.insert(words.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (auto& word : words)
    argv.push_back(word.data());
  argv.push_back(nullptr);
  const auto rank_text = std::to_string(rank), world_text = std::to_string(nproc),
             port_text = std::to_string(port);
  const pid_t pid = ::fork();
  if (pid != 0)
    return pid;
  // The child. Its own process group: a terminal's Ctrl-C reaches the launcher only, which
  // passes it on once. It dies with the launcher, should the launcher be killed.
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  ::setenv("RANK", rank_text.c_str(), 1);
  ::setenv("LOCAL_RANK", rank_text.c_str(), 1);
  ::setenv("WORLD_SIZE", world_text.c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", world_text.c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", port_text.c_str(), 1);
  ::execv("/proc/self/exe", argv.data());
  std::fprintf(stderr, "attnkit-train: rank %d: cannot start (%s)\n", rank, std::strerror(errno));
  std::_Exit(127);
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    const int signal = WTERMSIG(status);
    return c10::str("was killed by signal ", signal, " (", ::strsignal(signal), ")");
  }
  return c10::str("exited with status ", WEXITSTATUS(status));
}

int exit_code(int status) {
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

}  // namespace

int launch_local_ranks(int nproc, const std::vector<std::string>& arguments, std::ostream& err,
                       int grace_s) {
  TORCH_CHECK(nproc >= 1 && nproc <= kMaxLocalRanks, "--nproc: expected 1..", kMaxLocalRanks,
              ", got ", nproc);
  const int port = free_local_port();
  struct sigaction action {};
  action.sa_handler = forward_to_ranks;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  for (int r = 0; r < nproc; ++r) {
    g_ranks[r] = start_rank(r, nproc, port, arguments);
    g_rank_count.store(r + 1);
  }

  using Clock = std::chrono::steady_clock;
  int running = nproc;
  int result = 0;
  bool failed = false;
  Clock::time_point deadline;
  bool terminated = false;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR)
      break;
    if (pid <= 0) {
      if (failed && !terminated && Clock::now() > deadline) {
        Line(err) << "attnkit-train: stopping the ranks still running after " << grace_s << " s\n";
        for (int r = 0; r < nproc; ++r) {
          if (g_ranks[r] > 0)
            ::kill(g_ranks[r], SIGKILL);
        }
        terminated = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    int rank = 0;
    while (rank < nproc && g_ranks[rank] != pid)
      ++rank;
    if (rank == nproc)
      continue;
    g_ranks[rank] = 0;
    --running;
    const int code = exit_code(status);
    const bool interrupted = code == 130 && g_forwarded_signal.load() != 0;
    if (code != 0 && !interrupted && !failed) {
      // The first failure decides the launcher's status; the others usually follow from it.
      failed = true;
      result = code;
      deadline = Clock::now() + std::chrono::seconds(grace_s);
      if (running > 0) {
        Line(err) << "attnkit-train: rank " << rank << " " << describe(status) << "; waiting up to "
                  << grace_s << " s for the other ranks to stop\n";
      } else if (nproc > 1 || WIFSIGNALED(status)) {
        Line(err) << "attnkit-train: rank " << rank << " " << describe(status) << "\n";
      }
    } else if (interrupted && !failed) {
      result = 130;
    }
  }
  g_rank_count.store(0);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  return result;
}

}  // namespace attnkit::train
