#!/usr/bin/env bash
# Issue 44's CPU targets for 16-bit attention, in one run, on LibTorch 1.13 and (with
# --libtorch2) 2.6:
#   precision: the errors of every attnkit backend in bfloat16 and float16 against float64,
#     for causal, key-padding and document masks and a softcap, as multiples of the float32
#     floor (attnkit-bench --precision; b 1, 2 heads, head width 64, n --tokens); with
#     --libtorch2 also PyTorch 2.6's own CPU F.scaled_dot_product_attention (causal) on the
#     same measure;
#   speed: the chunked attention core (b 8, n 1,024, causal, d 768, 12 heads) in bfloat16
#     against float32, forward and forward+backward medians, --turns alternating turns;
#   training: attnkit-train's default text task and copy task in float32, in bfloat16 with a
#     working copy and in bfloat16 under autocast (bits per byte or accuracy, tokens/s), on
#     each leg.
# Usage: scripts/bench_16bit.sh [--libtorch2] [--tokens 4096] [--threads 2] [--turns 3]
#                               [--skip precision,speed,training]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
tokens=4096
threads=2
turns=3
skip=""
libtorch2=false
while (($#)); do
  case "$1" in
    --libtorch2) libtorch2=true; shift ;;
    --tokens) tokens=${2:?--tokens needs a number}; shift 2 ;;
    --threads) threads=${2:?--threads needs a number}; shift 2 ;;
    --turns) turns=${2:?--turns needs a number}; shift 2 ;;
    --skip) skip=${2:?--skip needs a list of parts}; shift 2 ;;
    *) echo "bench_16bit: unknown argument $1" >&2; exit 2 ;;
  esac
done
bench_setup "$libtorch2" bench-16bit
legs=("build/apps/attnkit-bench")
$libtorch2 && legs+=("scripts/debian13.sh build-libtorch2/apps/attnkit-bench")
shape=(--batch 1 --heads 2 --d-model 128 --tokens "$tokens" --threads "$threads")
documents=$((tokens / 512))
runs() { [[ ",$skip," != *",$1,"* ]]; }
runs precision && for leg in "${legs[@]}"; do
  for dtype in bfloat16 float16; do
    for mask in "--mask module" "--mask padded" "--mask documents:$documents" \
                "--mask module --score softcap"; do
      # shellcheck disable=SC2086  # the leg and the mask are word lists
      $leg --precision --dtype "$dtype" "${shape[@]}" $mask || echo "(failed: $leg $dtype $mask)"
      echo
    done
  done
done
if runs precision && $libtorch2; then
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

if runs speed; then
  echo "Speed: chunked-core, b 8, n 1,024, causal, $threads thread(s), $turns alternating turns"
  for leg in "${legs[@]}"; do
    for turn in $(seq "$turns"); do
      for dtype in float32 bfloat16; do
        # shellcheck disable=SC2086
        $leg --only chunked-core --dtype "$dtype" --threads "$threads" --repeats 3 |
          grep -E "^chunked-core" | sed "s|^|turn $turn $dtype ${leg##* }: |"
      done
    done
  done
fi
if runs training; then
  scripts/build.sh --target attnkit-train >/dev/null
  trainers=("1.13:build/apps/attnkit-train")
  if $libtorch2; then
    scripts/debian13.sh cmake --build --preset libtorch2 --target attnkit-train >/dev/null
    trainers+=("2.6:scripts/debian13.sh build-libtorch2/apps/attnkit-train")
  fi
  for trainer in "${trainers[@]}"; do
    leg=${trainer%%:*} train=${trainer#*:}
    for precision in "float32" "bfloat16" "bfloat16 --autocast"; do
      echo "attnkit-train --task text --dtype $precision --threads $threads ($leg):"
      # shellcheck disable=SC2086  # the trainer and "bfloat16 --autocast" are word lists
      $train --task text --dtype $precision --threads "$threads" | grep -E "^done|^corpus"
    done
    for precision in "float32" "bfloat16" "bfloat16 --autocast"; do
      echo "attnkit-train --dtype $precision (copy) --threads $threads ($leg):"
      # shellcheck disable=SC2086
      $train --dtype $precision --threads "$threads" | grep -E "^done"
    done
  done
fi
