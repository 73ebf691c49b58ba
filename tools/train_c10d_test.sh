#!/usr/bin/env bash
# fsdp train and fsdp collectives under torchrun (--backend=c10d, the
# default there), and torch elastic's restart: torchrun itself (Debian's
# python3-torch) starts the workers; `fsdp` continues in fsdp_c10d (the
# build with LibTorch's c10d).
#
#   1. 2 workers: fsdp train --check-reference is bitwise equal to
#      single-process training;
#   2. 4 workers, HYBRID_SHARD in groups of 2: the same;
#   3. fsdp collectives on 2 workers: the conformance suite passes;
#   4. torchrun --max_restarts=1, 2 workers saving every step (200 steps,
#      so that the kill lands mid-run on a loaded machine) with
#      --resume: one worker killed after step 3; torchrun restarts the
#      group, the run resumes from the newest complete checkpoint and ends
#      bitwise equal to single-process training of every step. Prints the
#      time from the kill to training again and the steps lost;
#   5. --backend=c10d outside torchrun: a clear error naming the variable;
#   7. `fsdp demo`'s LibTorch stage (fsdp_torch_demo, beside fsdp) on 2
#      workers: every loss and parameter bitwise single-process training's;
#   6. a node lost: two torchrun agents (--nnodes=1:2, one worker each) on
#      one rendezvous, A hosting its store; agent B and its worker are
#      killed mid-run; agent A's
#      worker fails, A restarts it, the rendezvous closes with the one node
#      left, and the run resumes on 1 worker from the newest complete
#      checkpoint with the same global batch, bitwise equal to
#      single-process training of every step.
#
# Usage: train_c10d_test.sh PATH_TO_FSDP
set -uo pipefail

fsdp=$1
tmp=${TEST_TMPDIR:-$(mktemp -d)}
failures=0
scale=${FLATPARAM_TEST_TIME_SCALE:-1}

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

now_ms() { date +%s%3N; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# trun NPROC OUT [TORCHRUN FLAGS...] -- FSDP ARGS...: torchrun with the
# flags Debian's 1.13 needs on Python 3.11 (comm/c10d/torchrun_test.sh
# says why), a rendezvous on a free port; output (every worker's, tagged
# [defaultN]:) to OUT.
trun() {
  local nproc=$1 out=$2
  shift 2
  local flags=()
  while [ "$1" != "--" ]; do
    flags+=("$1")
    shift
  done
  shift
  timeout --kill-after=10 $((120 * scale)) torchrun --nnodes=1 \
    --nproc_per_node="$nproc" --rdzv_backend=c10d \
    --rdzv_endpoint="127.0.0.1:$(free_port)" --redirects 1 --tee 1 \
    --log_dir "$tmp/logs.$(basename "$out")" --monitor_interval=0.5 \
    "${flags[@]}" --no_python "${binary:-$fsdp}" "$@" >"$out" 2>&1
}

# 1.
trun 2 "$tmp/t2" -- train --steps=3 --check-reference
status=$?
[ "$status" -eq 0 ] || fail "2 workers: exit $status: $(tail -c 3000 "$tmp/t2")"
grep -q 'backend c10d, 2 ranks' "$tmp/t2" || fail "2 workers: not on c10d"
grep -q 'bitwise equal' "$tmp/t2" || fail "2 workers: not bitwise equal"

# 2.
trun 4 "$tmp/t4" -- train --steps=3 --strategy=HYBRID_SHARD \
  --shard-group-size=2 --check-reference
status=$?
[ "$status" -eq 0 ] || fail "4 workers: exit $status: $(tail -c 3000 "$tmp/t4")"
grep -q 'backend c10d, 4 ranks, HYBRID_SHARD' "$tmp/t4" ||
  fail "4 workers: not HYBRID_SHARD on c10d"
grep -q 'bitwise equal' "$tmp/t4" || fail "4 workers: not bitwise equal"

# 3.
trun 2 "$tmp/c2" -- collectives --no-sweep --large-elements=0
status=$?
[ "$status" -eq 0 ] || fail "collectives: exit $status: $(tail -c 3000 "$tmp/c2")"
grep -q 'backend c10d, 2 ranks' "$tmp/c2" || fail "collectives: not on c10d"

# 3b. A desynchronised group under --desync-check: worker 1 runs
# layers.1's forward of step 2 without FSDP's hooks; every worker fails at
# that all-gather, naming both sides, not at the (long) timeout.
start=$(date +%s)
trun 2 "$tmp/d" -- train --steps=4 --fault-skip-forward=1:2:layers.1 \
  --desync-check --timeout=60s
status=$?
elapsed=$(($(date +%s) - start))
echo "desync-check: exit $status after ${elapsed} s"
[ "$status" -ne 0 ] || fail "desync-check: the run succeeded"
grep -E 'the group is desynchronised \(rank [01] called all_gather count [0-9]+ float32 #[0-9]+ from unit layers\.[12], forward unshard; rank [01] called all_gather count [0-9]+ float32 #[0-9]+ from unit layers\.[12], forward unshard\)' "$tmp/d" |
  grep 'rank 1 called all_gather count [0-9]* float32 #[0-9]* from unit layers.2' |
  grep -q 'rank 0 called all_gather count [0-9]* float32 #[0-9]* from unit layers.1' ||
  fail "desync-check: no desync error naming both sides: $(tail -c 3000 "$tmp/d")"
[ "$elapsed" -lt $((40 * scale)) ] ||
  fail "desync-check: took ${elapsed} s: the check did not end it"

# 4. Elastic restart.
ckpt="$tmp/ckpt"
mkdir -p "$ckpt"
trun 2 "$tmp/e" --max_restarts=1 -- train --steps=200 \
  --save="$ckpt/step{step}" --save-every=1 --resume --log-every=1 \
  --check-reference --timeout=10s --trace-dir="$tmp/etrace" &
job=$!
killed_at=""
for _ in $(seq 1 $((1200 * scale))); do
  if grep -q 'fsdp train: step 3 loss' "$tmp/e" 2>/dev/null; then
    for pid in $(pgrep -f "fsdp_c10d train .*$ckpt"); do
      if tr '\0' '\n' </proc/"$pid"/environ 2>/dev/null | grep -qx 'RANK=1'; then
        kill -KILL "$pid" && killed_at=$(now_ms)
        break
      fi
    done
    # The worker may not be listed yet (its /proc entry read mid-exec):
    # look again until it is, or the job has ended.
    [ -z "$killed_at" ] || break
    kill -0 "$job" 2>/dev/null || break
  fi
  sleep 0.05
done
[ -n "$killed_at" ] || fail "elastic: found no worker of rank 1 to kill: $(tail -c 2000 "$tmp/e")"
resumed_at=""
stepped_at=""
for _ in $(seq 1 $((1200 * scale))); do
  if [ -z "$resumed_at" ] && grep -q 'fsdp train: resumed from' "$tmp/e" 2>/dev/null; then
    resumed_at=$(now_ms)
  fi
  if [ -n "$resumed_at" ] &&
    sed -n '/fsdp train: resumed from/,$p' "$tmp/e" | grep -q 'fsdp train: step [0-9]* loss'; then
    stepped_at=$(now_ms)
    break
  fi
  sleep 0.05
done
wait "$job"
status=$?
[ "$status" -eq 0 ] || fail "elastic: exit $status: $(tail -c 4000 "$tmp/e")"
grep -q 'bitwise equal' "$tmp/e" || fail "elastic: not bitwise equal: $(tail -c 3000 "$tmp/e")"
# torchrun ended the surviving worker with SIGTERM: its flight record is
# there, and `fsdp diagnose` names the killed worker (the restarted group
# ran to the end and dumped nothing).
grep -q '"reason": "SIGTERM' "$tmp/etrace/rank_0.json" 2>/dev/null ||
  fail "elastic: rank 0 left no SIGTERM dump: $(ls "$tmp/etrace" 2>&1)"
"$fsdp" diagnose "$tmp/etrace" >"$tmp/ediag" 2>&1
diag_status=$?
cat "$tmp/ediag"
[ $((diag_status & 16)) -ne 0 ] && grep -q '^no dump: rank 1 wrote none' "$tmp/ediag" ||
  fail "elastic: fsdp diagnose (exit $diag_status) does not name the killed rank 1"
from=$(sed -n 's/.*fsdp train: resumed from .* at step \([0-9]*\)$/\1/p' "$tmp/e" | head -n 1)
# The last step the first attempt logged (rank 0 logs after each step).
before=$(sed -n '1,/fsdp train: resumed from/p' "$tmp/e" |
  sed -n 's/.*fsdp train: step \([0-9]*\) loss.*/\1/p' | tail -n 1)
if [ -n "$resumed_at" ] && [ -n "$stepped_at" ] && [ -n "$killed_at" ] &&
  [ -n "$from" ] && [ -n "$before" ]; then
  echo "elastic: rank 1 killed once step 3 was logged; the first attempt logged steps up to $before; torchrun restarted the group; resumed from the checkpoint of step $from $((resumed_at - killed_at)) ms after the kill, training again (step $from done) $((stepped_at - killed_at)) ms after it; steps lost: $((before + 1 - from))"
else
  fail "elastic: the run never resumed and trained: $(tail -c 3000 "$tmp/e")"
fi
# Saved every step: at most the step in flight is lost.
[ -n "$from" ] && [ -n "$before" ] && [ $((before + 1 - from)) -le 1 ] ||
  fail "elastic: resumed at step ${from:-none} after step ${before:-none} was logged"

# 5.
env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT \
  "$fsdp" train --backend=c10d >"$tmp/noenv" 2>&1
status=$?
[ "$status" -eq 1 ] || fail "outside torchrun: exit $status, expected 1"
grep -q 'WORLD_SIZE is not set' "$tmp/noenv" ||
  fail "outside torchrun: $(cat "$tmp/noenv")"

# 7. The demo's LibTorch stage.
binary="$(dirname "$fsdp")/fsdp_torch_demo" trun 2 "$tmp/demo" -- --steps=30
status=$?
[ "$status" -eq 0 ] || fail "demo: exit $status: $(tail -c 3000 "$tmp/demo")"
grep -q '2 workers over c10d: every loss and parameter bitwise equal to single-process training: yes' "$tmp/demo" ||
  fail "demo: $(tail -c 2000 "$tmp/demo")"

# 6. A node lost.
ckpt="$tmp/ckpt_nodes"
mkdir -p "$ckpt"
port=$(free_port)
node() {  # NAME
  timeout --kill-after=10 $((150 * scale)) torchrun --nnodes=1:2 \
    --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:$port" \
    --rdzv_id=nodes --rdzv_conf=last_call_timeout=3 --max_restarts=2 \
    --monitor_interval=0.5 --redirects 1 --tee 1 --log_dir "$tmp/logs_node_$1" \
    --no_python "$fsdp" train --steps=300 --save="$ckpt/step{step}" \
    --save-every=1 --resume --log-every=10 --check-reference --timeout=10s \
    >"$tmp/node_$1" 2>&1
}
# The rendezvous store lives in the agent that binds the endpoint first
# (the node torchrun's docs say must stay up); node b is started once it
# is, so that b connects to a's store and is the node that may be lost.
# The last call waits 3 s for b (its torchrun takes a second or two to
# start on a loaded machine).
node a &
node_a=$!
for _ in $(seq 1 $((400 * scale))); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null && break
  sleep 0.05
done
node b &
node_b=$!
killed_at=""
# As long as node a may run: on a loaded machine b can miss a's first
# rendezvous (a trains alone, then both restart when b joins), and step 29
# comes late.
for _ in $(seq 1 $((3000 * scale))); do
  if grep -q 'fsdp train: step 29 loss' "$tmp/node_a" "$tmp/node_b" 2>/dev/null; then
    grep -q 'failed to bind' "$tmp/node_b" ||
      fail "nodes: node b hosts the rendezvous store"
    # Node b: its agent (torchrun's Python process) and the agent's worker.
    agent=$(pgrep -f "python3.*torchrun.*logs_node_b" | head -n 1)
    if [ -n "$agent" ]; then
      workers=$(pgrep -P "$agent" | tr '\n' ' ')
      # shellcheck disable=SC2086
      kill -KILL "$agent" $workers
      killed_at=$(now_ms)
    fi
    break
  fi
  sleep 0.05
done
[ -n "$killed_at" ] || fail "nodes: node b was not found to kill"
resumed_at=""
for _ in $(seq 1 $((1800 * scale))); do
  if grep -q 'fsdp train: resumed from' "$tmp/node_a" 2>/dev/null; then
    resumed_at=$(now_ms)
    break
  fi
  sleep 0.05
done
wait "$node_a"
status=$?
wait "$node_b" 2>/dev/null
[ "$status" -eq 0 ] || fail "nodes: node a exited $status: $(tail -c 4000 "$tmp/node_a")"
grep -q 'backend c10d, 1 ranks' "$tmp/node_a" ||
  fail "nodes: did not go on with 1 worker: $(tail -c 3000 "$tmp/node_a")"
grep -q 'bitwise equal' "$tmp/node_a" ||
  fail "nodes: not bitwise equal: $(tail -c 3000 "$tmp/node_a")"
from=$(sed -n 's/.*fsdp train: resumed from .* at step \([0-9]*\)$/\1/p' "$tmp/node_a" | head -n 1)
if [ -n "$resumed_at" ] && [ -n "$killed_at" ]; then
  echo "nodes: node b killed once step 29 was logged; node a resumed alone from the checkpoint of step ${from:-?} $((resumed_at - killed_at)) ms after the kill"
fi
grep -h 'trained before' "$tmp/node_a" | head -n 1

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "PASS"
