#!/usr/bin/env bash
# `fsdp train --save` then `--load` end to end on the simulator: the resumed
# run's losses continue the unbroken run's, its check against single-process
# training of all steps passes bitwise, a job that does not fit the
# checkpoint is told to reshard, and a flag that contradicts the checkpoint
# is named. With `fsdp checkpoint` in the binary, also save -> reshard to
# another world size -> load --check-reference.
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

# A job that does not fit is told to reshard.
expect_exit 1 train --world-size=8 --load="$tmp/ckpt"
grep -q 'world size: checkpoint 4, job 8' "$tmp/err" || fail "no fit error"
grep -q 'fsdp checkpoint reshard' "$tmp/err" || fail "no reshard hint"
expect_exit 1 train --world-size=4 --strategy=SHARD_GRAD_OP --load="$tmp/ckpt"
grep -q 'strategy: checkpoint FULL_SHARD, job SHARD_GRAD_OP' "$tmp/err" ||
  fail "no strategy error"
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
grep -q 'rank 2: .*rank00002.safetensors: xxh3_64 checksum' "$tmp/err" ||
  fail "damaged rank file not named: $(cat "$tmp/err")"

# Save -> reshard (fsdp checkpoint) -> load.
expect_exit 0 checkpoint reshard --in="$tmp/ckpt" --out="$tmp/ckpt8" \
  --world-size=8
expect_exit 0 train --world-size=8 --steps=2 --load="$tmp/ckpt8" \
  --check-reference
cat "$tmp/out"
grep -q 'chained: steps 0-1 on 4 ranks FULL_SHARD; then this run): 0 .*bitwise equal' "$tmp/out" ||
  fail "resharded resume not bitwise equal to the chained reference"
grep -q '^# check: passed$' "$tmp/out" || fail "resharded check not passed"

cli_test_finish
