#!/usr/bin/env bash
# Configures and builds attnkit (Release) in build/ or $ATTNKIT_BUILD_DIR.
# Usage: scripts/build.sh [cmake --build arguments, e.g. --target attnkit-walkthrough]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${ATTNKIT_BUILD_DIR:-build}
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build "$build_dir" -j "$(nproc)" "$@"
