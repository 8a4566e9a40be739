#!/usr/bin/env bash
# Runs attnkit-train the way a user would and checks exit codes and messages:
# every bad input is one line on stderr, exit 2, no stack dump (signals: signals_test.sh).
# Usage: tests/cli_test.sh PATH/TO/attnkit-train SOURCE_DIR LIBTORCH_VERSION
set -u
train=$1
source_dir=$2
libtorch_version=${3:?the LibTorch version attnkit-train was built with, e.g. 2.6.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
checks=0

# expect CODE MESSAGE_PART -- ARGS...
expect() {
  local code=$1 part=$2
  shift 3
  checks=$((checks + 1))
  "$train" "$@" >"$work/out" 2>"$work/err"
  local got=$?
  local lines
  lines=$(wc -l <"$work/err")
  if [ "$got" -ne "$code" ] || { [ -n "$part" ] && ! grep -qF -- "$part" "$work/err"; } ||
     { [ "$code" -eq 2 ] && [ "$lines" -ne 1 ]; } || grep -q "Exception raised from" "$work/err"; then
    echo "FAIL: attnkit-train $* -> exit $got (expected $code), stderr:"
    sed 's/^/    /' "$work/err"
    failures=$((failures + 1))
  else
    echo "ok: attnkit-train $* -> exit $got: $(head -c 160 "$work/err")"
  fi
}

# expect_stdout LABEL PATTERN... -- ARGS...: exit 0 and a stdout line matching each extended
# regular expression; the ok line shows what the first one matched.
expect_stdout() {
  local label=$1 patterns=() pattern missing=""
  shift
  while [ "$1" != "--" ]; do patterns+=("$1"); shift; done
  shift
  checks=$((checks + 1))
  if "$train" "$@" >"$work/out" 2>"$work/err"; then
    for pattern in "${patterns[@]}"; do
      grep -qE -- "$pattern" "$work/out" || missing="$pattern"
    done
  else
    missing="exit 0"
  fi
  if [ -z "$missing" ]; then
    echo "ok: $label: $(grep -oE -- "${patterns[0]}" "$work/out" | head -n 1)"
  else
    echo "FAIL: $label (no '$missing'), stdout and stderr:"
    sed 's/^/    /' "$work/out" "$work/err"
    failures=$((failures + 1))
  fi
}

quick=(--steps 4 --eval-every 2 --d-model 16 --heads 2 --batch-size 8 --threads 1)
# Flags: attnkit's own messages, whatever the cxxopts version.
expect 2 "unknown flag '--bogus' (see --help)" -- --bogus
expect 2 "unknown flag '-x' (see --help)" -- -x
expect 2 "unexpected argument 'copy' (see --help)" -- copy
expect 2 "--steps: expected a value after it (see --help)" -- --steps
expect 2 "--steps: expected an integer, got 'many'" -- --steps many
expect 2 "--steps: expected an integer, got '10.5'" -- --steps=10.5
expect 2 "--lr: expected a number, got 'fast'" -- --lr fast
expect 2 "--seed: expected an integer >= 0, got '-1'" -- --seed -1
expect 2 "--quiet takes no value, got '--quiet=yes'" -- --quiet=yes
expect 2 "--task: unknown task 'nope'" -- --task nope
expect 2 "--module: unknown module 'nope'" -- --module nope
expect 2 "--data: cannot read '$work/missing.txt'" -- --task text --data "$work/missing.txt"
: >"$work/empty.txt"
expect 2 "--data: '$work/empty.txt' is empty" -- --task text --data "$work/empty.txt"
expect 2 "--device cuda:99: " -- --device cuda:99
expect 2 "--seq-len: expected 1..512 for task copy, got 600" -- --seq-len 600
expect 2 "--module sa-v2 has no causal mask" -- --task copy --module sa-v2
expect 2 "--module mha-wrapper always applies a causal mask" -- --task reverse --module mha-wrapper
expect 2 "--d-model 30 must be divisible by --heads 4" -- --d-model 30
expect 2 "--backend: unknown backend 'flash'; expected math, fused or chunked" -- --backend flash
# The memory budget: a run that cannot fit is refused before its first step, naming the flags.
expect 2 "--batch-size 2000000 --seq-len 8 (context 16) --layers 1 --d-model 64: this run (weights, gradients and AdamW state 170 kB; a step's activations 35.6 GB; both lower bounds) needs 35.6 GB, over attnkit's memory budget of" \
  -- --batch-size 2000000 --memory-budget 30
expect 2 "use a smaller --batch-size, --seq-len, --layers or --d-model, or raise the budget with --memory-budget GB" \
  -- --batch-size 2000000
expect 2 "--layers 1000 --d-model 4096: this run (weights, gradients and AdamW state 537 GB; a step's activations 67.1 GB; both lower bounds) needs 604 GB, over attnkit's memory budget of 4.00 GB (--memory-budget); use fewer --layers or a smaller --d-model" \
  -- --layers 1000 --d-model 4096 --memory-budget 4
expect 2 "--memory-budget: expected GB in 0..1e9 (0 = half of physical memory), got -1" -- --memory-budget -1
expect 2 "--backend fused: only mha, mha-combined, gqa, mqa and mla have backends; --module causal has one implementation" \
  -- --module causal --backend fused
expect 0 "" -- "${quick[@]}" --module mha-combined --backend chunked --quiet

# The attention family: each size flag only where the module has that size.
expect 0 "" -- "${quick[@]}" --module gqa --kv-groups 2 --window 3 --backend chunked --quiet
expect 0 "" -- "${quick[@]}" --module mqa --quiet
expect 0 "" -- "${quick[@]}" --module mla --latent-dim 8 --quiet
expect 2 "--kv-groups 3 must divide --heads 4 for --module gqa" -- --module gqa --kv-groups 3
expect 2 "--kv-groups 2: only --module gqa has a choice of key/value groups (mqa has 1), got --module mqa" \
  -- --module mqa --kv-groups 2
expect 2 "--window: expected >= 1 (0 = no window), got -2" -- --window -2
expect 2 "--window 4: only mha, mha-combined, gqa and mqa have a sliding window, got --module mla" \
  -- --module mla --window 4
expect 2 "--window 4 limits how far back a token looks, so it needs a causal task" \
  -- --task reverse --window 4
expect 2 "--module gqa always applies a causal mask" -- --task reverse --module gqa
expect 2 "--latent-dim 8: only --module mla has a latent, got --module mha" -- --latent-dim 8
expect 2 "--steps: expected >= 1" -- --steps -5
expect 2 "--save: cannot write '$work/no/such/dir/run.pt' (does its directory exist?)" \
  -- --save "$work/no/such/dir/run.pt"
expect 2 "--metrics: cannot write" -- --metrics "$work/no/such/dir/m.jsonl"
# A directory where a file belongs is refused before training, for each flag that names one.
mkdir -p "$work/a_directory"
for flag in --save --metrics --resume; do
  expect 2 "$flag: '$work/a_directory' is a directory; expected a file" \
    -- "${quick[@]}" "$flag" "$work/a_directory"
done
expect 2 "--data: '$work/a_directory' is a directory; expected a file" \
  -- --task text --data "$work/a_directory"
expect 2 "--prompts: '$work/a_directory' is a directory; expected a file" \
  -- --task text --sample 5 --prompts "$work/a_directory"
# A report that cannot be written (standard output on a full disk) is not a success.
checks=$((checks + 1))
if "$train" "${quick[@]}" >/dev/full 2>"$work/err"; then
  echo "FAIL: attnkit-train with standard output on /dev/full exited 0"
  failures=$((failures + 1))
elif grep -qF "writing the report to standard output failed (is the disk full?)" "$work/err"; then
  echo "ok: standard output on /dev/full: $(head -c 160 "$work/err")"
else
  echo "FAIL: standard output on /dev/full, stderr:"
  sed 's/^/    /' "$work/err"
  failures=$((failures + 1))
fi
expect 2 "--threads 100000: this process may use" -- --threads 100000
expect 2 "--lr: expected at most 3.40282e+38 (float32's largest value), got 1e+300" -- --lr 1e300
if "$train" --device cuda --steps 1 >/dev/null 2>&1; then :; else
  expect 2 "--device cuda: CUDA is not available" -- --device cuda
fi

# --sample: generated with attnkit::generate, KV caches by default; refusals name the fix.
text=(--task text --data "$source_dir/data/the-verdict.txt")
expect 2 "--sample: only the text task generates, got --task copy" -- --sample 10
expect 2 "--sample with --module causal: only mha, mha-combined, gqa, mqa and mla have a KV cache; add --no-kv-cache" \
  -- "${text[@]}" --module causal --sample 10
for cache in "" --no-kv-cache; do
  label=$([ -z "$cache" ] && echo "KV cache" || echo "no KV cache")
  # 16 prompt bytes + 100 pass the 64-byte context: the cached run refills its caches.
  expect_stdout "--sample 100 $cache" "^sample \(100 bytes, $label, [0-9]+ tokens/s\): \[" \
    -- "${quick[@]}" "${text[@]}" --sample 100 $cache
done
expect 0 "" -- "${quick[@]}" "${text[@]}" --module causal --sample 20 --no-kv-cache --quiet
# Rolling (window) and latent caches, past the 64-byte context too.
expect 0 "" -- "${quick[@]}" "${text[@]}" --module gqa --window 8 --sample 80 --quiet
expect 0 "" -- "${quick[@]}" "${text[@]}" --module mla --sample 80 --quiet

# --prompts: every line continued in one batch; the lines and their continuations printed.
printf 'I had always\nThe \n\nGisburn was a man who\n' >"$work/prompts"
: >"$work/empty"
expect_stdout "--sample 70 --prompts (3 lines)" \
  "^samples \(3 prompts in one batch, 70 bytes each, KV cache, [0-9]+ tokens/s\):$" \
  "^\[I had always\]" "^\[The \]" "^\[Gisburn was a man who\]" \
  -- "${quick[@]}" "${text[@]}" --sample 70 --prompts "$work/prompts"
expect 2 "--prompts: give --sample N, the bytes to generate for each line" \
  -- "${text[@]}" --prompts "$work/prompts"
expect 2 "--prompts: cannot read '$work/missing'" -- "${text[@]}" --sample 5 --prompts "$work/missing"
expect 2 "--prompts: '$work/empty' has no non-empty line" \
  -- "${text[@]}" --sample 5 --prompts "$work/empty"
expect 2 "--prompts: the lines are decoded together with KV caches; drop --no-kv-cache" \
  -- "${text[@]}" --sample 5 --prompts "$work/prompts" --no-kv-cache
# The rolling (sliding-window) and latent caches decode lines of different lengths too.
for cache in "--module gqa --window 8" "--module mla"; do
  # shellcheck disable=SC2086  # $cache is two flags
  expect_stdout "--prompts with $cache" \
    "^samples \(3 prompts in one batch, 70 bytes each, KV cache, [0-9]+ tokens/s\):$" \
    "^\[Gisburn was a man who\]" -- "${quick[@]}" "${text[@]}" $cache --sample 70 --prompts "$work/prompts"
done

# --rope, --qk-norm: the modules that take them; a checkpoint remembers them.
expect 2 "--rope: only mha, mha-combined, gqa and mqa take it, got --module mla" \
  -- "${text[@]}" --module mla --rope
expect 2 "--qk-norm: only mha, mha-combined, gqa and mqa take it, got --module causal" \
  -- "${text[@]}" --module causal --qk-norm
expect 2 "--rope rotates pairs of a head's features, so d-model / heads must be even, got 18 / 2 = 9" \
  -- "${text[@]}" --rope --d-model 18 --heads 2
expect 0 "" -- "${quick[@]}" "${text[@]}" --module gqa --rope --qk-norm --sample 30 --save "$work/rope.pt" --quiet
expect 2 "--resume: incompatible checkpoint '$work/rope.pt': it was trained with --rope true, this run has --rope false" \
  -- "${quick[@]}" "${text[@]}" --module gqa --resume "$work/rope.pt"
expect 0 "" -- "${quick[@]}" "${text[@]}" --steps 6 --module gqa --rope --qk-norm --resume "$work/rope.pt" --quiet

# Checkpoints: an incompatible or foreign one is refused.
expect 0 "" -- "${quick[@]}" --save "$work/run.pt" --quiet
expect 2 "incompatible checkpoint '$work/run.pt': it was trained with --module mha, this run has --module causal" \
  -- "${quick[@]}" --module causal --resume "$work/run.pt"
expect 2 "incompatible checkpoint '$work/run.pt': it was trained with --window 0, this run has --window 4" \
  -- "${quick[@]}" --window 4 --resume "$work/run.pt"
# The data stream may change on a resume (--data, --pack, --seed), and the banner says how.
expect_stdout "a resume with another seed says so" \
  "resumed from .*run\.pt at step 4; it was trained with --seed 1, this run has --seed 2$" \
  -- "${quick[@]}" --steps 6 --seed 2 --resume "$work/run.pt"
expect_stdout "a resume with the same data says nothing of it" "resumed from .*run\.pt at step 4$" \
  -- "${quick[@]}" --steps 6 --resume "$work/run.pt"
echo "garbage" >"$work/foreign.pt"
expect 2 "is not an attnkit-train checkpoint" -- "${quick[@]}" --resume "$work/foreign.pt"

# A loss that becomes NaN stops training with exit 1 and keeps the last good checkpoint.
cp "$work/run.pt" "$work/nan.pt"
expect 1 "became NaN at step 1; training stopped; nothing was saved" \
  -- "${quick[@]}" --lr 1e30 --eval-every 1 --save "$work/nan.pt"
cmp -s "$work/run.pt" "$work/nan.pt" || { echo "FAIL: the good checkpoint was overwritten"; failures=$((failures + 1)); }
expect 0 "" -- "${quick[@]}" --steps 6 --resume "$work/nan.pt" --quiet

# Mixed precision (--dtype): bad names, float16 where the CPU has no float16 matrix product,
# the working copy with data-parallel ranks, --autocast without a 16-bit dtype; bfloat16 learns
# the copy task, with a working copy and under autocast; its checkpoint resumes in float32 and
# the banner says so.
expect 2 "--dtype: expected float32, bfloat16 or float16, got 'int8'" -- "${quick[@]}" --dtype int8
expect 2 "--dtype bfloat16 with 2 ranks: the 16-bit working copy trains in one process; add --autocast" \
  -- "${quick[@]}" --dtype bfloat16 --nproc 2
expect 2 "--autocast: give the dtype it runs in, --dtype bfloat16 or float16 (got --dtype float32)" \
  -- "${quick[@]}" --autocast
expect_stdout "--dtype bfloat16 --autocast learns copy" "accuracy 100\.00%" \
  "dtype +\| bfloat16 autocast \(linear layers; attention computed in float32 inside\); float32 weights, gradients and AdamW state" \
  -- --dtype bfloat16 --autocast --steps 300 --eval-every 300 --threads 1
expect_stdout "--dtype bfloat16 learns copy" "accuracy 100\.00%" \
  "dtype +\| bfloat16 forward and backward; float32 weights and AdamW state" \
  -- --dtype bfloat16 --steps 300 --eval-every 300 --threads 1 --save "$work/bf16.pt"
expect_stdout "a bfloat16 checkpoint resumed in float32" \
  "resumed from .*bf16\.pt at step 300 \(its steps ran in bfloat16; this run continues in float32\)" \
  -- --steps 302 --eval-every 301 --threads 1 --resume "$work/bf16.pt"
if [ "${libtorch_version%%.*}" -lt 2 ]; then
  expect 2 "--dtype float16: this LibTorch has no float16 matrix products on the CPU" \
    -- "${quick[@]}" --dtype float16
else
  expect_stdout "--dtype float16 with loss scaling" "accuracy 100\.00%" \
    "dtype +\| float16 forward and backward; float32 weights and AdamW state, dynamic loss scaling" \
    -- --dtype float16 --steps 300 --eval-every 300 --threads 1
  expect_stdout "--dtype float16 --autocast with loss scaling" "accuracy 100\.00%" \
    "dtype +\| float16 autocast .*, dynamic loss scaling" \
    -- --dtype float16 --autocast --steps 300 --eval-every 300 --threads 1
fi

# --help (its groups in this order, then three examples) and --version.
checks=$((checks + 1))
groups=$("$train" --help | sed -n 's/^ \([A-Za-z-]*\) options:$/\1/p; s/^ Examples:$/Examples/p' | paste -sd' ')
examples=$("$train" --help | grep -c '^  attnkit-train --')
if [ "$groups" = "Task Model Training Data-parallel Output Examples" ] && [ "$examples" -eq 3 ] &&
  "$train" --version | grep -q "attnkit-train "; then
  echo "ok: --help and --version"
else
  echo "FAIL: --help or --version (help groups: '$groups', $examples examples)"
  failures=$((failures + 1))
fi

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
