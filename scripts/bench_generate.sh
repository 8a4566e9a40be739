#!/usr/bin/env bash
# Generation speed, C++ against the Python reference of the chapter-4 bonus material, side by
# side on the same LibTorch: attnkit-decode-bench and scripts/bench_generate.py, greedy, one
# thread, untrained weights (seed 123), cached and uncached, at two shapes:
#   gpt2  vocab 50257, context 1024, d 768, 12 heads, 12 layers; 4-token prompt, 200 new
#   text  attnkit-train's text model (--task text --module mha --ffn): vocab 256, context 64,
#         d 64, 4 heads, 2 layers; 4-token prompt, 60 new (the context holds 64)
# Usage: scripts/bench_generate.sh [--libtorch2] [--shape gpt2|text]
#   --libtorch2  the same on Debian 13's LibTorch 2.6 and PyTorch 2.6 (scripts/debian13.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
"$python" -c 'import torch' 2>/dev/null || { echo "needs $python with torch (Debian: python3-torch)" >&2; exit 2; }
shapes="gpt2 text"
libtorch2=false
while (($#)); do
  case "$1" in
    --libtorch2) libtorch2=true; shift ;;
    --shape) shapes=${2:?--shape needs gpt2 or text}; shift 2 ;;
    *) echo "unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
flags_of() {
  case "$1" in
    gpt2) echo "--prompt 4 --new-tokens 200 --repeats 1" ;;
    text) echo "--vocab 256 --context 64 --d-model 64 --heads 4 --layers 2 --prompt 4 --new-tokens 60 --repeats 5" ;;
    *) echo "unknown shape '$1'; expected gpt2 or text" >&2; exit 2 ;;
  esac
}
scripts/build.sh --target attnkit-decode-bench >/dev/null
if $libtorch2; then
  scripts/debian13.sh bash -c 'cmake --preset libtorch2 >/dev/null && cmake --build --preset libtorch2 --target attnkit-decode-bench >/dev/null'
fi
mkdir -p build  # inside the repository, so that the Debian 13 root sees it too
work=$(mktemp -d "$PWD/build/bench-generate.XXXXXX")
trap 'rm -rf "$work"' EXIT
for shape in $shapes; do
  read -ra flags <<<"$(flags_of "$shape")"
  echo "== $shape: C++, LibTorch 1.13 =="
  build/apps/attnkit-decode-bench "${flags[@]}" --threads 1 --json "$work/$shape-cpp1.json"
  echo "== $shape: Python, PyTorch 1.13 =="
  "$python" scripts/bench_generate.py "${flags[@]}" --threads 1 --json "$work/$shape-py1.json"
  if $libtorch2; then
    echo "== $shape: C++, LibTorch 2.6 =="
    scripts/debian13.sh build-libtorch2/apps/attnkit-decode-bench "${flags[@]}" --threads 1 \
      --json "$work/$shape-cpp2.json"
    echo "== $shape: Python, PyTorch 2.6 =="
    scripts/debian13.sh python3 scripts/bench_generate.py "${flags[@]}" --threads 1 \
      --json "$work/$shape-py2.json"
  fi
done
echo "== side by side (tokens/s, medians) =="
"$python" - "$work" $shapes <<'EOF'
import json, os, sys
work, shapes = sys.argv[1], sys.argv[2:]
print("| shape | LibTorch | C++ cached | C++ uncached | C++ cached/uncached | Python cached | Python uncached | C++ cached / Python cached |")
print("|---|---|---|---|---|---|---|---|")
for shape in shapes:
    for leg in ("1", "2"):
        cpp, py = (os.path.join(work, f"{shape}-{lang}{leg}.json") for lang in ("cpp", "py"))
        if not os.path.exists(cpp):
            continue
        c, p = json.load(open(cpp)), json.load(open(py))
        print(f"| {shape} | {c['torch']} | {c['cached_tokens_per_s']:.1f} | {c['uncached_tokens_per_s']:.1f} "
              f"| {c['cached_tokens_per_s'] / c['uncached_tokens_per_s']:.2f}x | {p['cached_tokens_per_s']:.1f} "
              f"| {p['uncached_tokens_per_s']:.1f} | {c['cached_tokens_per_s'] / p['cached_tokens_per_s']:.2f}x |")
EOF
