#!/usr/bin/env bash
# End-to-end test of `fsdp plan`: the table, the JSON schema (checked with
# python3's json module), the trace file, and exit code 2 for bad flags.
# Usage: plan_cli_test.sh PATH_TO_CLI_TEST_LIB_SH PATH_TO_FSDP
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"

expect_exit 0 plan --model=llama2-7b --nodes=2 --gpus-per-node=8 \
  --mixed-precision=bf16
for s in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD HYBRID_SHARD_ZERO2; do
  grep -q "^$s " "$tmp/out" || fail "table lacks $s"
done
grep -q '2 + 2 + 12 bytes per parameter' "$tmp/out" || fail "table lacks 2+2+12"
[ -s "$tmp/err" ] && fail "unexpected stderr: $(head -c 500 "$tmp/err")"

# JSON: the schema of issue 6, bytes as integers, the Adam accounting.
expect_exit 0 plan --model=llama2-7b --nodes=4 --gpus-per-node=8 \
  --mixed-precision=bf16 --optimizer=adamw --tokens-per-gpu=2048 \
  --topology=ib-hdr --gpu-memory=40GiB --format=json --trace="$tmp/trace.json"
cp "$tmp/out" "$tmp/plan.json"
python3 - "$tmp/plan.json" <<'PY' || fail "json schema"
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["world_size"] == 32, doc["world_size"]
psi = doc["param_numel"]
names = [s["strategy"] for s in doc["strategies"]]
assert names == ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                 "HYBRID_SHARD_ZERO2"], names
for s in doc["strategies"]:
    b = s["bytes_per_rank"]
    for k in ("params", "grads", "optimizer", "model_states"):
        assert type(b[k]) is int, (k, b[k])
    assert b["model_states"] == b["params"] + b["grads"] + b["optimizer"]
    for k in ("peak_bytes", "comm_bytes_per_step"):
        assert type(s[k]) is int, (k, s[k])
    for k in ("step_time_s", "exposed_comm_s"):
        assert isinstance(s[k], (int, float)) and s[k] >= 0, (k, s[k])
    assert type(s["fits"]) is bool
    assert s["fits"] == (s["peak_bytes"] <= 40 * 2**30)
full = doc["strategies"][0]["bytes_per_rank"]
assert full["model_states"] * 32 == 16 * psi, (full, psi)
assert full["optimizer"] * 32 == 12 * psi
PY
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert len(d["traceEvents"]) > 100' \
  "$tmp/trace.json" || fail "trace is not JSON"

# One strategy, SGD, a model file.
expect_exit 0 plan --model=gpt2 --strategy=NO_SHARD --optimizer=sgd \
  --format=json
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert [s["strategy"] for s in d["strategies"]] == ["NO_SHARD"]' \
  "$tmp/out" || fail "--strategy=NO_SHARD"

# Bad flags: exit 2 with the flag named.
expect_exit 2 plan --nodes=2
grep -q -- '--model' "$tmp/err" || fail "missing --model not named"
expect_exit 2 plan --model=gpt2 --nodes=0
grep -q -- '--nodes' "$tmp/err" || fail "--nodes=0 not named"
expect_exit 2 plan --model=gpt2 --strategy=ZERO9
expect_exit 2 plan --model=gpt2 --mixed-precision=fp8
expect_exit 2 plan --model=gpt2 --optimizer=lion
expect_exit 2 plan --model=gpt2 --topology=nvl72
grep -q 'dgx-h100' "$tmp/err" || fail "topology presets not listed"
expect_exit 2 plan --model=gpt2 --gpu-memory=lots
expect_exit 2 plan --model=gpt2 --efficiency=1.5
expect_exit 2 plan --model=gpt2 --gpus-per-node=0
expect_exit 2 plan --model=gpt2 --world-size=8
expect_exit 2 plan --model=gpt2 stray
# A model that does not exist is a failure, not a usage error.
expect_exit 1 plan --model=/nonexistent/model.json

expect_exit 0 plan --help
grep -q -- '--tokens-per-gpu' "$tmp/out" || fail "plan --help lacks flags"
grep -q -- '--simulate' "$tmp/out" || fail "plan --help lacks --simulate"

# --simulate: the runtime's step on every rank beside the plan, progress on
# stderr, and the checks.
expect_exit 0 plan --model=gpt2 --nodes=2 --gpus-per-node=4 \
  --strategy=HYBRID_SHARD --mixed-precision=bf16 --simulate
grep -q '^simulated HYBRID_SHARD on 8 ranks' "$tmp/out" || fail "no simulated row"
grep -q 'no deadlock, no desync, no stream race' "$tmp/out" || fail "checks"
grep -q 'simulating HYBRID_SHARD on 8 ranks' "$tmp/err" || fail "no progress"
expect_exit 0 plan --model=gpt2 --nodes=1 --gpus-per-node=4 \
  --strategy=FULL_SHARD --simulate --format=json
python3 - "$tmp/out" <<'PY' || fail "simulated json"
import json, sys
s = json.load(open(sys.argv[1]))["strategies"][0]
sim = s["simulated"]
assert abs(sim["step_time_s"] - s["step_time_s"]) <= 0.02 * s["step_time_s"], (sim, s)
assert sim["peak_bytes"] == s["peak_bytes"], (sim["peak_bytes"], s["peak_bytes"])
assert sim["races"] == [], sim["races"]
PY
# A conditional unit: a desync naming the unit and both sides' ranks, exit 4.
expect_exit 4 plan --model=gpt2 --nodes=2 --gpus-per-node=4 \
  --strategy=FULL_SHARD --simulate --conditional-unit=transformer.h.3:0-2
grep -q 'ranks 0-2: all_gather .* from unit transformer.h.3, forward unshard' \
  "$tmp/err" || fail "desync does not name the unit and ranks 0-2"
grep -q 'ranks 3-7: all_gather .* from unit transformer.h.4, forward unshard' \
  "$tmp/err" || fail "desync does not name the other side"
expect_exit 2 plan --model=gpt2 --simulate --conditional-unit=nope:0
expect_exit 2 plan --model=gpt2 --conditional-unit=transformer.h.3:0
expect_exit 2 plan --model=gpt2 --simulate --trace="$tmp/t.json"
# --simulate-save: the collective save after the step, at --save-gbps.
expect_exit 0 plan --model=gpt2 --nodes=2 --gpus-per-node=4 \
  --strategy=HYBRID_SHARD --simulate --simulate-save --save-gbps=1
grep -q '^  checkpoint .* written, at most .* by one rank' "$tmp/out" ||
  fail "no simulated checkpoint row"
expect_exit 2 plan --model=gpt2 --simulate-save
expect_exit 2 plan --model=gpt2 --save-gbps=3
expect_exit 2 plan --model=gpt2 --simulate --simulate-save --save-gbps=0

cli_test_finish
