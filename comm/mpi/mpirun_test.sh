#!/bin/bash
# Runs a multi-process test binary under mpirun and fails if any rank fails.
#
#   mpirun_test.sh BINARY [ARGS...]
#
# Environment: MPI_TEST_RANKS (default 4), MPI_TEST_TIMEOUT_S (default 50,
# under the 60 s of a small test; times FLATPARAM_TEST_TIME_SCALE, which
# the sanitizer configs set), MPI_TEST_RANK_ENV (NAME=VALUE words set
# for the ranks alone, not for mpirun: an LD_PRELOAD, say).
#
# What this sets up, and why:
# - TMPDIR and the shared-memory backing directory point into this test's
#   own $TEST_TMPDIR: sandboxed tests running in parallel share a PID, so
#   their mpiruns would otherwise collide in /tmp and /dev/shm.
# - --allow-run-as-root (CI containers run as root) and --oversubscribe with
#   --bind-to none (more ranks than the machine's cores).
# - detect_leaks=0 for ASan builds: OpenMPI's own allocations are reported
#   as leaks otherwise.
# - `timeout` bounds the whole run, in case a rank hangs outside the
#   library's own collective timeouts (in MPI_Init or MPI_Finalize).
set -euo pipefail

if [[ $# -lt 1 ]]; then
  echo "usage: $0 BINARY [ARGS...]" >&2
  exit 2
fi
binary="$1"
shift

if ! command -v mpirun >/dev/null 2>&1; then
  echo "mpirun not found on PATH ($PATH); install openmpi-bin" >&2
  exit 1
fi

scratch="${TEST_TMPDIR:-$(mktemp -d)}"
export TMPDIR="${scratch}"
export OMPI_MCA_btl_vader_backing_directory="${scratch}"
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:${ASAN_OPTIONS}}"

ranks="${MPI_TEST_RANKS:-4}"
# Sanitized builds scale wall-clock limits (.bazelrc).
limit=$((${MPI_TEST_TIMEOUT_S:-50} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
rank_env=()
for setting in ${MPI_TEST_RANK_ENV:-}; do
  rank_env+=(-x "${setting}")
done
command=(mpirun --allow-run-as-root --oversubscribe --bind-to none
  -np "${ranks}" -x ASAN_OPTIONS "${rank_env[@]}" "${binary}" "$@")
echo "${command[*]}"

status=0
SECONDS=0
timeout --kill-after=10 "${limit}" "${command[@]}" || status=$?
# 137 is also mpirun's own status when a rank was killed (128 + SIGKILL):
# only a run that lasted the limit timed out.
if [[ (${status} -eq 124 || ${status} -eq 137) && ${SECONDS} -ge ${limit} ]]; then
  echo "FAILED: mpirun did not finish within ${limit} s" >&2
elif [[ ${status} -ne 0 ]]; then
  echo "FAILED: mpirun exited with status ${status} (a rank failed)" >&2
fi
exit "${status}"
