#!/usr/bin/env bash
# fsdp_module_fault_test.sh's fault across hosts: 4 network-namespace hosts
# (tools/testing/netns_hosts.sh), one rank each over TCP, the LibTorch
# trainer of fsdp_module_fault_main launched both ways; rank 2 stops in a
# backward. Every rank must end within the timeout plus the slack, naming
# rank 2 and the unit, with no process left on any host. A clean run
# succeeds. Skips with a message where network namespaces cannot be made.
#
# Usage: fsdp_module_hosts_test.sh PATH_TO_NETNS_HOSTS_SH PATH_TO_BINARY
set -uo pipefail

# shellcheck source=tools/testing/netns_hosts.sh
source "$1"
binary=$(realpath "$2")
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}
if ! command -v mpirun >/dev/null 2>&1; then
  echo "FAIL: mpirun not found on PATH ($PATH); install openmpi-bin" >&2
  exit 1
fi
hosts_init 4 || exit 0

timeout_s=3
slack_s=$((${MPI_FAULT_SLACK_S:-15} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
export HOSTS_MPIRUN_LIMIT_S=90
now_ms() { date +%s%3N; }

for launcher in session run_on_mpi_world; do
  hosts_mpirun 4 1 "$binary" --fault=none --launcher="$launcher" \
    --timeout="${timeout_s}s" >"$tmp/out" 2>"$tmp/err"
  status=$?
  [ "$status" -eq 0 ] || fail "none/$launcher: exit $status: $(head -c 2000 "$tmp/err")"
  [ "$(grep -c '^fsdp_module_fault: rank [0-3]: OK$' "$tmp/out")" -eq 4 ] ||
    fail "none/$launcher: not every rank said OK"

  start=$(now_ms)
  hosts_mpirun 4 1 "$binary" --fault=stop-in-backward --launcher="$launcher" \
    --timeout="${timeout_s}s" >"$tmp/out" 2>"$tmp/err"
  status=$?
  end=$(now_ms)
  from=$(sed -n 's/^fsdp_module_fault: rank [0-9]*: fault [a-z-]* at \([0-9]*\)$/\1/p' \
    "$tmp/err" | head -n 1)
  elapsed_ms=$((end - ${from:-$start}))
  echo "hosts, launcher $launcher: exit $status, ${elapsed_ms} ms from the fault to the end"
  [ "$status" -ne 0 ] || fail "stop/$launcher: the job succeeded"
  [ "$status" -ne 124 ] || fail "stop/$launcher: the job hung until the limit"
  [ "$elapsed_ms" -le $(((timeout_s + slack_s) * 1000)) ] ||
    fail "stop/$launcher: the job ended ${elapsed_ms} ms after the fault"
  grep -qE 'no data arrived from (rank 2|ranks [0-9, and]*2)' "$tmp/err" ||
    fail "stop/$launcher: no error names rank 2: $(head -c 3000 "$tmp/err")"
  grep -qE 'unit [0-9]+ \("h\.[0-9]"\)' "$tmp/err" ||
    fail "stop/$launcher: no error names the unit: $(head -c 3000 "$tmp/err")"
  hosts_wait_empty 20 ||
    fail "stop/$launcher: processes left behind: $(hosts_pids)"
done

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "PASS"
