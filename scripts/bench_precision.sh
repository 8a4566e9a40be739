#!/usr/bin/env bash
# Issue 44's precision target, in one run: the errors of every attnkit backend in bfloat16 and
# float16 against float64, for causal, key-padding and document masks and a softcap, as
# multiples of the float32 floor (attnkit-bench --precision), on LibTorch 1.13 and (with
# --libtorch2) 2.6; there also PyTorch 2.6's own CPU F.scaled_dot_product_attention (causal)
# on the same measure, as the comparison.
# Usage: scripts/bench_precision.sh [--libtorch2] [--tokens 4096] [--threads 2]
#   the issue's shape: b 1, 2 heads, head width 64, n 4,096
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
tokens=4096
threads=2
libtorch2=false
while (($#)); do
  case "$1" in
    --libtorch2) libtorch2=true; shift ;;
    --tokens) tokens=${2:?--tokens needs a number}; shift 2 ;;
    --threads) threads=${2:?--threads needs a number}; shift 2 ;;
    *) echo "bench_precision: unknown argument $1" >&2; exit 2 ;;
  esac
done
bench_setup "$libtorch2" bench-precision
legs=("build/apps/attnkit-bench")
$libtorch2 && legs+=("scripts/debian13.sh build-libtorch2/apps/attnkit-bench")
shape=(--batch 1 --heads 2 --d-model 128 --tokens "$tokens" --threads "$threads")
documents=$((tokens / 512))
for leg in "${legs[@]}"; do
  for dtype in bfloat16 float16; do
    for mask in "--mask module" "--mask padded" "--mask documents:$documents" \
                "--mask module --score softcap"; do
      # shellcheck disable=SC2086  # the leg and the mask are word lists
      $leg --precision --dtype "$dtype" "${shape[@]}" $mask || echo "(failed: $leg $dtype $mask)"
      echo
    done
  done
done
if $libtorch2; then
  echo "PyTorch 2.6, F.scaled_dot_product_attention on the CPU, causal, the same measure:"
  scripts/debian13.sh python3 - "$tokens" "$threads" <<'EOF'
import sys
import torch
import torch.nn.functional as F

n, threads = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)


def run(q, k, v, probe):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (out * probe.to(out.dtype)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def error(got, exact):
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


for dtype in (torch.bfloat16, torch.float16):
    q, k, v, probe = (torch.randn(1, 2, n, 64).to(dtype) for _ in range(4))
    exact = run(q.double(), k.double(), v.double(), probe)
    floor = [error(t.to(dtype), e) for t, e in zip(run(q.float(), k.float(), v.float(), probe), exact)]
    got = [error(t, e) for t, e in zip(run(q, k, v, probe), exact)]
    print(f"{dtype}: output {got[0]:.4f} ({got[0] / floor[0]:.2f}x the floor), gradients "
          f"up to {max(got[1:]):.4f} ({max(g / f for g, f in zip(got[1:], floor[1:])):.2f}x)")
EOF
fi
