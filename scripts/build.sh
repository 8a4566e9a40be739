#!/usr/bin/env bash
# Configures and builds attnkit with a CMake preset (CMakePresets.json), installing what is
# missing first. Usage: scripts/build.sh [--preset default|debug|asan] [cmake --build args]
#   scripts/build.sh                                  # Release, in build/
#   scripts/build.sh --target attnkit-walkthrough
set -euo pipefail
cd "$(dirname "$0")/.."
preset=default
if [ "${1:-}" = "--preset" ]; then
  preset=${2:?--preset needs a name: default, debug or asan}
  shift 2
fi
scripts/setup.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)" "$@"
