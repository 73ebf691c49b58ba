#!/usr/bin/env bash
# End-to-end test of `fsdp checkpoint`: init -> shard -> reshard ->
# consolidate -> verify on a small model with AdamW state and on the gpt2
# preset (weights only, ~500 MB per checkpoint), byte-identical round trips,
# bounded memory, a corrupted file, and exit codes.
# Usage: checkpoint_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP PATH_TO_TINY_MODEL_JSON
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"
tiny=$3

# Small model, AdamW state, every conversion.
expect_exit 0 checkpoint init --model="$tiny" --out="$tmp/t_full" --seed=7
grep -qF "checkpoint init: wrote $tmp/t_full: " "$tmp/out" ||
  fail "init summary without the absolute output path: $(cat "$tmp/out")"
grep -q '^checkpoint init: wrote .*: [0-9]* bytes in .* MB/s), peak RSS' \
  "$tmp/out" || fail "init summary: $(cat "$tmp/out")"
[ -s "$tmp/err" ] && fail "progress on a non-terminal: $(head -c 300 "$tmp/err")"
expect_exit 0 checkpoint shard --in="$tmp/t_full" --model="$tiny" \
  --world-size=4 --out="$tmp/t_s4"
expect_exit 0 checkpoint reshard --in="$tmp/t_s4" --world-size=6 \
  --strategy=HYBRID_SHARD --shard-group-size=3 --align-addresses \
  --out="$tmp/t_h"
expect_exit 0 checkpoint verify --in="$tmp/t_h"
grep -q 'ok: sharded checkpoint, 7 files' "$tmp/out" ||
  fail "verify report: $(cat "$tmp/out")"
grep -q 'world size 6, HYBRID_SHARD, shard group 3, aligned' "$tmp/out" ||
  fail "verify report: $(cat "$tmp/out")"
expect_exit 0 checkpoint consolidate --in="$tmp/t_h" --out="$tmp/t_full2"
for f in model.safetensors optim.safetensors optim.json; do
  cmp -s "$tmp/t_full/$f" "$tmp/t_full2/$f" ||
    fail "tiny: $f differs after shard -> reshard -> consolidate"
done
expect_exit 0 checkpoint verify --in="$tmp/t_full2"
grep -q 'ok: full checkpoint, 3 files' "$tmp/out" ||
  fail "verify report: $(cat "$tmp/out")"

# A corrupted rank file fails verification, naming the file.
cp -r "$tmp/t_s4" "$tmp/t_bad"
printf '\x7f' | dd of="$tmp/t_bad/rank00001.safetensors" bs=1 seek=200 \
  conv=notrunc 2>/dev/null
expect_exit 1 checkpoint verify --in="$tmp/t_bad"
grep -q 'rank00001.safetensors' "$tmp/err" ||
  fail "corruption error does not name the file: $(cat "$tmp/err")"
expect_exit 1 checkpoint consolidate --in="$tmp/t_bad" --out="$tmp/t_nope"
[ -e "$tmp/t_nope" ] && fail "a failed consolidate left its output"

# The gpt2 preset, weights only: memory stays far below the model's size.
expect_exit 0 checkpoint init --model=gpt2 --optimizer=none --out="$tmp/g_full"
expect_exit 0 checkpoint shard --in="$tmp/g_full" --model=gpt2 \
  --world-size=4 --out="$tmp/g_s4"
expect_exit 0 checkpoint reshard --in="$tmp/g_s4" --world-size=3 \
  --align-addresses --out="$tmp/g_s3"
# 100 MiB against the model's 475 MiB; AddressSanitizer's redzones and
# shadow memory double that in the sanitized build (.bazelrc sets
# FLATPARAM_SANITIZED there), which still streams far below the model.
rss=$(sed -n 's/.*peak RSS \([0-9]*\)\..*/\1/p' "$tmp/out")
rss_limit=$((${FLATPARAM_SANITIZED:-0} == 1 ? 200 : 100))
[ -n "$rss" ] && [ "$rss" -lt "$rss_limit" ] ||
  fail "reshard of gpt2 peaked at ${rss:-?} MiB RSS (limit $rss_limit): $(cat "$tmp/out")"
rm -rf "$tmp/g_s4"
expect_exit 0 checkpoint consolidate --in="$tmp/g_s3" --out="$tmp/g_full2"
cmp -s "$tmp/g_full/model.safetensors" "$tmp/g_full2/model.safetensors" ||
  fail "gpt2: model.safetensors differs after shard -> reshard -> consolidate"
expect_exit 0 checkpoint verify --in="$tmp/g_s3"
grep -q 'model gpt2, world size 3, FULL_SHARD' "$tmp/out" ||
  fail "verify report: $(cat "$tmp/out")"
rm -rf "$tmp/g_full" "$tmp/g_full2" "$tmp/g_s3"

# Bad command lines exit 2, bad inputs 1.
expect_exit 2 checkpoint
expect_exit 2 checkpoint frobnicate --in="$tmp/t_s4"
expect_exit 2 checkpoint shard --model="$tiny" --out="$tmp/x"
grep -q 'needs --in' "$tmp/err" || fail "missing --in: $(cat "$tmp/err")"
expect_exit 2 checkpoint consolidate --in="$tmp/t_s4" --out="$tmp/x" \
  --world-size=2
grep -q 'does not take --world-size' "$tmp/err" ||
  fail "stray --world-size: $(cat "$tmp/err")"
expect_exit 2 checkpoint reshard --in="$tmp/t_s4" --out="$tmp/x" \
  --strategy=bogus
expect_exit 2 checkpoint reshard --in="$tmp/t_s4" --out="$tmp/x" \
  --world-size=4 --shard-group-size=3 --strategy=HYBRID_SHARD
expect_exit 2 checkpoint init --model="$tiny" --out="$tmp/x" --optimizer=lion
expect_exit 2 checkpoint consolidate --in="$tmp/t_s4" --out="$tmp/t_s4"
expect_exit 1 checkpoint consolidate --in="$tmp/missing" --out="$tmp/x"
expect_exit 1 checkpoint consolidate --in="$tmp/t_full" --out="$tmp/x"
expect_exit 1 checkpoint shard --in="$tmp/t_s4" --model="$tiny" \
  --world-size=2 --out="$tmp/x"
expect_exit 1 checkpoint shard --in="$tmp/t_full" --model=gpt2 \
  --world-size=2 --out="$tmp/x"
expect_exit 0 checkpoint --help
grep -q 'fsdp checkpoint consolidate' "$tmp/out" || fail "help lacks usage"

cli_test_finish
