#!/usr/bin/env bash
# Installs what attnkit needs to build and test, from Debian's archive (12 on the host; 13
# inside the root of scripts/debian13.sh, where the same names give LibTorch 2.6).
# scripts/setup.sh --fuzz also installs what scripts/fuzz.sh needs, --pip what scripts/pip_torch.sh
# needs to make pip's PyTorch's virtual environment. Idempotent: prints nothing and changes nothing when everything is already installed.
set -euo pipefail

packages=(
  cmake ninja-build g++          # build tools
  ccache                         # compiler cache shared by builds and clones (scripts/compiler_cache.sh)
  libtorch-dev                   # LibTorch 1.13 (CPU)
  libopenblas0-pthread           # without it LibTorch uses the reference BLAS, ~30x slower
  libgtest-dev                   # tests
  libcxxopts-dev                 # command-line parsing in the programs
  libicu-dev                     # Unicode in apps/sentence_encoder's BERT tokenizer
  libstb-dev                     # PNG writing and a bitmap font for attention heatmaps
  libgloo-dev                    # Gloo's headers: attnkit-train's data-parallel runs (c10d)
  nlohmann-json3-dev             # JSON headers of safetensors files (src/io/safetensors.cpp)
  python3-torch                  # PyTorch of the same version: the cross-language tests
)

# scripts/fuzz.sh: clang's libFuzzer and its OpenMP runtime.
case "${1:-}" in
  --fuzz) packages+=(clang libclang-rt-dev libomp-dev) ;;
  --pip) packages+=(python3-venv) ;;  # scripts/pip_torch.sh (ensurepip brings pip)
esac

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "setup: installing ${missing[*]} (from Debian's archive; a few minutes on a fresh machine)"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
$sudo apt-get update -qq
echo "setup: downloading and unpacking ${#missing[@]} packages and their dependencies"
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
