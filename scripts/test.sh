#!/usr/bin/env bash
# Builds attnkit and runs every test (installs what is missing first).
# Usage: scripts/test.sh [ctest arguments, e.g. -R MultiHead]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir "${ATTNKIT_BUILD_DIR:-build}" -j "$(nproc)" --output-on-failure "$@"
