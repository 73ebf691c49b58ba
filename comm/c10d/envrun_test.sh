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

pids=()
for ((r = 0; r < ranks; r++)); do
  (RANK=$r WORLD_SIZE=$ranks LOCAL_RANK=$r LOCAL_WORLD_SIZE=$ranks \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout --kill-after=5 "${limit}" "${binary}" "$@" 2>&1 |
    sed -u "s/^/[rank $r] /") &
  pids+=($!)
done
status=0
for ((r = 0; r < ranks; r++)); do
  wait "${pids[$r]}" || status=1
done
# With pipefail, each rank's pipeline fails when its binary does.
exit "${status}"
