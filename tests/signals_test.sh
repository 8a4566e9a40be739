#!/usr/bin/env bash
# attnkit-train under SIGINT and SIGTERM (src/train/interrupts.h), and its claim on --save:
# - a signal between fast steps: the step finishes, the run saves and exits 130;
# - a second run on the same --save is refused at start, naming the first;
# - a slow step: the run exits 130 within the grace period (3 s), dropping that step, and the
#   checkpoint it saved before is left as it was and resumes; a run resumed from its --save
#   file says that file holds the step it resumed from;
# - a second signal: the run exits at once.
# No temporary file or lock file is left behind in any case.
# Usage: tests/signals_test.sh PATH/TO/attnkit-train SOURCE_DIR
set -u
train=$1
source_dir=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
checks=0

pass() { echo "ok: $1"; }
fail() {
  echo "FAIL: $1, stderr:"
  sed 's/^/    /' "$2"
  failures=$((failures + 1))
}
# leftovers PREFIX: temporary and lock files beside a --save path.
leftovers() { ls "$1".*tmp "$1".lock 2>/dev/null; }
# wait_for FILE SECONDS PID: until FILE exists (0), or the time is up or PID has ended (1).
wait_for() {
  local tries=$(($2 * 10))
  while [ ! -e "$1" ] && [ "$tries" -gt 0 ] && kill -0 "$3" 2>/dev/null; do
    sleep 0.1
    tries=$((tries - 1))
  done
  [ -e "$1" ]
}
# wait_for_text FILE TEXT SECONDS PID: until FILE holds TEXT (0), or the time is up or PID
# has ended (1).
wait_for_text() {
  local tries=$(($3 * 10))
  while ! grep -qF -- "$2" "$1" 2>/dev/null && [ "$tries" -gt 0 ] && kill -0 "$4" 2>/dev/null; do
    sleep 0.1
    tries=$((tries - 1))
  done
  grep -qF -- "$2" "$1" 2>/dev/null
}
now_ms() { date +%s%3N; }
# signal_and_wait SIGNAL PID: sends SIGNAL to PID and waits for it; sets code (its exit
# status) and took (milliseconds from the signal to its end).
signal_and_wait() {
  local start
  start=$(now_ms)
  kill "-$1" "$2"
  wait "$2"
  code=$?
  took=$(($(now_ms) - start))
}

# 1. SIGINT between fast steps: the step finishes, the run saves, exits 130. Before the first
# evaluation (every 100,000 steps here) there is no best checkpoint, and the message says so.
checks=$((checks + 1))
"$train" --steps 1000000 --threads 1 --save "$work/fast.pt" >"$work/fast.out" 2>"$work/fast.err" &
pid=$!
sleep 3
# 2. Meanwhile a second run on the same --save is refused at start, naming the first.
checks=$((checks + 1))
"$train" --steps 2 --threads 1 --save "$work/fast.pt" >/dev/null 2>"$work/second.err"
code=$?
expected="--save: '$work/fast.pt' is being written by another attnkit-train run (process $pid); wait for it to end or give another --save path"
if [ "$code" -eq 2 ] && grep -qF -- "$expected" "$work/second.err"; then
  pass "a second run on one --save is refused: $(cat "$work/second.err")"
else
  fail "a second run on one --save -> exit $code (expected 2, '$expected')" "$work/second.err"
fi
kill -INT "$pid"
wait "$pid"
code=$?
if [ "$code" -eq 130 ] && grep -q "interrupted at step" "$work/fast.err" &&
   grep -qF "(no held-out evaluation ran yet, so there is no $work/fast.best.pt)" "$work/fast.err" &&
   [ ! -e "$work/fast.best.pt" ] && [ -s "$work/fast.pt" ] && [ -z "$(leftovers "$work/fast.pt")" ] &&
   "$train" --steps 1 --resume "$work/fast.pt" --quiet >/dev/null 2>&1; then
  pass "SIGINT -> exit 130, saved, lock released: $(cat "$work/fast.err")"
else
  fail "SIGINT -> exit $code (expected 130, a resumable checkpoint and no lock file)" "$work/fast.err"
fi

# A step of about 12 s on one thread here, in about 3 GB (text, 16 rows of 512 bytes): far
# longer than the grace period on any LibTorch.
slow=(--task text --data "$source_dir/data/the-verdict.txt" --seq-len 512 --batch-size 16
      --d-model 512 --heads 4 --layers 8 --ffn --threads 1 --steps 5)

# 3. SIGTERM in a slow step, after one step was saved: the run exits 130 within the grace
# period, and the checkpoint of step 1 is left as it was and resumes.
checks=$((checks + 1))
"$train" "${slow[@]}" --eval-every 1 --save "$work/slow.pt" >"$work/slow.out" 2>"$work/slow.err" &
pid=$!
if wait_for "$work/slow.best.pt" 300 "$pid"; then
  sleep 1
  cp "$work/slow.pt" "$work/slow.copy.pt"
  signal_and_wait TERM "$pid"
  expected="within 3 s of the signal, so step 2 was abandoned; $work/slow.pt holds step 1, the last checkpoint saved"
  if [ "$code" -eq 130 ] && [ "$took" -lt 8000 ] && grep -qF -- "$expected" "$work/slow.err" &&
     cmp -s "$work/slow.pt" "$work/slow.copy.pt" && [ -z "$(leftovers "$work/slow.pt")" ] &&
     "$train" "${slow[@]}" --steps 1 --resume "$work/slow.pt" --quiet >/dev/null 2>&1; then
    pass "SIGTERM in a slow step -> exit 130 after $took ms: $(cat "$work/slow.err")"
  else
    fail "SIGTERM in a slow step -> exit $code after $took ms (expected 130 within 8 s, '$expected', step 1's checkpoint unchanged, no leftovers)" "$work/slow.err"
  fi
else
  kill -KILL "$pid" 2>/dev/null
  fail "the slow run saved no checkpoint within 300 s" "$work/slow.err"
fi

# 4. A run that resumed from its --save file and is stopped before it saves says which step
# that file holds: the one it resumed from (not "this run had not saved it yet").
checks=$((checks + 1))
cp "$work/slow.pt" "$work/resumed.pt"
"$train" "${slow[@]}" --resume "$work/resumed.pt" --save "$work/resumed.pt" \
  >"$work/resumed.out" 2>"$work/resumed.err" &
pid=$!
# Signalled in step 2, once the banner says the checkpoint was read (a signal in the setup
# abandons the setup, before the run knows which step the file holds).
wait_for_text "$work/resumed.out" "resumed from $work/resumed.pt at step 1" 120 "$pid"
sleep 1
signal_and_wait TERM "$pid"
expected="so step 2 was abandoned; $work/resumed.pt holds step 1, the last checkpoint saved"
if [ "$code" -eq 130 ] && grep -qF -- "$expected" "$work/resumed.err" &&
   cmp -s "$work/resumed.pt" "$work/slow.pt" && [ -z "$(leftovers "$work/resumed.pt")" ]; then
  pass "SIGTERM in a resumed run's slow step -> exit 130 after $took ms: $(cat "$work/resumed.err")"
else
  fail "SIGTERM in a resumed run's slow step -> exit $code (expected 130, '$expected', the file unchanged, no leftovers)" "$work/resumed.err"
fi

# 5. A second signal ends the run at once (here in the slow run's first step).
checks=$((checks + 1))
"$train" "${slow[@]}" --save "$work/twice.pt" >"$work/twice.out" 2>"$work/twice.err" &
pid=$!
sleep 2
kill -INT "$pid"
sleep 0.5
signal_and_wait INT "$pid"
expected="attnkit-train: a second signal: stopped at once; the step in progress was dropped and $work/twice.pt is as the last checkpoint left it"
if [ "$code" -eq 130 ] && [ "$took" -lt 1500 ] && grep -qF -- "$expected" "$work/twice.err" &&
   [ ! -e "$work/twice.pt" ] && [ -z "$(leftovers "$work/twice.pt")" ]; then
  pass "a second SIGINT -> exit 130 after $took ms: $(cat "$work/twice.err")"
else
  fail "a second SIGINT -> exit $code after $took ms (expected 130 within 1.5 s, '$expected', no files)" "$work/twice.err"
fi

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
