#!/usr/bin/env bash
# Builds and runs attnkit-train (default: the copy task with MultiHeadAttention): a model
# learns, with a progress bar and a final report. Arguments go to attnkit-train (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target attnkit-train >/dev/null
exec build/apps/attnkit-train "$@"
