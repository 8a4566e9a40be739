#!/usr/bin/env bash
# Coverage-guided fuzzing of every reader that takes a file from a user (libFuzzer, clang,
# AddressSanitizer + UndefinedBehaviorSanitizer; build-fuzz/, CMake preset fuzz):
#   fuzz_state_dict   attnkit::read_state_dict's parser, then load_state_dict into a module
#   fuzz_safetensors  attnkit::load_safetensors (the header, the mapped data), then a load into
#                     a module through a name map
#   fuzz_checkpoint   attnkit-train --resume: the parser, then restore_checkpoint
# Usage: scripts/fuzz.sh [SECONDS per target, default 60] [libFuzzer flags...]
# First every saved regression input (tests/fuzz/regressions/<target>/, each an input that
# once crashed) must pass; then each target runs from its seeds (data/fuzz/<kind>/: files
# written by attnkit and by PyTorch, plus the golden state dicts of data/golden/) with
#   -malloc_limit_mb=256   any single allocation above 256 MiB is a finding
#   -rss_limit_mb=2048     and so is a resident size above 2 GiB
#   -timeout=10            and an input that takes more than 10 s (a hang)
# and leak detection on. A finding stops the run (exit 1) and is written to
# build-fuzz/findings/<target>/; copy it into tests/fuzz/regressions/<target>/ with the fix.
# Prints each target's executions; CI runs a short run on every submission.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
scripts/setup.sh --fuzz
. scripts/compiler_cache.sh
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$(nproc)"

export ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for target in state_dict safetensors checkpoint; do
  binary=build-fuzz/tests/fuzz/fuzz_$target
  regressions=tests/fuzz/regressions/$target
  if compgen -G "$regressions/*" >/dev/null; then
    "$binary" "$regressions"/* >/dev/null 2>&1 || {
      echo "fuzz: $target: a saved regression input fails again:" >&2
      "$binary" "$regressions"/* 2>&1 | tail -20 >&2
      exit 1
    }
  fi
  corpus=build-fuzz/corpus/$target
  findings=build-fuzz/findings/$target
  mkdir -p "$corpus" "$findings"
  seeds=(data/fuzz/$target)
  [ "$target" = state_dict ] && seeds+=(build-fuzz/golden_seeds) &&
    mkdir -p build-fuzz/golden_seeds && cp -u data/golden/*.state.pt build-fuzz/golden_seeds/
  log=build-fuzz/fuzz_$target.log
  if ! "$binary" "$corpus" "${seeds[@]}" -max_total_time="$seconds" -malloc_limit_mb=256 \
      -rss_limit_mb=2048 -timeout=10 -detect_leaks=1 -print_final_stats=1 \
      -artifact_prefix="$findings/" "$@" >"$log" 2>&1; then
    echo "fuzz: $target: FINDING (see $log and $findings/):" >&2
    grep -E "ERROR|SUMMARY|==[0-9]+==" "$log" | head -20 >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  peak=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
  echo "fuzz: $target: $runs executions in $seconds s, 0 crashes, 0 hangs, 0 leaks, peak RSS ${peak} MB, corpus $(ls "$corpus" | wc -l) inputs"
done
