#!/usr/bin/env bash
# Data-parallel attnkit-train on two processes over loopback (c10d, Gloo): the same losses as
# one process on the same examples, resume, and the faults: a rank killed, SIGINT to the
# launcher, a port in use, an incomplete environment, ranks started with different flags.
# Usage: tests/distributed_test.sh PATH/TO/attnkit-train SOURCE_DIR [--gpu-only]
#   --gpu-only: only the GPU section at the end (scripts/gpu_check.sh; it fails without a GPU).
set -u
train=$1
cd "$2" || exit 1
work=$(mktemp -d)
launcher=""
trap '[ -n "$launcher" ] && kill -9 "$launcher" 2>/dev/null; rm -rf "$work"' EXIT
failures=0

pass() { echo "ok: $*"; }
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# Whether FILE has a line that is all of the extended regular expression LINE.
has_line() { grep -qxE -- "$2" "$1"; }

# Column `column` (1-based) of a metrics CSV without its header and final line.
column() { awk -F, -v c="$2" 'NR > 1 && $7 == "false" { print $c }' "$1"; }

# Whether two files of numbers agree line by line to a relative `tolerance`.
agree() {
  paste -d' ' "$1" "$2" | awk -v tol="$3" '
    { n++; d = $1 - $2; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2
      if (d > tol * (s > 1e-12 ? s : 1e-12)) { bad++; if (bad == 1) print "  line " n ": " $1 " vs " $2 } }
    END { exit (n == 0 || bad > 0) }'
}

# Trains ARGS for STEPS steps on one process and on two ranks (adding the array two_ranks),
# and passes when the held-out losses after every step agree to TOLERANCE (relative).
# Usage: ranks_match_one_process NAME STEPS TOLERANCE ARGS...
ranks_match_one_process() {
  local name=$1 steps=$2 tolerance=$3 file=${1//[^a-z0-9]/_}
  shift 3
  "$train" "$@" --steps "$steps" --eval-every 1 --metrics "$work/$file.1.csv" >/dev/null \
    2>"$work/err" || fail "$name, one process: $(cat "$work/err")"
  "$train" "$@" --steps "$steps" --eval-every 1 --metrics "$work/$file.2.csv" --nproc 2 \
    ${two_ranks[@]+"${two_ranks[@]}"} >/dev/null 2>"$work/err" ||
    fail "$name, --nproc 2: $(cat "$work/err")"
  column "$work/$file.1.csv" 2 >"$work/$file.1"
  column "$work/$file.2.csv" 2 >"$work/$file.2"
  if [ "$(wc -l <"$work/$file.2")" -eq "$steps" ] && agree "$work/$file.1" "$work/$file.2" "$tolerance"; then
    pass "$name: 2 ranks match 1 process over $steps steps (held-out loss, $tolerance relative)"
  else
    fail "$name: 2 ranks differ from 1 process"
  fi
}

two_ranks=()
base=(--task copy --d-model 32 --heads 4 --threads 1 --quiet --batch-size 64)
small=("${base[@]}" --device cpu)

gpu_only=false
[ "${3:-}" = --gpu-only ] && gpu_only=true

if ! $gpu_only; then  # every section up to the GPU's
# ---- the same losses as one process on the same examples ---------------------------------
"$train" "${small[@]}" --steps 50 --eval-every 1 --metrics "$work/one.csv" >/dev/null 2>"$work/err" ||
  fail "one process: $(cat "$work/err")"
"$train" "${small[@]}" --steps 50 --eval-every 1 --metrics "$work/two.csv" --nproc 2 \
  >"$work/out" 2>"$work/err" || fail "--nproc 2: $(cat "$work/err")"
for c in 2 4; do  # held-out loss after every step, smoothed training loss
  column "$work/one.csv" $c >"$work/one.$c"
  column "$work/two.csv" $c >"$work/two.$c"
  if [ "$(wc -l <"$work/two.$c")" -eq 50 ] && agree "$work/one.$c" "$work/two.$c" 1e-5; then
    pass "2 ranks match 1 process over 50 steps (metrics column $c, 1e-5 relative)"
  else
    fail "2 ranks differ from 1 process (metrics column $c)"
  fi
done
# Buckets started during backward (1 KB: several per layer) sum the same gradients.
"$train" "${small[@]}" --steps 50 --eval-every 1 --metrics "$work/buckets.csv" --nproc 2 \
  --bucket-mb 0.001 >/dev/null 2>"$work/err" || fail "--bucket-mb 0.001: $(cat "$work/err")"
column "$work/buckets.csv" 2 >"$work/buckets.2"
if [ "$(wc -l <"$work/buckets.2")" -eq 50 ] && agree "$work/one.2" "$work/buckets.2" 1e-5; then
  pass "2 ranks with gradient buckets (--bucket-mb 0.001) match 1 process over 50 steps"
else
  fail "2 ranks with gradient buckets differ from 1 process"
fi
# bfloat16 under autocast: backward writes float32 gradients, which the ranks sum as above.
# 1e-3, not 1e-5: the ranks' bfloat16 products over half the batch round apart from one
# process's (4e-5 apart over 30 steps here).
ranks_match_one_process "bfloat16 autocast" 30 1e-3 "${small[@]}" --dtype bfloat16 --autocast
grep -q "on 2 ranks, gradient allreduce" "$work/out" &&
  pass "rank 0 reports the allreduce's share" || fail "no allreduce share in: $(cat "$work/out")"

# ---- resume: interrupted and resumed = uninterrupted (with dropout: every rank's stream) ----
dropout=("${small[@]}" --dropout 0.2 --eval-every 1 --nproc 2)
"$train" "${dropout[@]}" --steps 12 --metrics "$work/whole.csv" >/dev/null 2>&1
"$train" "${dropout[@]}" --steps 6 --save "$work/half.pt" >/dev/null 2>&1
"$train" "${dropout[@]}" --steps 12 --resume "$work/half.pt" --metrics "$work/resumed.csv" \
  >/dev/null 2>"$work/err" || fail "resume: $(cat "$work/err")"
awk -F, 'NR > 7 && $7 == "false" { print $2 }' "$work/whole.csv" >"$work/whole.2"
column "$work/resumed.csv" 2 >"$work/resumed.2"
if [ "$(wc -l <"$work/resumed.2")" -eq 6 ] && agree "$work/whole.2" "$work/resumed.2" 1e-6; then
  pass "2 ranks resumed at step 6 (dropout 0.2) = uninterrupted, steps 7-12"
else
  fail "resumed run differs from the uninterrupted one"
fi

# Starts a long 2-rank run in the background with --save; waits for its first checkpoint.
start_long_run() {
  rm -f "$work/long.pt"
  "$train" "${small[@]}" --steps 100000 --eval-every 5 --save "$work/long.pt" --nproc 2 \
    >"$work/long.out" 2>"$work/long.err" &
  launcher=$!
  for _ in $(seq 300); do
    [ -f "$work/long.pt" ] && return 0
    sleep 0.1
  done
  fail "the long run wrote no checkpoint in 30 s: $(cat "$work/long.err")"
}

# Waits up to `seconds` for the launcher; sets `code` to its exit status (-1: still running).
wait_launcher() {
  code=-1
  for _ in $(seq $(($1 * 10))); do
    if ! kill -0 "$launcher" 2>/dev/null; then
      wait "$launcher"
      code=$?
      launcher=""
      return
    fi
    sleep 0.1
  done
}

# ---- a rank killed ---------------------------------------------------------------------
start_long_run
rank1=$(pgrep -P "$launcher" | sed -n 2p)
kill -9 "$rank1"
wait_launcher 60
# Whole lines: the launcher's and rank 0's messages, each on a line of its own (they once came
# out cut into each other, each `<<` its own write()).
if [ "$code" -ne 0 ] && [ "$code" -ne -1 ] &&
   has_line "$work/long.err" "attnkit-train: rank 1 was killed by signal 9 \(Killed\); waiting up to 60 s for the other ranks to stop" &&
   has_line "$work/long.err" "attnkit-train: rank 0: lost rank 1 .*"; then
  pass "rank 1 killed: exit $code, rank 0 names the lost rank"
else
  fail "rank 1 killed: exit $code, stderr: $(cat "$work/long.err")"
fi
if "$train" "${small[@]}" --steps 1 --resume "$work/long.pt" >/dev/null 2>"$work/err"; then
  pass "the last checkpoint before the kill is intact"
else
  fail "checkpoint after the kill: $(cat "$work/err")"
fi

# ---- SIGINT to the launcher --------------------------------------------------------------
start_long_run
kill -INT "$launcher"
wait_launcher 60
if [ "$code" -eq 130 ] && has_line "$work/long.err" "attnkit-train: interrupted at step [0-9]+; saved to .*/long\.pt"; then
  pass "SIGINT: every rank finished its step, rank 0 saved, exit 130"
else
  fail "SIGINT: exit $code, stderr: $(cat "$work/long.err")"
fi

# ---- bad environments and flags: one clear error each, exit 2 ----------------------------
# expect_error CODE MESSAGE_PART -- ENV... -- ARGS...: exit CODE, MESSAGE_PART in a one-line stderr.
expect_error() {
  local code=$1 part=$2
  shift 3
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done
  shift
  env "${env[@]}" "$train" "$@" >/dev/null 2>"$work/err"
  local got=$?
  if [ "$got" -eq "$code" ] && grep -qF -- "$part" "$work/err" && [ "$(wc -l <"$work/err")" -eq 1 ]; then
    pass "${env[*]} $* -> exit $got: $(head -c 150 "$work/err")"
  else
    fail "${env[*]} $* -> exit $got (expected $code with '$part'): $(cat "$work/err")"
  fi
}
expect_error 2 "environment WORLD_SIZE is set (2) but RANK is not" -- WORLD_SIZE=2 -- --steps 1
expect_error 2 "environment RANK is set (0) but WORLD_SIZE is not" -- RANK=0 -- --steps 1
expect_error 2 "environment RANK: expected an integer in 0..1, got '2'" -- WORLD_SIZE=2 RANK=2 \
  -- --steps 1
expect_error 2 "environment MASTER_PORT: expected an integer in 1..65535, got 'x'" -- \
  WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=x -- --steps 1
expect_error 2 "--nproc 2 with WORLD_SIZE set (2)" -- WORLD_SIZE=2 RANK=0 -- --nproc 2
expect_error 2 "--nproc: expected >= 1, got 0" -- -- --nproc 0
expect_error 2 "--nproc: expected 1..1024, got 2000" -- -- --nproc 2000 --batch-size 4096
expect_error 2 "--dist-backend: expected auto, gloo or nccl, got 'mpi'" -- -- --dist-backend mpi
expect_error 2 "--dist-backend nccl: NCCL reduces GPU tensors and needs --device cuda, got --device cpu" \
  -- WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 -- --dist-backend nccl --device cpu
expect_error 2 "--batch-size 1 is the global batch and must give each of the 2 ranks" -- -- \
  --nproc 2 --batch-size 1 --steps 1
expect_error 2 "--batch-size 1 is the global batch and must give each of the 2 groups of 2 ranks (--context-parallel) that share a sequence at least one sequence" \
  -- -- --nproc 4 --context-parallel 2 --batch-size 1 --steps 1
expect_error 2 "--context-parallel 2: the ranks form groups of 2 that share a sequence, so the number of ranks must be a multiple of it; got 3" \
  -- -- --nproc 3 --context-parallel 2 --steps 1
expect_error 2 "--context-parallel 2: the ranks form groups of 2" -- -- --context-parallel 2 --steps 1
expect_error 2 "--context-parallel 2: task copy with --seq-len 7 has sequences of 14 tokens, which must divide into 4 equal chunks" \
  -- -- --nproc 2 --context-parallel 2 --seq-len 7 --steps 1

expect_error 2 "--dist-timeout: expected 1..86400 seconds, got 0" -- -- --dist-timeout 0
# An address that does not resolve is named at once (it waited the whole timeout, then blamed
# the port); a rank whose peers never come says what it waited for (it said "Socket Timeout").
expect_error 2 "environment MASTER_ADDR: cannot resolve '256.1.1.1'" -- WORLD_SIZE=2 RANK=0 \
  MASTER_ADDR=256.1.1.1 MASTER_PORT=1 -- --steps 1
lonely_port=$((29400 + RANDOM % 500))
expect_error 2 "the 2 ranks did not all join the run at 127.0.0.1:$lonely_port within 3 s: start every rank 0..1 with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE" \
  -- WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 "MASTER_PORT=$lonely_port" -- --steps 1 --dist-timeout 3
# A port in use: something else listens there.
python3 -c 'import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); print(s.getsockname()[1], flush=True)
time.sleep(60)' >"$work/port" &
listener=$!
for _ in $(seq 50); do [ -s "$work/port" ] && break; sleep 0.1; done
expect_error 2 ": the port is already in use; choose another MASTER_PORT" -- WORLD_SIZE=2 RANK=0 \
  MASTER_ADDR=127.0.0.1 "MASTER_PORT=$(cat "$work/port")" -- --steps 1
kill "$listener" 2>/dev/null

# Ranks started with different flags: both say which flag, both exit 2.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
WORLD_SIZE=2 RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$train" "${small[@]}" --steps 2 \
  --lr 0.001 >/dev/null 2>"$work/rank1.err" &
other=$!
expect_error 2 "ranks started with different flags: rank 0 has '--lr 0.003', rank 1 has '--lr 0.001'" \
  -- WORLD_SIZE=2 RANK=0 MASTER_ADDR=127.0.0.1 "MASTER_PORT=$port" -- "${small[@]}" --steps 2
wait "$other"
code=$?
if [ "$code" -eq 2 ] && grep -qF "rank 1: ranks started with different flags: rank 1 has '--lr 0.001'" "$work/rank1.err"; then
  pass "the other rank also refuses the mismatch, exit 2"
else
  fail "rank 1 with a different --lr: exit $code, $(cat "$work/rank1.err")"
fi

fi  # ! $gpu_only

# ---- on a GPU (skipped without one) -------------------------------------------------------
if "$train" "${base[@]}" --device cuda --steps 1 >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  # Gloo serves CUDA runs through host copies: two ranks sharing the GPU = one process on it.
  two_ranks=(--dist-backend gloo)
  ranks_match_one_process "CUDA, gloo" 50 1e-5 "${base[@]}" --device cuda
  two_ranks=()
  if [ "$gpus" -eq 1 ]; then
    # The default backend: NCCL only where each local rank has a GPU, so gloo here.
    "$train" --task copy --d-model 32 --heads 4 --batch-size 64 --steps 2 --device cuda \
      --nproc 2 >"$work/out" 2>"$work/err"
    if grep -qF "data-parallel: 2 ranks (gloo)" "$work/out"; then
      pass "2 ranks on 1 GPU, no --dist-backend: gloo"
    else
      fail "2 ranks on 1 GPU, no --dist-backend: $(cat "$work/out" "$work/err")"
    fi
    # NCCL puts one rank on each GPU: with one GPU, a second local rank is refused plainly.
    "$train" "${base[@]}" --device cuda --steps 2 --nproc 2 --dist-backend nccl \
      >/dev/null 2>"$work/err"
    if [ $? -ne 0 ] && grep -qF "LOCAL_RANK 1 needs GPU 1 but 1 GPU(s) are visible" "$work/err"; then
      pass "NCCL with 2 ranks on 1 GPU refused: $(grep -F LOCAL_RANK "$work/err" | head -c 150)"
    else
      fail "NCCL with 2 ranks on 1 GPU: $(cat "$work/err")"
    fi
  fi
elif $gpu_only; then
  fail "--gpu-only: attnkit-train --device cuda does not run: $("$train" "${base[@]}" --device cuda --steps 1 2>&1 >/dev/null | head -c 300)"
else
  echo "skip: no CUDA device, the GPU checks did not run"
fi

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
