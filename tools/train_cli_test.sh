#!/usr/bin/env bash
# `fsdp train` end to end on the simulator: bitwise equality with
# single-process training, the mixed-precision check, the prefetch flags,
# non-zero exit codes for inconsistent options, and --timeout's validation.
# Usage: train_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"

expect_exit 0 train --world-size=8 --strategy=FULL_SHARD --steps=3 \
  --check-reference
cat "$tmp/out"
grep -q '^# fsdp train: backend sim, 8 ranks, FULL_SHARD' "$tmp/out" ||
  fail "no header"
[ "$(grep -cE '^ +[0-2]  [0-9.]+$' "$tmp/out")" -eq 3 ] ||
  fail "not one loss per step"
grep -q 'bitwise equal' "$tmp/out" || fail "no \"bitwise equal\""
grep -q '^# check: passed$' "$tmp/out" || fail "check not passed"
[ "$(grep -cE '^[0-7] +[0-9]+ ' "$tmp/out")" -eq 16 ] ||
  fail "not one memory and one communication row per rank"
grep -q 'every rank matches it' "$tmp/out" || fail "memory formula"

# Hybrid with bf16: bitwise against the emulation, within the bound.
expect_exit 0 train --world-size=8 --strategy=HYBRID_SHARD \
  --shard-group-size=4 --mixed-precision=bf16 --micro-batches=2 --no-sync \
  --align-addresses --cpu-offload --check-reference
grep -q '(bfloat16 emulated): 0 .*; bitwise equal' "$tmp/out" ||
  fail "bf16 not bitwise equal to its emulation"
grep -q 'within the bound' "$tmp/out" || fail "bf16 bound not reported"

# Prefetch flags: bitwise equal whatever they are, named in the header,
# the formula following them; bad values exit 1 naming the flag.
expect_exit 0 train --world-size=4 --strategy=FULL_SHARD --steps=2 \
  --forward-prefetch --backward-prefetch=post --prefetch-depth=2 \
  --limit-all-gathers=1 --check-reference
grep -q '^# fsdp train: backend sim, 4 ranks, FULL_SHARD, seed 0; prefetch forward + BACKWARD_POST (depth 2, limit_all_gathers 1)$' "$tmp/out" ||
  fail "prefetch settings not in the header: $(head -1 "$tmp/out")"
grep -q 'every rank matches it' "$tmp/out" || fail "memory formula (prefetch)"
grep -q '^# check: passed$' "$tmp/out" || fail "prefetch run failed"
expect_exit 1 train --backward-prefetch=sideways
grep -q -- '--backward-prefetch=sideways: expected none, pre' "$tmp/err" ||
  fail "bad --backward-prefetch not named"
expect_exit 1 train --limit-all-gathers=-1
grep -q -- '--limit-all-gathers=-1: must be in \[0, ' "$tmp/err" ||
  fail "bad --limit-all-gathers not named"
expect_exit 1 train --prefetch-depth=0
grep -q -- '--prefetch-depth=0: must be in \[1, ' "$tmp/err" ||
  fail "bad --prefetch-depth not named"

# Equal seeds, equal output.
expect_exit 0 train --world-size=4 --strategy=SHARD_GRAD_OP --seed=7
cp "$tmp/out" "$tmp/first"
expect_exit 0 train --world-size=4 --strategy=SHARD_GRAD_OP --seed=7
cmp -s "$tmp/out" "$tmp/first" || fail "same seed, different output"

# Inconsistent options exit 1 with the flag named.
expect_exit 1 train --world-size=8 --strategy=HYBRID_SHARD \
  --shard-group-size=3 --check-reference
grep -q -- '--shard-group-size=3 must divide the world size 8' "$tmp/err" ||
  fail "inconsistent shard group size not named"
[ -s "$tmp/out" ] && fail "output despite the error"
expect_exit 1 train --strategy=NO_SHARD --shard-group-size=2
expect_exit 1 train --mixed-precision=fp8
grep -q -- '--mixed-precision=fp8' "$tmp/err" || fail "bad precision not named"
# --timeout: accepted when positive; rejected, naming the value, when not.
expect_exit 0 train --world-size=4 --steps=1 --timeout=30s --check-reference
grep -q '^# check: passed$' "$tmp/out" || fail "--timeout=30s run failed"
expect_exit 1 train --timeout=0s
grep -q -- '--timeout=0: expected a positive, finite duration' "$tmp/err" ||
  fail "--timeout=0s not rejected by name: $(head -c 500 "$tmp/err")"
[ -s "$tmp/out" ] && fail "output despite --timeout=0s"
expect_exit 1 train --timeout=-1m
grep -q -- '--timeout=-1m: expected a positive' "$tmp/err" ||
  fail "--timeout=-1m not rejected by name"
expect_exit 0 train --help
grep -q -- '--timeout=DURATION' "$tmp/out" || fail "help lacks --timeout"
grep -q -- '--backward-prefetch=B' "$tmp/out" ||
  fail "help lacks --backward-prefetch"
grep -q -- '--limit-all-gathers=N' "$tmp/out" ||
  fail "help lacks --limit-all-gathers"
expect_exit 2 train --no-such-flag
expect_exit 2 train extra-argument

cli_test_finish
