#!/bin/bash
# Runs a trainer on 2 workers under torchrun, as a test: it trains, saves a
# sharded checkpoint into this test's scratch directory, loads it back and
# exits non-zero on any mismatch.
#
#   trainer_torchrun_test.sh TRAINER
#
# Running torchrun (Debian's python3-torch, PyTorch 1.13) inside `bazel
# test`:
# - a rendezvous endpoint on a free port (--standalone always takes 29400,
#   where parallel tests would meet);
# - --redirects 1 --tee 1: 1.13's torchrun on Python 3.11 fails at start
#   with its default ("0") ("'NoneType' object has no attribute 'get'");
# - 1.13 spells --no_python with an underscore;
# - `timeout` bounds the run.
set -euo pipefail

trainer="$1"
if ! command -v torchrun >/dev/null 2>&1; then
  echo "torchrun not found on PATH ($PATH); install python3-torch" >&2
  exit 1
fi
scratch="${TEST_TMPDIR:-$(mktemp -d)}"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
command=(torchrun --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d
  --rdzv_endpoint="127.0.0.1:${port}" --redirects 1 --tee 1
  --log_dir "${scratch}/logs" --no_python "${trainer}" "${scratch}/checkpoint")
echo "${command[*]}"
timeout --kill-after=10 120 "${command[@]}"
