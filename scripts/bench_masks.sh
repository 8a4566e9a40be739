#!/usr/bin/env bash
# Issue 26's mask targets, side by side in one run: attnkit-bench's core implementations
# (attention alone, x (b, n, d) viewed as (b, h, n, hd), forward+backward medians) with
# attnkit::Mask kinds and score functions, against the same problem with a dense mask, and
# against PyTorch 2.6's F.scaled_dot_product_attention with that dense mask
# (scripts/bench_masks_sdpa.py, in the Debian 13 root). Prints each measurement's line and
# then the ratios the targets name.
# Usage: scripts/bench_masks.sh [--libtorch2] [--threads 1,2] [--tokens 16384] [--repeats 3]
#                               [--causal-tokens 4096]
#   --libtorch2  also attnkit on LibTorch 2.6, and the PyTorch 2.6 SDPA baselines
#   --tokens     the document target's n (16,384 in the issue; 16 documents of n / 16)
#   --causal-tokens  the long causal mask_mod case's n (issue: 16,384; default 4,096, since
#                one forward+backward of full causal attention at 16,384 takes minutes here)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bench_setup.sh
python=${ATTNKIT_PYTHON:-/usr/bin/python3}
thread_counts=1,2
libtorch2=false
tokens=16384
repeats=3
causal_tokens=4096
while (($#)); do
  case "$1" in
    --threads) thread_counts=${2:?--threads needs a list, e.g. 1,2}; shift 2 ;;
    --libtorch2) libtorch2=true; shift ;;
    --tokens) tokens=${2:?--tokens needs a number}; shift 2 ;;
    --repeats) repeats=${2:?--repeats needs a number}; shift 2 ;;
    --causal-tokens) causal_tokens=${2:?--causal-tokens needs a number}; shift 2 ;;
    *) echo "bench_masks: unknown argument $1" >&2; exit 2 ;;
  esac
done
bench_setup "$libtorch2" bench-masks
legs=("1.13:build/apps/attnkit-bench")
$libtorch2 && legs+=("2.6:scripts/debian13.sh build-libtorch2/apps/attnkit-bench")
doc_len=$((tokens / 16))

# One forward+backward median (ms) of attnkit-bench: LEG THREADS NAME ARGS...
cpp() {
  local leg=$1 threads=$2 name=$3 bench=${legs_by_name[$1]}
  shift 3
  local json="$work/$leg-$threads-$name.json"
  $bench --threads "$threads" --repeats "$repeats" --d-model 768 --heads 12 "$@" \
    --json "$json" >/dev/null
  "$python" -c 'import json, sys
r = [x for x in json.load(open(sys.argv[1]))["results"] if x["pass"] == "forward+backward"]
print("%.1f" % r[0]["median_ms"])' "$json"
}
declare -A legs_by_name
for leg in "${legs[@]}"; do legs_by_name[${leg%%:*}]=${leg#*:}; done

ratio() { "$python" -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}x')" "$1" "$2"; }

for threads in ${thread_counts//,/ }; do
  sdpa_documents="" sdpa_padded=""
  if $libtorch2; then
    sdpa_documents=$(scripts/debian13.sh python3 scripts/bench_masks_sdpa.py --mask documents:16 \
      --batch 1 --tokens "$tokens" --threads "$threads" --repeats 1 --warmup 0 | sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p')
    sdpa_padded=$(scripts/debian13.sh python3 scripts/bench_masks_sdpa.py --mask padded \
      --batch 8 --tokens 1024 --causal false --threads "$threads" --repeats "$repeats" |
      sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p')
  fi
  for leg in "${!legs_by_name[@]}"; do
    echo "== LibTorch $leg, $threads thread(s); forward+backward medians in ms =="
    documents=$(cpp "$leg" "$threads" documents --only chunked-core --batch 1 --tokens "$tokens" --mask documents:16)
    separate=$(cpp "$leg" "$threads" separate --only chunked-core --batch 16 --tokens "$doc_len")
    padded=$(cpp "$leg" "$threads" padded --only chunked-core --batch 8 --tokens 1024 --causal=false --mask padded)
    padded_dense=$(cpp "$leg" "$threads" padded-dense --only chunked-core --batch 8 --tokens 1024 --causal=false --mask padded-dense)
    padded_math=$(cpp "$leg" "$threads" padded-math --only math-core --batch 8 --tokens 1024 --causal=false --mask padded-dense)
    echo "document mask, n $tokens as 16 documents: chunked $documents; 16 separate causal sequences $separate -> $(ratio "$separate" "$documents") (target >= 0.8x)"
    [ -n "$sdpa_documents" ] && echo "  vs PyTorch 2.6 SDPA with the dense mask $sdpa_documents -> $(ratio "$sdpa_documents" "$documents") (target >= 8x)"
    echo "padded batch, b 8, n 1024: key_padding $padded; dense bool mask chunked $padded_dense -> $(ratio "$padded_dense" "$padded"), math $padded_math -> $(ratio "$padded_math" "$padded") (target >= 1.5x)"
    [ -n "$sdpa_padded" ] && echo "  vs PyTorch 2.6 SDPA with the dense mask $sdpa_padded -> $(ratio "$sdpa_padded" "$padded") (target >= 1.2x)"
    for n in 1024 "$causal_tokens"; do
      b=$((n == 1024 ? 8 : 1))
      causal=$(cpp "$leg" "$threads" causal-$n --only chunked-core --batch "$b" --tokens "$n" --mask module)
      causal_mod=$(cpp "$leg" "$threads" causal-mod-$n --only chunked-core --batch "$b" --tokens "$n" --mask causal-mod)
      echo "causal mask_mod, b $b n $n: Mask::causal() $causal; mask_mod $causal_mod -> $(ratio "$causal_mod" "$causal") of causal (target <= 1.15x)"
    done
    plain=$(cpp "$leg" "$threads" plain --only chunked-core --batch 8 --tokens 1024)
    for score in alibi softcap; do
      scored=$(cpp "$leg" "$threads" "$score" --only chunked-core --batch 8 --tokens 1024 --score "$score")
      echo "score function $score, b 8 n 1024 causal: plain $plain; $score $scored -> $(ratio "$scored" "$plain") of plain (target <= 1.5x)"
    done
  done
done
