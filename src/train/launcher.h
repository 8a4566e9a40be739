#pragma once

// `attnkit-train --nproc N`: the program starts N copies of itself on this machine as the
// ranks of one data-parallel run, the way torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port), and supervises them.

#include <ostream>
#include <string>
#include <vector>

namespace attnkit::train {

/// Runs `arguments` (without the program name and without --nproc) as `nproc` ranks of
/// this executable and waits for them. SIGINT and SIGTERM sent to the launcher are passed to
/// every rank (which finish the step, save and exit 130). When a rank dies or fails, the
/// launcher says which and how on `err`, gives the others `grace_s` seconds to notice and
/// exit, then stops them. Returns the exit status for the launcher: 0 when every rank
/// succeeded, 130 when they were all interrupted, else the first failing rank's status
/// (128 + the signal for one killed by a signal).
int launch_local_ranks(int nproc, const std::vector<std::string>& arguments, std::ostream& err,
                       int grace_s = 60);

}  // namespace attnkit::train
