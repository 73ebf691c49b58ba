#!/usr/bin/env bash
# `fsdp train` under torchrun across hosts: network namespaces joined by a
# switch (tools/testing/netns_hosts.sh), one torchrun agent per host, the
# rendezvous on host 0 (static: --nnodes=2 --node_rank, --master_addr on
# host 0's address), gloo on each host's own interface
# (GLOO_SOCKET_IFNAME).
#  - 2 hosts of 2 workers, HYBRID_SHARD with a shard group per host: bitwise
#    equal to single-process training;
#  - a worker killed on host 1: the job ends on both hosts, the surviving
#    workers' errors naming the dead rank, no process left.
# Skips with a message where network namespaces cannot be made.
#
# Why static rendezvous: torch elastic's dynamic (c10d) rendezvous gives
# the workers the agent's host name as MASTER_ADDR, and every namespace
# here shares the machine's name, which resolves to 127.0.0.1.
#
# Usage: train_c10d_hosts_test.sh PATH_TO_NETNS_HOSTS_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/netns_hosts.sh
source "$1"
fsdp=$(realpath "$2")
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
scale=${FLATPARAM_TEST_TIME_SCALE:-1}

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

if ! command -v torchrun >/dev/null 2>&1; then
  echo "FAIL: torchrun not found on PATH ($PATH); install python3-torch" >&2
  exit 1
fi
hosts_init 2 || exit 0

port=29571
# agent I OUT ARGS...: host I's torchrun agent (2 workers) running fsdp.
agent() {
  local i=$1 out=$2
  shift 2
  ip netns exec "$(hosts_ns "$i")" env GLOO_SOCKET_IFNAME=eth0 \
    timeout --kill-after=10 $((120 * scale)) torchrun --nnodes=2 \
    --node_rank="$i" --nproc_per_node=2 --rdzv_backend=static \
    --master_addr="$(hosts_ip 0)" --master_port="$port" \
    --redirects 1 --tee 1 --log_dir "$tmp/logs_$(basename "$out")" \
    --monitor_interval=0.5 --no_python "$fsdp" "$@" >"$out" 2>&1
}

# Bitwise across hosts.
agent 0 "$tmp/h0" train --strategy=HYBRID_SHARD --shard-group-size=2 \
  --check-reference --timeout=10s &
a0=$!
agent 1 "$tmp/h1" train --strategy=HYBRID_SHARD --shard-group-size=2 \
  --check-reference --timeout=10s &
a1=$!
wait "$a0"
s0=$?
wait "$a1"
s1=$?
cat "$tmp/h0"
[ "$s0" -eq 0 ] && [ "$s1" -eq 0 ] ||
  fail "training: exits $s0 and $s1: $(tail -c 2000 "$tmp/h0") $(tail -c 2000 "$tmp/h1")"
grep -q 'backend c10d, 4 ranks, HYBRID_SHARD' "$tmp/h0" ||
  fail "training: not 4 ranks on c10d"
grep -q 'bitwise equal' "$tmp/h0" || fail "training: not bitwise equal"

# A worker killed on host 1.
port=29572
agent 0 "$tmp/k0" train --steps=1000000 --log-every=1 --timeout=5s &
a0=$!
agent 1 "$tmp/k1" train --steps=1000000 --log-every=1 --timeout=5s &
a1=$!
killed=""
for _ in $(seq 1 $((1200 * scale))); do
  if grep -q 'fsdp train: step 3 loss' "$tmp/k0" 2>/dev/null; then
    for pid in $(pgrep -f "fsdp_c10d train --steps=1000000"); do
      if tr '\0' '\n' </proc/"$pid"/environ 2>/dev/null | grep -qx 'RANK=3'; then
        kill -KILL "$pid" && killed=yes
        break
      fi
    done
    break
  fi
  sleep 0.05
done
[ -n "$killed" ] || fail "kill: found no worker of rank 3 on host 1"
SECONDS=0
wait "$a0"
s0=$?
wait "$a1"
s1=$?
echo "kill: both agents ended ${SECONDS} s after the kill (exits $s0, $s1)"
[ "$s0" -ne 0 ] && [ "$s1" -ne 0 ] || fail "kill: a job went on (exits $s0, $s1)"
grep -h 'rank 3 did not reach\|closed by peer\|Connection reset' "$tmp/k0" "$tmp/k1" | head -n 2
grep -qh 'rank 3 did not reach' "$tmp/k0" "$tmp/k1" ||
  fail "kill: no error names rank 3: $(tail -c 2000 "$tmp/k0")"
left=$(pgrep -f "fsdp_c10d train --steps=1000000" || true)
[ -z "$left" ] || { fail "kill: processes left: $left"; kill -KILL $left; }

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "PASS"
