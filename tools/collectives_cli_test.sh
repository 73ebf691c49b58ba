#!/usr/bin/env bash
# End-to-end test of `fsdp collectives` on the simulator: the table, exit
# codes, byte-identical traces for equal seeds, a fault that fails fast
# naming the rank, and --timeout.
# Usage: collectives_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"
# Each run of fsdp at most 30 s: a hang fails the check, not the test run.
CLI_TEST_TIMEOUT_S=30

# The whole suite and the default sweep (1 KiB to 16 MiB) on 8 ranks.
expect_exit 0 collectives --backend=sim --world-size=8 --seed=3
grep -q '^# fsdp collectives: backend sim, 8 ranks, seed 3, faults none$' \
  "$tmp/out" || fail "header missing"
grep -qE '^# conformance: [0-9]+ cases on each of 8 ranks: all correct$' \
  "$tmp/out" || fail "conformance summary missing"
grep -q 'time: virtual' "$tmp/out" || fail "the clock is not named"
for op in all_gather reduce_scatter all_reduce; do
  for bytes in 1024 16777216; do
    grep -qE "^  $op +$bytes .* 0  correct$" "$tmp/out" ||
      fail "no correct $op row of $bytes bytes"
  done
done
grep -q '^# all correct$' "$tmp/out" || fail "verdict missing"
[ -s "$tmp/err" ] && fail "unexpected stderr: $(head -c 500 "$tmp/err")"

# Equal seeds: byte-identical traces and tables; another seed: another
# schedule, still a trace.
quick=(--large-elements=0 --max-bytes=65536)
for run in a b; do
  expect_exit 0 collectives --world-size=4 --seed=7 "${quick[@]}" \
    --trace="$tmp/trace_$run.json"
  cp "$tmp/out" "$tmp/table_$run"
done
cmp -s "$tmp/trace_a.json" "$tmp/trace_b.json" ||
  fail "equal seeds wrote different traces"
cmp -s "$tmp/table_a" "$tmp/table_b" || fail "equal seeds printed different tables"
expect_exit 0 collectives --world-size=4 --seed=8 "${quick[@]}" \
  --trace="$tmp/trace_c.json"
cmp -s "$tmp/trace_a.json" "$tmp/trace_c.json" &&
  fail "another seed wrote the same trace"
grep -q '"traceEvents"' "$tmp/trace_c.json" || fail "trace lacks traceEvents"

# A killed rank: non-zero within seconds, naming the rank and the op.
start=$(date +%s)
expect_exit 1 collectives --backend=sim --world-size=8 --seed=3 \
  --fault=kill:rank=3:op=5 --trace-dir="$tmp/killtrace"
elapsed=$(($(date +%s) - start))
[ "$elapsed" -le 10 ] || fail "the fault took ${elapsed}s to report"
grep -q 'rank 3' "$tmp/err" || fail "the error does not name rank 3"
grep -q 'reduce_scatter #5' "$tmp/err" || fail "the error does not name op 5"
[ -s "$tmp/out" ] && fail "stdout not empty on error"
# Every rank's flight record, the killed rank's reduce_scatter #5 failed in
# it; fsdp diagnose finds the unfinished collective (exit bit 4).
for r in 0 3 7; do
  [ -s "$tmp/killtrace/rank_$r.json" ] || fail "no flight record of rank $r"
done
grep -q '"error": "rank 3: reduce_scatter #5' "$tmp/killtrace/rank_3.json" ||
  fail "rank 3's record lacks its failed reduce_scatter #5"
"$fsdp" diagnose "$tmp/killtrace" >"$tmp/diag" 2>&1
diag_status=$?
[ $((diag_status & 4)) -ne 0 ] && [ "$diag_status" -ne 1 ] ||
  fail "fsdp diagnose exited $diag_status: $(head -c 2000 "$tmp/diag")"

# --timeout: a rank 2 s late (virtual time) at its collective 3 fails the
# run within seconds when the timeout is 1 s, naming the op and the late
# rank; with 10 s the same run passes.
late=(--backend=sim --world-size=4 --seed=3 "${quick[@]}"
  --fault=delay:rank=1:seconds=2:op=3)
start=$(date +%s)
expect_exit 1 collectives "${late[@]}" --timeout=1s
elapsed=$(($(date +%s) - start))
[ "$elapsed" -le 10 ] || fail "the timeout took ${elapsed}s to report"
grep -q ' #3 in group 0: timed out' "$tmp/err" ||
  fail "the timeout does not name op 3: $(head -c 500 "$tmp/err")"
grep -q 'with a timeout of 1s' "$tmp/err" || fail "--timeout=1s not honoured"
grep -q 'when rank 1 was ready' "$tmp/err" || fail "the late rank 1 not named"
[ -s "$tmp/out" ] && fail "stdout not empty on a timeout"
expect_exit 0 collectives "${late[@]}" --timeout=10s
grep -q '^# all correct$' "$tmp/out" || fail "10s timeout: not all correct"
# Timeouts that are not positive are rejected, naming the value.
expect_exit 1 collectives --timeout=0s
grep -q -- '--timeout=0: expected a positive, finite duration' "$tmp/err" ||
  fail "--timeout=0s not rejected by name: $(head -c 500 "$tmp/err")"
expect_exit 1 collectives --timeout=-5s
grep -q -- '--timeout=-5s: expected a positive' "$tmp/err" ||
  fail "--timeout=-5s not rejected by name"
expect_exit 1 collectives --timeout=soon
grep -q 'timeout' "$tmp/err" || fail "--timeout=soon not rejected by name"

# Command-line errors.
expect_exit 1 collectives --backend=gloo
grep -q -- '--backend=gloo' "$tmp/err" || fail "bad backend not named"
expect_exit 1 collectives --backend=mpi --fault=kill:rank=1:op=1
grep -q 'needs --backend=sim' "$tmp/err" || fail "fault without sim"
expect_exit 1 collectives --fault=kill:rank=9:op=1 --world-size=4
expect_exit 1 collectives --dtype=int8
expect_exit 2 collectives extra-argument
expect_exit 0 collectives --help
grep -q -- '--fault=SPEC' "$tmp/out" || fail "help lacks --fault"
grep -q -- '--timeout=DURATION' "$tmp/out" || fail "help lacks --timeout"
expect_exit 0 --help
grep -q 'collectives' "$tmp/out" || fail "fsdp --help lacks collectives"

cli_test_finish
