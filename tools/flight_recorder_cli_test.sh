#!/usr/bin/env bash
# The flight recorder in real processes: `fsdp train --backend=mpi
# --trace-dir=DIR` under mpirun with 4 ranks, and `fsdp diagnose DIR` on
# what the ranks left there, for a stopped rank (kill -STOP), a killed rank
# (kill -9), a rank that skips a unit's forward in step 2 (a desync), the
# same desync under --desync-check, and SIGUSR1 on a running job.
#
# Usage: flight_recorder_cli_test.sh CLI_TEST_LIB_SH MPIRUN_TEST_SH FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
mpirun_test=$2
cli_test_init "$3"

scale=${FLATPARAM_TEST_TIME_SCALE:-1}
limit_s=90
# When one process fails, mpirun ends the others with SIGTERM and, 1 s
# later by default, SIGKILL: too soon for their dumps on a loaded machine
# (a timed-out rank's MPI_Abort ends its peers before their own timeouts
# come). The README tells mpirun users to raise it, as here.
export OMPI_MCA_odls_base_sigkill_timeout=10

# start_job NAME ARGS...: starts `fsdp train` under mpirun through a link
# named for the run (so that its processes can be found), with
# --trace-dir=$tmp/NAME; sets $job and $program.
start_job() {
  local name=$1
  shift
  program="$tmp/fsdp-flight-$name"
  ln -sf "$(realpath "$fsdp")" "$program"
  rm -rf "${tmp:?}/$name"
  MPI_TEST_TIMEOUT_S=$limit_s "$mpirun_test" "$program" train --backend=mpi \
    --trace-dir="$tmp/$name" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
  job=$!
}

# wait_ready NAME: until rank 0 logs a step.
wait_ready() {
  local i
  for i in $(seq 1 600); do
    grep -q '^fsdp train: step [0-9]* loss' "$tmp/$1.err" && return 0
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  fail "$1: never trained: $(head -c 2000 "$tmp/$1.err")"
  return 1
}

# signal_rank NAME SIGNAL RANK
signal_rank() {
  local pid="" i
  for i in $(seq 1 100); do
    pid=$(mpi_rank_pid "$3" "$program") && break
    sleep 0.1
  done
  [ -n "$pid" ] || { fail "$1: rank $3 not found"; return 1; }
  kill "-$2" "$pid"
}

# end_job NAME: waits for the job and checks no process is left.
end_job() {
  wait "$job"
  local left
  left=$(pgrep -f -- "$program" || true)
  if [ -n "$left" ]; then
    fail "$1: processes left behind: $left"
    kill -KILL $left 2>/dev/null
  fi
}

# diagnose NAME WANT_EXIT_MASK: runs fsdp diagnose on the run's dumps into
# $tmp/NAME.diag and checks that the exit status has the bits of the mask.
diagnose() {
  "$fsdp" diagnose "$tmp/$1" >"$tmp/$1.diag" 2>&1
  local got=$?
  echo "--- $1: fsdp diagnose exited $got"
  cat "$tmp/$1.diag"
  if [ "$got" -eq 1 ] || [ "$got" -eq 2 ] || [ $((got & $2)) -ne "$2" ]; then
    fail "$1: fsdp diagnose exited $got, want the bits of $2"
  fi
}

expect_diag() {  # NAME REGEX WHAT
  grep -qE -- "$2" "$tmp/$1.diag" || fail "$1: the diagnosis lacks $3"
}

have_dumps() {  # NAME RANKS...
  local name=$1 r
  shift
  for r in "$@"; do
    [ -s "$tmp/$name/rank_$r.json" ] || fail "$name: rank $r wrote no dump"
  done
}

# 1. Rank 2 stopped mid-run: the others time out, dump, and the job ends;
# the stopped rank writes nothing.
start_job stop --steps=1000000 --log-every=20 --timeout=4s
wait_ready stop && sleep 1 && signal_rank stop STOP 2
end_job stop
# mpirun sends SIGCONT before SIGTERM, so the stopped rank may dump too:
# then it is the one that never saw the collective fail.
have_dumps stop 0 1 3
diagnose stop 4
expect_diag stop '^(no dump: rank 2 wrote none|stalled: rank 2 never saw|suspect: rank 2:)' \
  "the stopped rank named"
# The stop lands in an FSDP hook's collective (its unit and phase named)
# or in the trainer's own loss gather (no FSDP context).
expect_diag stop '(wait for it from|never saw|never finished) (all_gather|reduce_scatter|all_reduce) #[0-9]+ of [0-9]+ float32 (\(unit [^)]*(forward unshard|prefetch|pre-backward unshard|post-backward reduce|finalize backward)\) )?of group world' \
  "the collective (and unit and phase) the ranks stopped in"
expect_diag stop 'first failure: DEADLINE_EXCEEDED: .*timed out after 4s' \
  "the timeouts"

# 2. Rank 1 killed: mpirun ends the others with SIGTERM, and they dump
# then.
start_job kill --steps=1000000 --log-every=20 --timeout=30s
wait_ready kill && sleep 1 && signal_rank kill KILL 1
end_job kill
have_dumps kill 0 2 3
grep -q 'SIGTERM' "$tmp/kill/rank_0.json" ||
  fail "kill: rank 0's dump is not SIGTERM's"
diagnose kill 16
expect_diag kill '^no dump: rank 1 wrote none' "the killed rank"

# 3. Rank 1 runs layers.1's forward of step 2 without FSDP's hooks: its
# all-gathers shift by one unit (MPI completes some with truncated data).
start_job skip --steps=4 --fault-skip-forward=1:2:layers.1 --timeout=4s
end_job skip
diagnose skip 8
expect_diag skip '^desync: in group world at #[0-9]+ the ranks disagree on the collective: rank 1 issued all_gather #[0-9]+ of [0-9]+ float32 \(unit layers.2, forward unshard\); ranks 0, 2 and 3 issued all_gather #[0-9]+ of [0-9]+ float32 \(unit layers.1, forward unshard\)' \
  "the desync at layers.1's all-gather"

# 4. The same under --desync-check: every rank fails at that collective,
# well before the (long) timeout.
start=$(date +%s)
start_job skipcheck --steps=4 --fault-skip-forward=1:2:layers.1 \
  --desync-check --timeout=60s
end_job skipcheck
elapsed=$(($(date +%s) - start))
echo "skipcheck: ended after ${elapsed} s"
[ "$elapsed" -lt $((30 * scale)) ] ||
  fail "skipcheck: took ${elapsed} s: the check did not stop it"
grep -qE 'rank [023]: all_gather #[0-9]+ .*the group is desynchronised \(ranks 0,2,3 called all_gather #[0-9]+ count 276 float32 context [0-9a-f]+; rank 1 called all_gather #[0-9]+ count 98 float32 context [0-9a-f]+\); this rank issued it from unit layers.1, forward unshard' \
  "$tmp/skipcheck.err" ||
  fail "skipcheck: no desync error naming both sides: $(head -c 2000 "$tmp/skipcheck.err")"
! grep -q 'timed out' "$tmp/skipcheck.err" ||
  fail "skipcheck: a timeout reported it, not the check"
have_dumps skipcheck 0 1 2 3
diagnose skipcheck 8
expect_diag skipcheck '^desync: in group world at #[0-9]+ .*rank 1 issued all_gather #[0-9]+ of 98 float32 \(unit layers.2' \
  "the desync"
! grep -q '^stuck:' "$tmp/skipcheck.diag" ||
  fail "skipcheck: the desync is blamed on the transport"

# 5. SIGUSR1 to rank 3 of a running job: it dumps and the job goes on.
start_job usr1 --steps=1000000 --log-every=20 --timeout=30s
wait_ready usr1 && signal_rank usr1 USR1 3
for i in $(seq 1 100); do
  [ -s "$tmp/usr1/rank_3.json" ] && break
  sleep 0.1
done
grep -q '"reason": "SIGUSR1"' "$tmp/usr1/rank_3.json" 2>/dev/null ||
  fail "usr1: rank 3 did not dump on SIGUSR1"
[ ! -e "$tmp/usr1/rank_0.json" ] || fail "usr1: rank 0 dumped too"
sleep 1
kill -0 "$job" 2>/dev/null || fail "usr1: the job stopped"
signal_rank usr1 TERM 0
end_job usr1

cli_test_finish
