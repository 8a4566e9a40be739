#!/usr/bin/env bash
# Builds and runs attnkit-train (default: the copy task with MultiHeadAttention): a model
# learns, with a progress bar and a final report. Arguments go to attnkit-train (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
# What it is doing goes to stderr, the program's output alone to stdout: the install (a line
# naming the packages), then the build's progress (a few minutes on a fresh machine).
if [ ! -x build/apps/attnkit-train ]; then
  echo "run: installing what is missing, then building attnkit-train (first time: several minutes)" >&2
fi
scripts/build.sh --target attnkit-train >&2
exec build/apps/attnkit-train "$@"
