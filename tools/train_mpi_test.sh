#!/usr/bin/env bash
# `fsdp train` under mpirun with 4 ranks, launched by comm/mpi's
# mpirun_test.sh: MPI ranks train bitwise equal to single-process training
# and rank 0 alone prints; the NCCL backend either runs (4 GPUs) or fails
# naming the rank and the missing GPU.
# Usage: train_mpi_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_MPIRUN_TEST_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
mpirun_test=$2
cli_test_init "$3"

MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=HYBRID_SHARD --shard-group-size=2 --micro-batches=2 --check-reference \
  >"$tmp/out" 2>"$tmp/err"
status=$?
cat "$tmp/out"
[ "$status" -eq 0 ] || fail "mpi run exited $status: $(head -c 2000 "$tmp/err")"
[ "$(grep -c '^# fsdp train: backend mpi, 4 ranks, HYBRID_SHARD' "$tmp/out")" \
  -eq 1 ] || fail "not exactly one header (rank 0 alone prints)"
grep -q 'bitwise equal' "$tmp/out" || fail "no \"bitwise equal\""
grep -q '^# check: passed$' "$tmp/out" || fail "check not passed"

# A timeout that is not positive fails on every rank before communicating.
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --timeout=0s >"$tmp/out" 2>"$tmp/err"
[ $? -ne 0 ] || fail "--timeout=0s under mpirun succeeded"
grep -q -- '--timeout=0: expected a positive' "$tmp/err" ||
  fail "--timeout=0s under mpirun not rejected by name: $(head -c 2000 "$tmp/err")"

# --world-size must agree with mpirun's, also when it is the default (8).
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --world-size=8 >"$tmp/out" 2>"$tmp/err"
[ $? -ne 0 ] || fail "--world-size=8 under 4 ranks succeeded"
grep -q -- '--world-size=8, but the MPI job has 4 ranks' "$tmp/err" ||
  fail "explicit default world size mismatch not refused: $(head -c 2000 "$tmp/err")"
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --world-size=2 >"$tmp/out" 2>"$tmp/err"
[ $? -ne 0 ] || fail "--world-size=2 under 4 ranks succeeded"
grep -q 'but the MPI job has 4 ranks' "$tmp/err" ||
  fail "world size mismatch not explained: $(head -c 2000 "$tmp/err")"

# --save writes one checkpoint from the MPI ranks (each its own files);
# --load resumes from it bitwise. --timeout bounds every collective,
# the checkpoint's exchanges included.
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=HYBRID_SHARD --shard-group-size=2 --steps=2 --save="$tmp/ckpt" --timeout=20s \
  >"$tmp/out" 2>"$tmp/err"
[ $? -eq 0 ] || fail "mpi --save failed: $(head -c 2000 "$tmp/err")"
[ -f "$tmp/ckpt/manifest.json" ] || fail "mpi --save wrote no manifest.json"
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=HYBRID_SHARD --shard-group-size=2 --steps=2 --load="$tmp/ckpt" --check-reference \
  >"$tmp/out" 2>"$tmp/err"
[ $? -eq 0 ] || fail "mpi --load failed: $(head -c 2000 "$tmp/err")"
grep -q 'of all 4 steps .*bitwise equal' "$tmp/out" ||
  fail "mpi resume not bitwise equal to the chained reference"

# Asynchronous saves after every step (one checkpoint per step, each
# rank's files written by its background thread); the mid-run one resumes
# bitwise.
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=HYBRID_SHARD --shard-group-size=2 --steps=2 --save="$tmp/async{step}" --save-every=1 \
  --async-save --timeout=20s >"$tmp/out" 2>"$tmp/err"
[ $? -eq 0 ] || fail "mpi --async-save failed: $(head -c 2000 "$tmp/err")"
grep -q '^# saves: 2 (steps 1, 2), asynchronous' "$tmp/out" ||
  fail "mpi --async-save: no saves line"
for step in 1 2; do
  [ -f "$tmp/async$step/manifest.json" ] ||
    fail "mpi --async-save wrote no checkpoint of step $step"
done
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=HYBRID_SHARD --shard-group-size=2 --steps=1 --load="$tmp/async1" --check-reference \
  >"$tmp/out" 2>"$tmp/err"
[ $? -eq 0 ] || fail "mpi --load of an async save failed: $(head -c 2000 "$tmp/err")"
grep -q 'of all 2 steps .*bitwise equal' "$tmp/out" ||
  fail "mpi resume from the async mid-run save not bitwise equal"

# Resharding at load time across processes: a checkpoint saved by 8
# simulated ranks (FULL_SHARD) loads into 4 MPI ranks (SHARD_GRAD_OP),
# each reading its byte ranges of the saved ranks' files, and the run is
# bitwise equal to single-process training of all steps.
"$fsdp" train --world-size=8 --steps=2 --save="$tmp/sim8" >"$tmp/out" \
  2>"$tmp/err" || fail "sim --save at 8 ranks failed: $(head -c 2000 "$tmp/err")"
MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=mpi \
  --strategy=SHARD_GRAD_OP --steps=2 --load="$tmp/sim8" --check-reference \
  --timeout=20s >"$tmp/out" 2>"$tmp/err"
[ $? -eq 0 ] || fail "mpi load-time reshard failed: $(head -c 2000 "$tmp/err")"
grep -q '^# resharded at load time from 8 ranks, FULL_SHARD' "$tmp/out" ||
  fail "mpi load did not reshard at load time"
grep -q 'of all 4 steps (chained: steps 0-1 on 8 ranks FULL_SHARD; then this run): 0 .*bitwise equal' "$tmp/out" ||
  fail "mpi load-time reshard not bitwise equal to the chained reference"

MPI_TEST_TIMEOUT_S=40 "$mpirun_test" "$fsdp" train --backend=nccl \
  --check-reference >"$tmp/out" 2>"$tmp/err"
status=$?
if [ "$status" -eq 0 ]; then
  grep -q 'backend nccl, 4 ranks' "$tmp/out" || fail "nccl run printed nothing"
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
