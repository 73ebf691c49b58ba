#!/usr/bin/env bash
# `fsdp collectives` under mpirun with 4 ranks, launched by comm/mpi's
# mpirun_test.sh (which sets up the environment parallel MPI tests need):
# the MPI backend passes the conformance suite and prints one table from
# rank 0; the NCCL backend either runs (a machine with 4 GPUs) or fails
# with a message naming the rank.
# Usage: collectives_mpi_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_MPIRUN_TEST_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
mpirun_test=$2
cli_test_init "$3"

MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" collectives --backend=mpi \
  --max-bytes=1048576 --timeout=20s >"$tmp/out" 2>"$tmp/err"
status=$?
cat "$tmp/out"
[ "$status" -eq 0 ] || fail "mpi run exited $status: $(head -c 2000 "$tmp/err")"
[ "$(grep -c '^# fsdp collectives: backend mpi, 4 ranks$' "$tmp/out")" -eq 1 ] ||
  fail "not exactly one table header (rank 0 alone prints)"
grep -qE '^# conformance: [0-9]+ cases on each of 4 ranks: all correct$' \
  "$tmp/out" || fail "conformance summary missing"
grep -q 'time: wall clock' "$tmp/out" || fail "the clock is not named"
for op in all_gather reduce_scatter all_reduce; do
  grep -qE "^  $op +1048576 .* 0  correct$" "$tmp/out" ||
    fail "no correct $op row of 1 MiB"
done
grep -q '^# all correct$' "$tmp/out" || fail "verdict missing"

MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" collectives --backend=nccl \
  --large-elements=0 --max-bytes=65536 >"$tmp/out" 2>"$tmp/err"
status=$?
if [ "$status" -eq 0 ]; then
  grep -q 'backend nccl, 4 ranks' "$tmp/out" || fail "nccl run printed no table"
elif [ "${FLATPARAM_REQUIRE_GPU:-}" = 1 ]; then
  # A machine meant to have GPUs: no failure is excused.
  fail "nccl run exited $status with FLATPARAM_REQUIRE_GPU=1: $(head -c 2000 "$tmp/err")"
else
  # Without a GPU the only acceptable failure is its absence, named with
  # the rank; any other NCCL or CUDA error fails the test.
  grep -qE 'rank [0-9]+.*no usable GPU' "$tmp/err" ||
    fail "nccl failure other than a missing GPU: $(head -c 2000 "$tmp/err")"
fi

cli_test_finish
