#!/usr/bin/env bash
# Configures and builds attnkit with a CMake preset (CMakePresets.json), installing what is
# missing first. Usage: scripts/build.sh [--preset default|debug|asan|pip] [cmake --build args]
#   scripts/build.sh                                  # Release, in build/
#   scripts/build.sh --target attnkit-walkthrough
set -euo pipefail
cd "$(dirname "$0")/.."
preset=default
if [ "${1:-}" = "--preset" ]; then
  preset=${2:?--preset needs a name: default, debug, asan or pip}
  shift 2
fi
scripts/setup.sh
. scripts/compiler_cache.sh
if [ "$preset" = pip ]; then
  # pip's LibTorch, from the virtual environment of scripts/pip_torch.sh (made on first use).
  { read -r python; read -r ATTNKIT_PIP_TORCH_PREFIX; } < <(scripts/pip_torch.sh --print-prefix)
  export ATTNKIT_PIP_TORCH_PREFIX
  # The index's torch for Linux is the CUDA build, whose CMake files need a CUDA toolkit.
  if [ -n "$("$python" -c 'import torch; print(torch.version.cuda or "")')" ] &&
     ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "build: preset pip: pip's torch is a CUDA build ($("$python" -c 'import torch; print(torch.__version__)')), and its" \
         "CMake files need NVIDIA's CUDA toolkit (nvcc); none is on PATH or in /usr/local/cuda" >&2
    exit 1
  fi
fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)" "$@"
