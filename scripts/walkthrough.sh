#!/usr/bin/env bash
# Builds and runs attnkit-walkthrough: the chapter-3 computations step by step.
# Usage: scripts/walkthrough.sh [--section NAME | --help]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target attnkit-walkthrough >/dev/null
exec build/apps/attnkit-walkthrough "$@"
