#!/usr/bin/env bash
# Builds attnkit and runs every test (installs what is missing first).
# Usage: scripts/test.sh [--asan | --libtorch2 | --pip] [ctest arguments, e.g. -R MultiHead]
#   (none)       Debian 12's LibTorch 1.13 on this machine, in build/.
#   --asan       build in build-asan/ with AddressSanitizer + UndefinedBehaviorSanitizer and
#                run the tests there (any sanitizer report fails the run); the package test is
#                left out, since its outside project is built without the sanitizers.
#   --libtorch2  the whole suite against Debian 13's LibTorch 2.6 and PyTorch 2.6, in
#                build-libtorch2/, inside the Debian 13 root of scripts/debian13.sh (made with
#                debootstrap on first use, a few minutes; reused after that).
#   --pip        the whole suite against pip's LibTorch and PyTorch (scripts/pip_torch.sh pins the
#                version and makes its virtual environment on first use, about a minute and 3 GB
#                of downloads), in build-pip/; the Python tests use the package as pip install .
#                puts it into a copy of that environment (VENV-attnkit), with the operators'
#                library that build-pip/ compiled (setup.py's ATTNKIT_PREBUILT_OPS). The
#                index's torch is the CUDA build: CMake needs NVIDIA's CUDA toolkit to configure against it (pip
#                install . does not), links NCCL, and the CUDA tests skip without a GPU.
#   --preset P   any preset of CMakePresets.json, with this machine's LibTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=default
extra=()
case "${1:-}" in
  --asan)
    preset=asan
    extra=(-E '^package\.')
    shift
    ;;
  --libtorch2)
    shift
    exec scripts/debian13.sh scripts/test.sh --preset libtorch2 "$@"
    ;;
  --pip)
    preset=pip
    shift
    ;;
  --preset)
    preset=${2:?--preset needs a name: default, debug, asan, libtorch2 or pip}
    shift 2
    ;;
esac
. scripts/compiler_cache.sh  # the package test's outside projects compile through it too
minutes() { echo "$(($1 / 60)) min $(($1 % 60)) s"; }
start=$SECONDS
scripts/build.sh --preset "$preset"
echo "test: preset $preset: built in $(minutes $((SECONDS - start)))"
if [ "$preset" = pip ]; then
  # The Python side of the cross-language tests: the same PyTorch as the LibTorch, in a copy of
  # scripts/pip_torch.sh's environment (hard links: no space, a second) into which pip install .
  # puts the package as a user installs it (docs/python.md#install); the Python tests import
  # it from there. The copy keeps one path, so that ccache serves the next run's compiles.
  start=$SECONDS
  pip_python=$(scripts/pip_torch.sh)
  pip_venv=$(dirname "$(dirname "$pip_python")")
  rm -rf "$pip_venv-attnkit"
  cp -al "$pip_venv" "$pip_venv-attnkit" 2>/dev/null || cp -a "$pip_venv" "$pip_venv-attnkit"
  ATTNKIT_PYTHON=$pip_venv-attnkit/bin/python
  # The library this build's attnkit_ops target compiled (same sources, compiler and torch as
  # setup.py's: compiling them again took 9 min), packaged as pip install . packages its own.
  ATTNKIT_PREBUILT_OPS=$PWD/build-pip/python/attnkit/lib/libattnkit_ops.so \
    "$ATTNKIT_PYTHON" -m pip install --quiet --disable-pip-version-check --no-build-isolation \
    --no-index .
  ATTNKIT_PYTHON_INSTALLED=1
  export ATTNKIT_PYTHON ATTNKIT_PYTHON_INSTALLED
  echo "test: pip install . into $pip_venv-attnkit in $(minutes $((SECONDS - start)))"
fi
start=$SECONDS
status=0
ctest --preset "$preset" "${extra[@]}" "$@" || status=$?
echo "test: preset $preset: tests ran in $(minutes $((SECONDS - start)))"
exit $status
