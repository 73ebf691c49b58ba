#!/usr/bin/env bash
# End-to-end test of the `fsdp` binary: exit codes, flag spelling, output.
# Usage: fsdp_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"

expect_exit 0 inspect --model=gpt2 --world-size=4 --format=json
grep -q '"world_size": 4' "$tmp/out" || fail "json lacks world_size 4"
grep -q '"prim_fqn": "transformer.wte.weight"' "$tmp/out" ||
  fail "json lacks the lm_head tie"
grep -q '"strategy": "FULL_SHARD"' "$tmp/out" || fail "json lacks strategy"
[ -s "$tmp/err" ] && fail "unexpected stderr: $(head -c 500 "$tmp/err")"

# Underscored absl spelling works too; table is the default format.
expect_exit 0 inspect --model=llama2-70b --world_size=8 --align-addresses
grep -q '^unit layers.79: bfloat16' "$tmp/out" || fail "table lacks layers.79"
grep -q '^total: 81 flat parameters' "$tmp/out" || fail "table lacks total"

expect_exit 0 inspect --model=gpt2 --world-size=2 --align-addresses \
  --no-align-addresses --format=json
grep -q '"align_addresses": false' "$tmp/out" || fail "--no-align-addresses"

expect_exit 0 inspect --model=gpt2 --world-size=16 --strategy=HYBRID_SHARD \
  --shard-group-size=4 --format=json
grep -q '"shard_group_size": 4' "$tmp/out" || fail "hybrid json lacks G"

# Usage errors: exit 2, usage on stderr listing the subcommands.
expect_exit 2
grep -q 'inspect' "$tmp/err" || fail "usage does not list inspect"
expect_exit 2 frobnicate
grep -q 'unknown subcommand "frobnicate"' "$tmp/err" ||
  fail "unknown subcommand not named"
expect_exit 2 inspect --model=gpt2 extra-argument

# An unknown flag: exit 2, naming the command and the closest flag.
expect_exit 2 inspect --model=gpt2 --worldsize=4
grep -q '^fsdp inspect: unknown flag --worldsize; did you mean --world-size?' \
  "$tmp/err" || fail "unknown flag: $(cat "$tmp/err")"
expect_exit 2 train --no-such-thing
grep -q '^fsdp train: unknown flag --no-such-thing' "$tmp/err" ||
  fail "unknown flag without a near one: $(cat "$tmp/err")"
grep -q 'did you mean' "$tmp/err" && fail "a far flag suggested: $(cat "$tmp/err")"
expect_exit 0 train --steps=1 --no-sync --nocheck-reference

# Under `bazel run` (BUILD_WORKING_DIRECTORY set), relative paths mean the
# user's directory, not the runfiles directory.
mkdir -p "$tmp/wd"
cp "$(dirname "$fsdp")/testdata/tiny_model.json" "$tmp/wd/my_model.json" 2>/dev/null ||
  echo '{"params": [{"fqn": "w", "shape": [3, 5]}]}' >"$tmp/wd/my_model.json"
BUILD_WORKING_DIRECTORY="$tmp/wd" expect_exit 0 inspect --model=my_model.json \
  --world-size=2
BUILD_WORKING_DIRECTORY="$tmp/wd" expect_exit 0 checkpoint init \
  --model=my_model.json --out=relative_ckpt
[ -f "$tmp/wd/relative_ckpt/manifest.json" ] ||
  fail "a relative --out under bazel run did not land in the working directory"

# Every preset --model accepts is listed in --help.
expect_exit 0 inspect --help
for preset in gpt2 gpt2-xl llama2-13b llama3-70b llama2-7b-hf llama3-70b-hf; do
  grep -qw -- "$preset" "$tmp/out" || fail "inspect --help lacks preset $preset"
done
expect_exit 1 inspect --model=not-a-preset
for preset in $(sed -n 's/.*is not a preset (\([^)]*\)).*/\1/p' "$tmp/err" | tr -d ','); do
  for command in inspect plan checkpoint; do
    expect_exit 0 "$command" --help
    grep -qw -- "$preset" "$tmp/out" || fail "$command --help lacks preset $preset"
  done
done

# Help goes to stdout with exit 0.
expect_exit 0 --help
grep -q 'inspect' "$tmp/out" || fail "--help does not list inspect"
expect_exit 0 inspect --help
grep -q -- '--world-size' "$tmp/out" || fail "inspect --help lacks flags"

# Command errors: exit 1, message on stderr, nothing on stdout.
expect_exit 1 inspect --model=gpt2 --world-size=0
grep -q 'world-size' "$tmp/err" || fail "world size error not reported"
[ -s "$tmp/out" ] && fail "stdout not empty on error"
expect_exit 1 inspect --model=no-such-model.json
grep -q 'no-such-model.json' "$tmp/err" || fail "missing file not named"
expect_exit 1 inspect --model=gpt2 --strategy=ZERO3
expect_exit 2 inspect --model=gpt2 --no-such-flag

cli_test_finish
