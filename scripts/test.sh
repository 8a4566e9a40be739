#!/usr/bin/env bash
# Builds attnkit and runs every test (installs what is missing first).
# Usage: scripts/test.sh [--asan] [ctest arguments, e.g. -R MultiHead]
#   --asan   build in build-asan/ with AddressSanitizer + UndefinedBehaviorSanitizer and
#            run the tests there (any sanitizer report fails the run); the package test is
#            left out, since its outside project is built without the sanitizers.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=default
extra=()
if [ "${1:-}" = "--asan" ]; then
  preset=asan
  extra=(-E '^package\.')
  shift
fi
scripts/build.sh --preset "$preset"
ctest --preset "$preset" "${extra[@]}" "$@"
