#!/bin/bash
# Runs the trainer on 2 ranks under mpirun, as a test: it trains, saves a
# sharded checkpoint into this test's scratch directory, loads it back and
# exits non-zero on any mismatch.
#
#   trainer_mpi_test.sh TRAINER
#
# Running mpirun inside `bazel test`:
# - TMPDIR and OpenMPI's shared-memory backing directory go into the test's
#   own $TEST_TMPDIR: tests running in parallel in their own sandboxes share
#   a PID, and their mpiruns would otherwise collide in /tmp and /dev/shm.
# - --allow-run-as-root (CI containers run as root), --oversubscribe and
#   --bind-to none (more ranks than cores is fine for a test).
# - `timeout` bounds the run in case a rank hangs outside the library's own
#   collective timeouts (in MPI_Init or MPI_Finalize).
set -euo pipefail

trainer="$1"
if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpirun not found on PATH ($PATH); install openmpi-bin" >&2
  exit 1
fi

scratch="${TEST_TMPDIR:-$(mktemp -d)}"
export TMPDIR="${scratch}"
export OMPI_MCA_btl_vader_backing_directory="${scratch}"

command=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2
  "${trainer}" "${scratch}/checkpoint")
echo "${command[*]}"
status=0
timeout --kill-after=10 50 "${command[@]}" || status=$?
if [[ ${status} -ne 0 ]]; then
  echo "FAILED: mpirun exited with status ${status}" >&2
fi
exit "${status}"
