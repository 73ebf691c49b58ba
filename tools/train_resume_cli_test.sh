#!/usr/bin/env bash
# `fsdp train --save` then `--load` end to end on the simulator: the resumed
# run's losses continue the unbroken run's, its check against single-process
# training of all steps passes bitwise, a job of another world size or
# strategy reshards at load time (equal to the offline reshard), and a flag
# that contradicts the checkpoint is named. Mid-run asynchronous saves (--save-every, --async-save, {step})
# leave training unchanged and each resumes exactly. With `fsdp checkpoint`
# in the binary, also save -> reshard to another world size -> load
# --check-reference.
# Usage: train_resume_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"

losses() { grep -E '^ +[0-9]+  [0-9.]+$' "$1"; }

expect_exit 0 train --world-size=4 --steps=4 --seed=3 --optimizer=sgd
losses "$tmp/out" | tail -n 2 >"$tmp/unbroken_tail"

expect_exit 0 train --world-size=4 --steps=2 --seed=3 --optimizer=sgd \
  --save="$tmp/ckpt" --check-reference
grep -q "^# saved a sharded checkpoint of step 2 to $tmp/ckpt" "$tmp/out" ||
  fail "no save line"
[ -f "$tmp/ckpt/manifest.json" ] || fail "no manifest.json"
[ -f "$tmp/ckpt/rank00003.safetensors" ] || fail "no rank00003.safetensors"
grep -q '"fsdp_train"' "$tmp/ckpt/rank00000.json" || fail "no extra"

# Resumed: the saved seed and optimizer carry over without the flags.
expect_exit 0 train --world-size=4 --steps=2 --load="$tmp/ckpt" \
  --check-reference
cat "$tmp/out"
grep -q "^# resumed from $tmp/ckpt at step 2" "$tmp/out" || fail "no resume"
losses "$tmp/out" >"$tmp/resumed"
cmp -s "$tmp/resumed" "$tmp/unbroken_tail" ||
  fail "resumed losses differ from the unbroken run's steps 2-3"
grep -q 'single-process training of all 4 steps (chained: steps 0-1 on 4 ranks FULL_SHARD; then this run): 0 .*bitwise equal' "$tmp/out" ||
  fail "no bitwise check over all steps"
grep -q '^# check: passed$' "$tmp/out" || fail "check not passed"

# A flag that contradicts the checkpoint.
expect_exit 1 train --world-size=4 --lr=0.5 --load="$tmp/ckpt"
grep -q -- '--lr=0.5 differs from the checkpoint.s 0.01' "$tmp/err" ||
  fail "contradicting flag not named: $(cat "$tmp/err")"
expect_exit 1 train --world-size=4 --load="$tmp/no-such-checkpoint"
grep -q 'no checkpoint at' "$tmp/err" || fail "missing checkpoint not named"

# Each rank verifies only its own tensors, and the ranks agree: a damaged
# file of rank 2 fails every rank, naming it, rather than hanging the others.
cp -r "$tmp/ckpt" "$tmp/damaged"
python3 - "$tmp/damaged/rank00002.safetensors" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
b[-1] ^= 0x40
open(p, "wb").write(bytes(b))
PY
expect_exit 1 train --world-size=4 --steps=2 --load="$tmp/damaged" --timeout=20s
grep -q 'rank 2: .*rank00002.safetensors: bytes .* (checksum block .*) have xxh3_64' "$tmp/err" ||
  fail "damaged rank file not named: $(cat "$tmp/err")"

# Mid-run asynchronous saves, one checkpoint per save: step2 and step4. The
# step-2 checkpoint resumes bitwise over all 4 steps and ends in step4's
# state (the same rank tensor files).
mkdir -p "$tmp/mid"
expect_exit 0 train --world-size=4 --steps=4 --seed=3 --optimizer=sgd \
  --save="$tmp/mid/step{step}" --save-every=2 --async-save
grep -q "^# saved a sharded checkpoint of step 4 to $tmp/mid/step4 (written by the ranks collectively, in the background)" "$tmp/out" ||
  fail "no async save line: $(grep '^# saved' "$tmp/out")"
grep -q '^# saves: 2 (steps 2, 4), asynchronous; training blocked by saving: longest .*, total ' "$tmp/out" ||
  fail "no saves line: $(grep '^# saves' "$tmp/out")"
losses "$tmp/out" | tail -n 2 >"$tmp/mid_tail"
cmp -s "$tmp/mid_tail" "$tmp/unbroken_tail" ||
  fail "async saves changed the losses"
for step in 2 4; do
  [ -f "$tmp/mid/step$step/manifest.json" ] || fail "no checkpoint step$step"
done
for step in 1 3; do
  [ ! -e "$tmp/mid/step$step" ] || fail "a checkpoint of step $step"
done
expect_exit 0 train --world-size=4 --steps=2 --load="$tmp/mid/step2" \
  --save="$tmp/mid/resumed" --check-reference
grep -q "^# resumed from $tmp/mid/step2 at step 2" "$tmp/out" ||
  fail "mid-run checkpoint not resumed at step 2"
grep -q 'of all 4 steps (chained: steps 0-1 on 4 ranks FULL_SHARD; then this run): 0 .*bitwise equal' "$tmp/out" ||
  fail "resumed from the mid-run checkpoint: not bitwise over all steps"
grep -q '^# check: passed$' "$tmp/out" || fail "mid-run resume check not passed"
for r in 0 1 2 3; do
  f=rank0000$r.safetensors
  cmp -s "$tmp/mid/resumed/$f" "$tmp/mid/step4/$f" ||
    fail "resumed from step2, $f differs from step4's"
done

# The flags' errors name the values.
expect_exit 1 train --world-size=4 --save="$tmp/x" --save-every=0
grep -q -- '--save-every=0: must be >= 1' "$tmp/err" ||
  fail "--save-every=0 not rejected: $(cat "$tmp/err")"
expect_exit 1 train --world-size=4 --save-every=2
grep -q -- '--save-every=2 needs --save=DIR' "$tmp/err" ||
  fail "--save-every without --save not rejected: $(cat "$tmp/err")"
expect_exit 1 train --world-size=4 --async-save
grep -q -- '--async-save needs --save=DIR' "$tmp/err" ||
  fail "--async-save without --save not rejected: $(cat "$tmp/err")"

# Save -> reshard (fsdp checkpoint) -> load, and the same resharded at load
# time: both bitwise equal to single-process training, with equal losses.
for job in "--world-size=8" "--world-size=2" \
  "--world-size=4 --strategy=HYBRID_SHARD --shard-group-size=2" \
  "--world-size=2 --strategy=SHARD_GRAD_OP --align-addresses"; do
  name=$(echo "$job" | tr -c 'a-zA-Z0-9' '_')
  read -r -a job_flags <<<"$job"
  strategy=FULL_SHARD
  for f in "${job_flags[@]}"; do
    case "$f" in --strategy=*) strategy=${f#--strategy=} ;; esac
  done
  offline_flags=()
  for f in "${job_flags[@]}"; do
    case "$f" in --world-size=* | --strategy=* | --shard-group-size=*) offline_flags+=("$f") ;; esac
  done
  [ "$strategy" = FULL_SHARD ] && offline_flags+=(--strategy=FULL_SHARD)
  case " ${job_flags[*]} " in *" --align-addresses "*) offline_flags+=(--align-addresses) ;; esac
  expect_exit 0 checkpoint reshard --in="$tmp/ckpt" --out="$tmp/off_$name" \
    "${offline_flags[@]}"
  expect_exit 0 train "${job_flags[@]}" --steps=2 --load="$tmp/off_$name" \
    --check-reference
  grep -q '^# check: passed$' "$tmp/out" || fail "$job: offline check not passed"
  grep -q '^# resharded at load time' "$tmp/out" &&
    fail "$job: the offline-resharded checkpoint was resharded again"
  losses "$tmp/out" >"$tmp/off_losses"
  expect_exit 0 train "${job_flags[@]}" --steps=2 --load="$tmp/ckpt" \
    --check-reference
  cat "$tmp/out"
  grep -q '^# resharded at load time from 4 ranks, FULL_SHARD' "$tmp/out" ||
    fail "$job: no load-time reshard line"
  grep -q 'chained: steps 0-1 on 4 ranks FULL_SHARD; then this run): 0 .*bitwise equal' "$tmp/out" ||
    fail "$job: load-time reshard not bitwise equal to the chained reference"
  grep -q '^# check: passed$' "$tmp/out" || fail "$job: check not passed"
  losses "$tmp/out" >"$tmp/direct_losses"
  cmp -s "$tmp/off_losses" "$tmp/direct_losses" ||
    fail "$job: losses differ between offline and load-time resharding"
done

# A restart on another number of ranks from the newest published
# checkpoint of a run that saved every step: --load takes the same
# "{step}" pattern as --save and skips a save cut off before publishing
# (no manifest.json) and a damaged one (a truncated file). The saved global batch (8) carries over when the new
# world size divides it, and otherwise must be changed on request; the
# reference replays each segment with its own batch.
expect_exit 0 train --world-size=4 --steps=3 --save-every=1 --save="$tmp/every{step}"
mkdir -p "$tmp/every9"  # a save that never published
cp -r "$tmp/every3" "$tmp/every5"  # a published one, since damaged
truncate -s 10 "$tmp/every5/rank00001.safetensors"
expect_exit 0 train --world-size=2 --steps=1 --load="$tmp/every{step}" --check-reference
grep -q "^# resumed from $tmp/every3 at step 3" "$tmp/out" ||
  fail "{step}: not resumed from the newest published checkpoint: $(head -c 2000 "$tmp/out")"
grep -q '^# the newest complete checkpoint of 5 matching' "$tmp/out" ||
  fail "{step}: the choice is not reported"
grep -q "^# skipped, incomplete or damaged: $tmp/every9 (.*manifest" "$tmp/out" ||
  fail "{step}: the unpublished save is not reported as skipped"
grep -q "^# skipped, incomplete or damaged: $tmp/every5 (.*rank00001.safetensors" "$tmp/out" ||
  fail "{step}: the damaged checkpoint is not reported as skipped"
grep -q 'bitwise equal' "$tmp/out" || fail "{step}: W=2 not bitwise equal"
expect_exit 1 train --world-size=3 --steps=1 --load="$tmp/every{step}"
grep -q 'cannot split evenly: give --global-batch=6 or 9' "$tmp/err" ||
  fail "W=3: no advice on the batch: $(head -c 2000 "$tmp/err")"
expect_exit 0 train --world-size=3 --steps=2 --load="$tmp/every{step}" \
  --global-batch=6 --check-reference
grep -q 'chained: steps 0-2 on 4 ranks FULL_SHARD with 1 micro-batch of 8 samples; then this run): 0 .*bitwise equal' \
  "$tmp/out" || fail "W=3, batch 6: not bitwise equal: $(head -c 2000 "$tmp/out")"
expect_exit 1 train --world-size=3 --load="$tmp/none{step}"
grep -q "no complete checkpoint matches $tmp/none{step} (0 directories" "$tmp/err" ||
  fail "{step} with no match: $(head -c 2000 "$tmp/err")"

cli_test_finish
