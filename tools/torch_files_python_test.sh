#!/usr/bin/env bash
# torch.save files between Python PyTorch and flatparam, with Debian's
# python3-torch 1.13 as the independent party: Python writes a state dict
# (single file and index-sharded by hand; with a parameter tied to the
# embedding, as GPT-2's lm_head, and BatchNorm buffers, an int64 count
# among them) and an AdamW optimizer state dict;
# fsdp_torch_files imports them at world sizes 2 and 3 (FULL_SHARD,
# SHARD_GRAD_OP with alignment) and exports them (single file with the
# optimizer keyed by ID; index-sharded with it keyed by name); Python loads
# every export with torch.load(weights_only=True) and finds the original
# tensors and optimizer state bit for bit (torch.equal, dtype, shape),
# load_state_dict(strict=True) takes it, and
# the optimizer state loads into a fresh AdamW. Then bad inputs: a pickle
# that would call os.system and a legacy-format file are refused (exit 1,
# message naming them). Skips, passing and saying so, without a python3
# that imports torch.
# Then Distributed Checkpoint: Python's DCP (1.13's writer, on 2 and 4 gloo
# ranks) saves the same model and optimizer; fsdp_torch_files imports it at
# 3 ranks and exports torch.save files, which Python finds equal, bit for
# bit, to the originals; and exports DCP directories, which Python's DCP
# loads and finds equal.
# Usage: torch_files_python_test.sh FSDP_TORCH_FILES CHECK_PY DCP_SHIM_PY
set -euo pipefail

tool=$1
check=$2
shim_dir=$(dirname "$3")  # dcp_shim.py: torch 1.13's DCP on Python 3.11

# --help prints the usage and the flags (absl's default printed "No flags
# matched" for this binary).
help=$("$tool" --help 2>&1 || true)
for want in "usage: fsdp_torch_files import" "--world_size" "--optimizer_keys"; do
  if ! grep -qF -- "$want" <<<"$help"; then
    echo "FAIL: fsdp_torch_files --help lacks '$want':"
    echo "$help"
    exit 1
  fi
done

python=""
for p in /usr/bin/python3 python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import torch' 2>/dev/null; then
    python=$p
    break
  fi
done
if [ -z "$python" ]; then
  echo "SKIPPED: no python3 that imports torch (install Debian's python3-torch)"
  exit 0
fi
echo "using $python, torch $("$python" -c 'import torch; print(torch.__version__)')"

tmp=${TEST_TMPDIR:-$(mktemp -d)}/torch_files
rm -rf "$tmp"
mkdir -p "$tmp"
"$python" "$check" write "$tmp"
py=$tmp/py

for w in 2 3; do
  strategy=FULL_SHARD
  align=
  if [ "$w" = 3 ]; then
    strategy=SHARD_GRAD_OP
    align=--align-addresses
  fi
  "$tool" import --in="$py/pytorch_model.bin" --optimizer="$py/optimizer.pt" \
    --model="$py/model.json" --world-size=$w --strategy=$strategy $align \
    --out="$tmp/ckpt$w"
  "$tool" export --in="$tmp/ckpt$w" --out="$tmp/out$w"
  "$tool" export --in="$tmp/ckpt$w" --out="$tmp/out${w}_named" \
    --optimizer-keys=name --max-shard-size=200B
  test -f "$tmp/out${w}_named/pytorch_model.bin.index.json"
done
# Python's index-sharded files, and flatparam's name-keyed optimizer file.
"$tool" import --in="$py/sharded" --optimizer="$tmp/out2_named/optimizer.bin" \
  --model="$py/model.json" --world-size=3 --out="$tmp/ckpt_sharded"
"$tool" export --in="$tmp/ckpt_sharded" --out="$tmp/out_sharded"
# The model named by a checkpoint of it (as a job's own checkpoint names
# the model it saved), instead of a model file.
"$tool" import --in="$py/pytorch_model.bin" --optimizer="$py/optimizer.pt" \
  --model="$tmp/ckpt2" --world-size=4 --out="$tmp/ckpt_from_ckpt"
"$tool" export --in="$tmp/ckpt_from_ckpt" --out="$tmp/out_from_ckpt"

# Distributed Checkpoint: PyTorch 1.13's own DCP writer on 2 and 4 gloo
# ranks (ShardedTensors chunked on dim 0, DCP 2.x's flattened keys), into
# flatparam at 3 ranks, out as torch.save files Python compares.
for w in 2 4; do
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$python" "$check" write_dcp "$tmp" "$w" "$port" "$shim_dir"
  strategy=FULL_SHARD
  align=
  if [ "$w" = 4 ]; then
    strategy=SHARD_GRAD_OP
    align=--align-addresses
  fi
  "$tool" import --in="$tmp/dcp_w$w" --model="$py/model.json" --world-size=3 \
    --strategy=$strategy $align --out="$tmp/ckpt_dcp$w"
  "$tool" export --in="$tmp/ckpt_dcp$w" --out="$tmp/out_dcp$w"
done

# And back out as DCP: 1.13's layout, loaded by 1.13's own
# load_state_dict; 2.x's, loaded through 1.13 with 2.x's module paths
# aliased, and imported again by flatparam (at 2 ranks) for the torch.save
# comparison below.
"$tool" export --format=dcp --dcp-format=1.13 --dcp-world-size=3 \
  --in="$tmp/ckpt_dcp2" --out="$tmp/dcp_out113"
"$python" "$check" check_dcp "$tmp" dcp_out113 "$shim_dir"
"$tool" export --format=dcp --dcp-world-size=4 --in="$tmp/ckpt_dcp4" \
  --out="$tmp/dcp_out2"
"$python" "$check" check_dcp "$tmp" dcp_out2 "$shim_dir" 2
"$tool" import --in="$tmp/dcp_out2" --model="$py/model.json" --world-size=2 \
  --out="$tmp/ckpt_dcp_back"
"$tool" export --in="$tmp/ckpt_dcp_back" --out="$tmp/out_dcp_back"

"$python" "$check" check "$tmp" out2 out2_named out3 out3_named out_sharded \
  out_from_ckpt out_dcp2 out_dcp4 out_dcp_back

# Refusals: exit 1 with the reason.
"$python" - "$tmp" <<'PY'
import os, sys, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.path.join(sys.argv[1], "PWNED"),))
torch.save({"w": Evil()}, os.path.join(sys.argv[1], "evil.bin"))
torch.save({"w": torch.ones(2)}, os.path.join(sys.argv[1], "legacy.bin"),
           _use_new_zipfile_serialization=False)
PY
expect_refusal() {
  local what=$1 pattern=$2
  shift 2
  set +e
  "$tool" "$@" >"$tmp/stdout" 2>"$tmp/stderr"
  local rc=$?
  set -e
  if [ $rc -ne 1 ] || ! grep -q -- "$pattern" "$tmp/stderr"; then
    echo "FAIL: $what: exit $rc, stderr:"
    cat "$tmp/stderr"
    exit 1
  fi
  echo "refused as expected ($what): $(cat "$tmp/stderr")"
}
expect_refusal "os.system pickle" "posix.system" import --in="$tmp/evil.bin" \
  --model="$py/model.json" --world-size=2 --out="$tmp/evil_ckpt"
test ! -e "$tmp/PWNED"
test ! -e "$tmp/evil_ckpt"
expect_refusal "legacy format" "legacy" import --in="$tmp/legacy.bin" \
  --model="$py/model.json" --world-size=2 --out="$tmp/legacy_ckpt"
expect_refusal "optimizer file as weights" "not a tensor" import \
  --in="$py/optimizer.pt" --model="$py/model.json" --world-size=2 \
  --out="$tmp/wrong_ckpt"
echo PASS
