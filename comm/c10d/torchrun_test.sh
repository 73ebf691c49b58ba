#!/bin/bash
# Runs a multi-process test binary under torchrun itself (PyTorch's
# launcher: its elastic agent starts NPROC workers with RANK, WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT, ...), and fails if the job fails.
#
#   torchrun_test.sh NPROC BINARY [ARGS...]
#
# Environment: TORCHRUN_TIMEOUT_S (default 100, times
# FLATPARAM_TEST_TIME_SCALE); TORCHRUN_EXTRA (more torchrun flags, words).
#
# What this sets up, and why:
# - A rendezvous endpoint on a free port: --standalone would use port 29400
#   for every job, and parallel tests would meet each other.
# - --redirects 1 --tee 1 and a log directory: Debian's torchrun 1.13 on
#   Python 3.11 fails at start with "'NoneType' object has no attribute
#   'get'" for the default redirects ("0"), because Python 3.11's IntFlag no
#   longer lists the zero flag when iterated; with 1 each worker's stdout
#   goes to the console (tee) and a file, stderr to the console.
# - 1.13 spells the flag --no_python (2.x accepts --no-python too).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 NPROC BINARY [ARGS...]" >&2
  exit 2
fi
nproc="$1"
binary="$2"
shift 2
if ! command -v torchrun >/dev/null 2>&1; then
  echo "torchrun not found on PATH ($PATH); install python3-torch" >&2
  exit 1
fi
limit=$((${TORCHRUN_TIMEOUT_S:-100} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
scratch="${TEST_TMPDIR:-$(mktemp -d)}"
export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:${ASAN_OPTIONS}}"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# shellcheck disable=SC2206
extra=(${TORCHRUN_EXTRA:-})
command=(torchrun --nnodes=1 --nproc_per_node="${nproc}"
  --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:${port}"
  --redirects 1 --tee 1 --log_dir "${scratch}/torchrun_logs"
  "${extra[@]}" --no_python "${binary}" "$@")
echo "${command[*]}"
status=0
timeout --kill-after=10 "${limit}" "${command[@]}" || status=$?
if [[ ${status} -eq 124 || ${status} -eq 137 ]]; then
  echo "FAILED: torchrun did not finish within ${limit} s" >&2
elif [[ ${status} -ne 0 ]]; then
  echo "FAILED: torchrun exited with status ${status} (a worker failed)" >&2
fi
exit "${status}"
