#!/usr/bin/env bash
# `fsdp train` across real hosts: network namespaces joined by a switch,
# ranks launched into them by mpirun over TCP (tools/testing/netns_hosts.sh).
#  - Training across 2 and 4 hosts is bitwise equal to single-process
#    training, as on one host.
#  - A rank stopped or killed on another host, and a cut link, end the job
#    within --timeout plus a slack, with no process left on any host.
#  - A link that loses packets for a while but recovers within the timeout
#    does not fail the run, which stays bitwise equal.
# Skips with a message where network namespaces cannot be made.
#
# Usage: train_hosts_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_NETNS_HOSTS_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
# shellcheck source=tools/testing/netns_hosts.sh
source "$2"
cli_test_init "$3"
fsdp=$(realpath "$fsdp")

if ! command -v mpirun >/dev/null 2>&1; then
  fail "mpirun not found on PATH ($PATH); install openmpi-bin"
  cli_test_finish
fi
hosts_init 4 || exit 0

timeout_s=4
# Beyond the timeout: see comm/mpi/mpi_fault_test.sh.
slack_s=$((${MPI_FAULT_SLACK_S:-15} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
export HOSTS_MPIRUN_LIMIT_S=90

now_ms() { date +%s%3N; }

# Bitwise equal across hosts: 2 hosts of 2 ranks (HYBRID_SHARD, a shard
# group per host) and 4 hosts of one.
hosts_mpirun 2 2 "$fsdp" train --backend=mpi --strategy=HYBRID_SHARD \
  --shard-group-size=2 --check-reference >"$tmp/out" 2>"$tmp/err"
status=$?
cat "$tmp/out"
[ "$status" -eq 0 ] || fail "2 hosts x 2 ranks exited $status: $(head -c 2000 "$tmp/err")"
grep -q 'bitwise equal' "$tmp/out" || fail "2 hosts x 2 ranks: not bitwise equal"
hosts_mpirun 4 1 "$fsdp" train --backend=mpi --strategy=FULL_SHARD \
  --check-reference >"$tmp/out" 2>"$tmp/err"
status=$?
[ "$status" -eq 0 ] || fail "4 hosts exited $status: $(head -c 2000 "$tmp/err")"
grep -q 'bitwise equal' "$tmp/out" || fail "4 hosts: not bitwise equal"

# host_fault NAME ACTION TARGET [TIMEOUT_S [FSDP_ARGS...]]: runs fsdp (by
# default training) on 4 hosts, one rank each, until ACTION hits TARGET
# (stop or kill rank TARGET, or cut host TARGET's link), then checks that
# the job ends within the bound and leaves nothing behind. FSDP_ARGS must
# make the job print its progress (train --log-every, collectives
# --progress).
host_fault() {
  local name=$1 action=$2 target=$3 timeout_s=${4:-$timeout_s}
  local command=("${@:5}")
  [ "${#command[@]}" -gt 0 ] ||
    command=(train --backend=mpi --steps=1000000 --log-every=50)
  hosts_mpirun 4 1 "$fsdp" "${command[@]}" \
    --timeout="${timeout_s}s" >"$tmp/out" 2>"$tmp/err" &
  local job=$! pid="" i
  for i in $(seq 1 300); do
    pid=$(hosts_rank_pid 3) && break
    sleep 0.1
  done
  [ -n "$pid" ] || fail "$name: rank 3 never started: $(head -c 2000 "$tmp/err")"
  # Past the start for certain (a loaded machine may take longer than
  # --timeout to start MPI): the job says its ranks train, or sweep.
  local ready='^fsdp (train: step [0-9]+ loss|collectives: sweep row 1 of)'
  for i in $(seq 1 600); do
    grep -Eq -- "$ready" "$tmp/err" && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  grep -Eq -- "$ready" "$tmp/err" ||
    fail "$name: never printed /$ready/: $(head -c 2000 "$tmp/err")"
  sleep 1  # The ranks work on.
  case $action in
    stop) kill -STOP "$(hosts_rank_pid "$target")" ;;
    kill) kill -KILL "$(hosts_rank_pid "$target")" ;;
    cut) hosts_link "$target" down ;;
  esac
  local start
  start=$(now_ms)
  wait "$job"
  status=$?
  local elapsed_ms=$(($(now_ms) - start))
  echo "$name: $action $target: exit $status after ${elapsed_ms} ms"
  [ "$action" != cut ] || hosts_link "$target" up
  # The launcher's daemons go a moment after mpirun.
  local left=""
  hosts_wait_empty 3 || left=$(hosts_pids)
  if [ -n "$left" ]; then
    fail "$name: processes left behind: $(ps -o pid,stat,args -p "$(echo $left | tr ' ' ',')")"
    kill -KILL $left 2>/dev/null
  fi
  [ "$status" -ne 0 ] || fail "$name: the job succeeded"
  [ "$status" -ne 124 ] || fail "$name: the job hung until the limit"
  local bound_s=${HOST_FAULT_BOUND_S:-$((timeout_s + slack_s))}
  [ "$elapsed_ms" -le $((bound_s * 1000)) ] ||
    fail "$name: the job ended ${elapsed_ms} ms after the fault"
}

host_fault stop stop 3
grep -qE 'timed out after 4s.*(no data arrived from rank 3|rank 3 has not taken this rank)' "$tmp/err" ||
  fail "stop: no timeout naming rank 3: $(head -c 3000 "$tmp/err")"
host_fault kill kill 3
# A cut link: the launcher's keepalive (netns_hosts.sh: about 6 s) must
# notice the lost host before the ranks' timeout ends the job, since an
# abort cannot reach a host behind a cut link; so --timeout=10s here.
host_fault cut cut 2 10
# Open MPI's launcher reports the lost host (its words vary: "lost
# communication with a remote daemon", or a misleading "unable to reliably
# start one or more daemons").
grep -qE 'lost communication with a remote daemon|unable to reliably start one or more daemons|no data arrived from rank 2' \
  "$tmp/err" || fail "cut: the lost host is not reported: $(head -c 3000 "$tmp/err")"
host_fault collectives-cut cut 2 10 collectives --backend=mpi \
  --conformance=false --progress --iterations=1000000 --max-bytes=65536

# The same cut with the flight recorder (issue 29): every rank, the one
# behind the cut included, writes its dump (into this shared file system),
# and `fsdp diagnose` names rank 2, the collective and the unit. The ranks
# end at their timeout (dump, MPI_Abort, at most 2 s more); with the
# SIGTERM grace period that dumps need (the README's advice), Open MPI's
# launcher then waits about 45 s for the lost daemon before it exits, so
# this case is bounded by that rather than by the timeout (the cut cases
# above check the timeout's bound).
rm -rf "$tmp/cut-trace"
HOSTS_SIGKILL_TIMEOUT_S=10 HOST_FAULT_BOUND_S=$((75 * ${FLATPARAM_TEST_TIME_SCALE:-1})) \
  host_fault cut-dumps cut 2 10 train --backend=mpi --steps=1000000 \
  --log-every=50 --trace-dir="$tmp/cut-trace"
for r in 0 1 2 3; do
  [ -s "$tmp/cut-trace/rank_$r.json" ] ||
    fail "cut-dumps: rank $r wrote no dump: $(ls "$tmp/cut-trace" 2>&1)"
done
"$fsdp" diagnose "$tmp/cut-trace" >"$tmp/diagnose.out" 2>&1
status=$?
head -4 "$tmp/diagnose.out"
[ $((status & 4)) -ne 0 ] || fail "cut-dumps: diagnose exit $status lacks the stuck bit"
# Where the cut lands decides the picture: rank 2 alone finished the
# collective in flight, or alone did not (the only rank on its side), or
# every rank is in it and the others' errors name rank 2.
grep -Eq '^suspect: rank 2: ' "$tmp/diagnose.out" ||
  fail "cut-dumps: diagnose does not suspect rank 2: $(head -c 2000 "$tmp/diagnose.out")"
# The collective (with its unit, unless the cut caught the trainer's own
# loss all-gather, which no unit issues: then every rank may be in it).
grep -Eq '^stuck: .*[a-z_]+ #[0-9]+ of [0-9]+ [a-z0-9]+' "$tmp/diagnose.out" ||
  fail "cut-dumps: the stuck verdict names no collective: $(head -c 2000 "$tmp/diagnose.out")"
if ! grep -Eq '^stuck: .*#[0-9]+ of 1 float32 of group world' "$tmp/diagnose.out"; then
  grep -Eq '^stuck: .*\(unit [^)]*\)' "$tmp/diagnose.out" ||
    fail "cut-dumps: the stuck verdict names no unit: $(head -c 2000 "$tmp/diagnose.out")"
fi

# A link that loses packets for 3 s and then recovers, well within the
# timeout: TCP retransmits, and the run succeeds bitwise.
hosts_mpirun 4 1 "$fsdp" train --backend=mpi --steps=200 --check-reference \
  --timeout=30s >"$tmp/out" 2>"$tmp/err" &
job=$!
for i in $(seq 1 300); do
  hosts_rank_pid 3 >/dev/null && break
  sleep 0.1
done
sleep 0.5
hosts_loss 1 10
sleep 3
hosts_loss 1 off
wait "$job"
status=$?
echo "lossy link: exit $status"
[ "$status" -eq 0 ] || fail "lossy link: exit $status: $(head -c 2000 "$tmp/err")"
grep -q 'bitwise equal' "$tmp/out" || fail "lossy link: not bitwise equal"

# Restart after losing a host: train on 4 hosts saving every step in the
# background, kill one host's rank mid-run, and resume from the newest
# published checkpoint on the 3 hosts left (one command), with the batch
# changed to one that 3 ranks split; the continued training is bitwise
# equal to single-process training of every step.
hosts_mpirun 4 1 "$fsdp" train --backend=mpi --steps=1000000 \
  --save="$tmp/elastic{step}" --save-every=1 --async-save \
  --timeout="${timeout_s}s" >"$tmp/out" 2>"$tmp/err" &
job=$!
for i in $(seq 1 300); do
  [ -f "$tmp/elastic3/manifest.json" ] && break
  sleep 0.1
done
kill -KILL "$(hosts_rank_pid 2)"
wait "$job"
echo "elastic: the 4-host run ended with $? after losing rank 2"
hosts_wait_empty 3 || fail "elastic: processes left behind"
hosts_mpirun 3 1 "$fsdp" train --backend=mpi --steps=2 \
  --load="$tmp/elastic{step}" --global-batch=6 --check-reference \
  >"$tmp/out" 2>"$tmp/err"
status=$?
cat "$tmp/out"
[ "$status" -eq 0 ] || fail "elastic: the restart exited $status: $(head -c 2000 "$tmp/err")"
grep -q '^# the newest complete checkpoint of ' "$tmp/out" ||
  fail "elastic: not resumed from the newest checkpoint"
grep -qE 'on 4 ranks FULL_SHARD with 1 micro-batch of 8 samples; then this run\): 0 .*bitwise equal' \
  "$tmp/out" || fail "elastic: the restart is not bitwise equal"

# Hosts without a shared file system: each has only its own disk at the
# same path. A save across them fails on every rank, saying that a
# checkpoint needs a directory every rank sees, and leaves rank 0's disk
# without a partial checkpoint; a checkpoint on host 0's disk alone does
# not load on 2 hosts, and the error says why.
hosts_mpirun 2 1 "$fsdp" train --backend=mpi --steps=1 \
  --save="$hosts_disk/local" >"$tmp/out" 2>"$tmp/err"
status=$?
[ "$status" -eq 1 ] || fail "local disks: the save exited $status, want 1"
grep -q 'rank 1: this rank does not see .*every rank sees' "$tmp/err" ||
  fail "local disks: the save's error does not say why: $(head -c 2000 "$tmp/err")"
[ -z "$(ls -A "$(hosts_disk_of 0)")" ] ||
  fail "local disks: host 0's disk keeps $(ls -A "$(hosts_disk_of 0)")"
"$fsdp" train --world-size=2 --steps=1 --save="$(hosts_disk_of 0)/ckpt" \
  >/dev/null 2>"$tmp/err" || fail "sim save to host 0's disk: $(cat "$tmp/err")"
hosts_mpirun 2 1 "$fsdp" train --backend=mpi --steps=1 \
  --load="$hosts_disk/ckpt" >"$tmp/out" 2>"$tmp/err"
status=$?
[ "$status" -eq 1 ] || fail "local disks: the load exited $status, want 1"
grep -q 'rank 1: .*(rank 0 found it: a checkpoint must be on a file system that every rank sees' \
  "$tmp/err" || fail "local disks: the load's error does not say why: $(head -c 2000 "$tmp/err")"

hosts_finish
cli_test_finish
