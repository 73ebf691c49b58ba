#!/bin/bash
# Runs a multi-process test binary as torchrun runs its workers (RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in each
# process's environment; rank 0 hosts the TCPStore) without torchrun's
# Python start-up, and fails if any rank fails.
#
#   envrun_test.sh RANKS BINARY [ARGS...]
#
# Environment: ENVRUN_TIMEOUT_S (default 50, times FLATPARAM_TEST_TIME_SCALE,
# which the sanitizer configs set). Each rank's output goes to the test log
# prefixed with "[rank N]". `timeout` bounds the whole run, in case a rank
# hangs outside the library's own timeouts.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 RANKS BINARY [ARGS...]" >&2
  exit 2
fi
ranks="$1"
binary="$2"
shift 2
limit=$((${ENVRUN_TIMEOUT_S:-50} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:${ASAN_OPTIONS}}"

# A free port for the store: bound by the kernel, then released (another
# process could take it in between; the store would then fail to start
# with a clear error, not hang).
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "envrun: ${ranks} ranks of ${binary}, store 127.0.0.1:${port}"

scratch="${TEST_TMPDIR:-$(mktemp -d)}"
pids=()
for ((r = 0; r < ranks; r++)); do
  # Each rank in a process group of its own (its id in a file), so that a
  # failed run can end the whole rank, whatever it started.
  (setsid -w sh -c 'echo $$ >"$0"; exec "$@"' "${scratch}/envrun_rank_$r.pgid" \
    env RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r LOCAL_WORLD_SIZE=$ranks \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout --foreground --kill-after=5 "${limit}" "${binary}" "$@" 2>&1 |
    sed -u "s/^/[rank $r] /") &
  pids+=($!)
done
# As mpirun and torchrun do: once a rank has failed, the others get a
# grace period to end on their own (and print why), then are killed, a
# stopped one included (SIGKILL reaches a stopped process).
status=0
remaining=${ranks}
while [[ ${remaining} -gt 0 ]]; do
  if ! wait -n; then
    status=1
    break
  fi
  remaining=$((remaining - 1))
done
if [[ ${status} -ne 0 ]]; then
  sleep "${ENVRUN_KILL_GRACE_S:-5}"
  for ((r = 0; r < ranks; r++)); do
    pgid=$(cat "${scratch}/envrun_rank_$r.pgid" 2>/dev/null || true)
    [[ -n "${pgid}" ]] && kill -KILL -- "-${pgid}" 2>/dev/null || true
  done
  wait || true
  echo "envrun: a rank failed; the others were ended" >&2
fi
exit "${status}"
