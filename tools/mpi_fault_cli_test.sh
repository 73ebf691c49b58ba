#!/usr/bin/env bash
# `fsdp train` and `fsdp collectives` under mpirun with 4 ranks, one rank
# stopped (kill -STOP) or killed (kill -9) from outside while the job runs,
# or while it loads a checkpoint:
# the job ends within --timeout plus a slack, with the timeout printed and
# the stopped rank named, and no process left behind. Before the fix every
# stopped-rank run below hung in MPI_Finalize until the stopped rank went
# on (issue: "a hung or cut-off peer ends the job within the timeout").
#
# Usage: mpi_fault_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_MPIRUN_TEST_SH PATH_TO_FSDP PATH_TO_STOP_ON_OPEN_SO
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
mpirun_test=$2
cli_test_init "$3"
stop_on_open=$(realpath "$4")

timeout_s=4
# Beyond the timeout: see comm/mpi/mpi_fault_test.sh.
slack_s=$((${MPI_FAULT_SLACK_S:-15} * ${FLATPARAM_TEST_TIME_SCALE:-1}))
limit_s=90

now_ms() { date +%s%3N; }

# fault_run NAME SIGNAL RANK READY FSDP_ARGS...: starts the job, waits
# until its ranks work (until its stderr matches the regex READY, and a
# second more), sends SIGNAL to RANK, and waits for the job's end; sets
# $status and $elapsed_ms (from the signal to the end). READY, not a fixed
# sleep: on a loaded machine MPI's start may take longer than --timeout,
# and a rank stopped inside the start is another test's case
# (comm/mpi/mpi_fault_test.sh).
# The job runs fsdp through a link named for the run, so that its processes
# can be found (and none left behind).
fault_run() {
  local name=$1 signal=$2 rank=$3 ready=$4
  shift 4
  local program="$tmp/fsdp-fault-$name"
  ln -sf "$(realpath "$fsdp")" "$program"
  MPI_TEST_TIMEOUT_S=$limit_s "$mpirun_test" "$program" "$@" \
    --timeout="${timeout_s}s" >"$tmp/out" 2>"$tmp/err" &
  local job=$!
  local pid="" i
  for i in $(seq 1 300); do
    pid=$(mpi_rank_pid "$rank" "$program") && break
    sleep 0.1
  done
  if [ -z "$pid" ]; then
    fail "$name: rank $rank never started: $(head -c 2000 "$tmp/err")"
    wait "$job"
    return
  fi
  for i in $(seq 1 600); do
    grep -Eq -- "$ready" "$tmp/err" && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  if ! grep -Eq -- "$ready" "$tmp/err"; then
    fail "$name: never printed /$ready/: $(head -c 2000 "$tmp/err")"
  fi
  sleep 1  # The ranks work on.
  kill "-$signal" "$pid"
  local start
  start=$(now_ms)
  wait "$job"
  status=$?
  elapsed_ms=$(($(now_ms) - start))
  echo "$name: SIG$signal to rank $rank: exit $status after ${elapsed_ms} ms"
  local left
  left=$(pgrep -f -- "$program" || true)
  if [ -n "$left" ]; then
    fail "$name: processes left behind: $left"
    kill -KILL $left 2>/dev/null
  fi
  [ "$status" -ne 0 ] || fail "$name: the job succeeded"
  ! grep -q 'mpirun did not finish within' "$tmp/err" ||
    fail "$name: the job hung until the ${limit_s} s limit"
  [ "$elapsed_ms" -le $(((timeout_s + slack_s) * 1000)) ] ||
    fail "$name: the job ended ${elapsed_ms} ms after SIG$signal"
}

expect_err() {  # NAME PATTERN WHAT
  grep -qE -- "$2" "$tmp/err" ||
    fail "$1: stderr lacks $3: $(head -c 3000 "$tmp/err")"
}

# Rank 2 named among those a rank waits for: alone, or in a list when
# another rank is itself held up behind rank 2 ("ranks 0 and 2").
list_with_2='ranks? ([0-9]+(, | and ))*2\b'
names_rank_2="no data arrived from $list_with_2|$list_with_2 ha(s|ve) not taken this rank"

# Rank 2 stopped while the ranks train: the others time out, name it, and
# end the job. The stop lands wherever rank 2 is, so the collective that
# times out is an all-gather or, in the backward, a reduce-scatter.
# What the jobs print once their ranks train, or sweep.
train_ready='^fsdp train: step [0-9]+ loss'
sweep_ready='^fsdp collectives: sweep row 1 of'
fault_run train-stop STOP 2 "$train_ready" train --backend=mpi \
  --steps=1000000 --log-every=50
expect_err train-stop '^fsdp train: .*rank [013]: (all_gather|reduce_scatter|all_reduce) #[0-9]+ .*timed out after 4s' \
  "a timeout"
expect_err train-stop "$names_rank_2" \
  "the stopped rank named"
expect_err train-stop 'ending the MPI job \(MPI_Abort\)' "the job's end"

# The same during the collectives' sweep.
fault_run collectives-stop STOP 2 "$sweep_ready" collectives --backend=mpi \
  --conformance=false --progress --iterations=1000000 --max-bytes=65536
expect_err collectives-stop '^fsdp collectives: rank [013] of 4: .*timed out after 4s' \
  "a timeout"
expect_err collectives-stop "$names_rank_2" \
  "the stopped rank named"
expect_err collectives-stop 'ending the MPI job \(MPI_Abort\)' "the job's end"

# A killed rank: mpirun ends the job at once.
fault_run train-kill KILL 1 "$train_ready" train --backend=mpi \
  --steps=1000000 --log-every=50
fault_run collectives-kill KILL 1 "$sweep_ready" collectives \
  --backend=mpi --conformance=false --progress --iterations=1000000 \
  --max-bytes=65536

# Rank 2 stopped, or killed, while it loads its shard of a checkpoint (an
# LD_PRELOAD library signals it at the open of its rank file): the others
# time out in the load's exchange, or mpirun ends the job.
"$fsdp" train --world-size=4 --steps=1 --save="$tmp/ck4" >/dev/null 2>"$tmp/err" ||
  fail "saving the checkpoint to load: $(head -c 2000 "$tmp/err")"
load_fault() {  # NAME STOP|KILL
  local name=$1 signal=$2
  # (An ASan build's runtime then does not come first: allowed.)
  MPI_TEST_RANK_ENV="LD_PRELOAD=$stop_on_open STOP_ON_OPEN=ck4/rank00002.safetensors STOP_ON_OPEN_RANK=2 STOP_ON_OPEN_SIGNAL=$signal" \
    ASAN_OPTIONS="verify_asan_link_order=0" \
    MPI_TEST_TIMEOUT_S=$limit_s "$mpirun_test" "$fsdp" train --backend=mpi \
    --load="$tmp/ck4" --steps=1000000 --timeout="${timeout_s}s" \
    >"$tmp/out" 2>"$tmp/err"
  status=$?
  local end_ms stopped_ms elapsed_ms left
  end_ms=$(now_ms)
  stopped_ms=$(sed -n 's/^stop_on_open: rank 2: stopped at open of .* at \([0-9]*\)$/\1/p' "$tmp/err")
  if [ -z "$stopped_ms" ]; then
    fail "$name: rank 2 was not signalled at its rank file: $(head -c 2000 "$tmp/err")"
  else
    elapsed_ms=$((end_ms - stopped_ms))
    echo "$name: SIG$signal to rank 2 at its rank file: exit $status after ${elapsed_ms} ms"
    [ "$elapsed_ms" -le $(((timeout_s + slack_s) * 1000)) ] ||
      fail "$name: the job ended ${elapsed_ms} ms after the signal"
  fi
  [ "$status" -ne 0 ] || fail "$name: the job succeeded"
  ! grep -q 'mpirun did not finish within' "$tmp/err" ||
    fail "$name: the job hung until the ${limit_s} s limit"
  left=$(pgrep -f -- "$fsdp train --backend=mpi --load=$tmp/ck4" || true)
  [ -z "$left" ] || { fail "$name: processes left behind: $left"; kill -KILL $left; }
}
load_fault load-stop STOP
expect_err load-stop '^fsdp train: --load=.*rank [013]: .*timed out after 4s.*rank 2' \
  "a timeout of the load naming rank 2"
load_fault load-kill KILL

cli_test_finish
