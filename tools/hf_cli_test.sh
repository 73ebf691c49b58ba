#!/usr/bin/env bash
# End-to-end test of Hugging Face checkpoints through the `fsdp` binary,
# checked by an independent reader and writer (testdata/hf_numpy.py: numpy
# and json only, no torch, no safetensors package): checkpoints written by
# numpy (single file and index-sharded, wrapper-prefixed names, a repeated
# tied parameter, a rotary buffer, bf16) are imported with `checkpoint
# shard`, resharded, and exported with `checkpoint export`; numpy reads the
# export back and must find the original tensors bit for bit (or cast with
# round to nearest even); the export's files, index and size cap are
# checked; bad inputs exit 1 and bad flags 2, with messages naming the file
# and tensor.
# Usage: hf_cli_test.sh CLI_TEST_LIB FSDP TINY_MODEL_JSON HF_NUMPY_PY
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"
tiny=$3
hf_numpy=$4

# Debian's python3-numpy (tools/setup.sh installs it); the build's
# environment puts /usr/bin first.
python=""
for p in /usr/bin/python3 python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import numpy' 2>/dev/null; then
    python=$p
    break
  fi
done
if [ -z "$python" ]; then
  echo "FAIL: no python3 with numpy (run tools/setup.sh, which installs" \
    "python3-numpy)" >&2
  exit 1
fi
np() { "$python" "$hf_numpy" "$@" || fail "hf_numpy.py $*"; }

# 1. Index-sharded, wrapped names, tied copy, buffer: import at W=4,
#    reshard to HYBRID_SHARD 2 x 3 aligned, export split at 150 bytes.
np make --spec="$tiny" --out="$tmp/hf" --shards=3 --wrap --tied-copy \
  --inv-freq --seed=1
expect_exit 0 checkpoint shard --in="$tmp/hf" --model="$tiny" \
  --world-size=4 --out="$tmp/s4"
grep -q "imported 7 tensors of 3 Hugging Face files into model tiny (1 tied copy checked, 1 buffer skipped, 0 cast)" \
  "$tmp/out" || fail "import report: $(cat "$tmp/out")"
grep -q "^checkpoint shard: wrote $tmp/s4: [0-9]* bytes" "$tmp/out" ||
  fail "shard summary: $(cat "$tmp/out")"
expect_exit 0 checkpoint verify --in="$tmp/s4"
expect_exit 0 checkpoint reshard --in="$tmp/s4" --world-size=6 \
  --strategy=HYBRID_SHARD --shard-group-size=3 --align-addresses \
  --out="$tmp/h6"
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/out150" \
  --max-shard-size=150
grep -q "7 tensors, total_size 476 bytes, in model-00001-of-00004.safetensors, .*, model.safetensors.index.json" \
  "$tmp/out" || fail "export report: $(cat "$tmp/out")"
grep -q '^checkpoint export: wrote .*/out150: [0-9]* bytes in .* peak RSS' "$tmp/out" ||
  fail "export summary: $(cat "$tmp/out")"
np check --dir="$tmp/out150" --max-shard-size=150 --files=4 --tensors=7
# The tied copy is written once, under the target's name.
np compare --expected="$tmp/hf" --actual="$tmp/out150" --skip=head.weight
# The export imports back: same shards as the first import.
expect_exit 0 checkpoint shard --in="$tmp/out150" --model="$tiny" \
  --world-size=4 --out="$tmp/s4b"
for f in layout.json rank00000.safetensors rank00003.safetensors \
  rank00002.json; do
  cmp -s "$tmp/s4/$f" "$tmp/s4b/$f" || fail "$f differs after export -> import"
done
expect_exit 0 checkpoint verify --in="$tmp/out150"
grep -q 'ok: Hugging Face checkpoint, 4 files, 7 tensors, 476 bytes' \
  "$tmp/out" || fail "verify report: $(cat "$tmp/out")"

# 2. Default cap: one model.safetensors, no index. From a full checkpoint.
expect_exit 0 checkpoint consolidate --in="$tmp/h6" --out="$tmp/full"
expect_exit 0 checkpoint export --in="$tmp/full" --out="$tmp/single"
np check --dir="$tmp/single" --max-shard-size=5000000000 --files=1
np compare --expected="$tmp/hf" --actual="$tmp/single" --skip=head.weight

# 3. Casts: float32 -> bfloat16 and float16 on export, against numpy's own
#    rounding; bfloat16 files into a float32 model need --cast (exact), and
#    back to bfloat16 is bitwise.
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/bf16" \
  --dtype=bfloat16 --max-shard-size=100
np check --dir="$tmp/bf16" --max-shard-size=100 --dtype=bfloat16
np compare --expected="$tmp/hf" --actual="$tmp/bf16" --skip=head.weight \
  --cast=bfloat16
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/f16" --dtype=fp16
np compare --expected="$tmp/hf" --actual="$tmp/f16" --skip=head.weight \
  --cast=float16
np make --spec="$tiny" --out="$tmp/hfb" --dtype=BF16 --seed=2
expect_exit 1 checkpoint shard --in="$tmp/hfb" --model="$tiny" \
  --world-size=2 --out="$tmp/b2"
grep -q "model.safetensors: tensor 'emb.weight' is BF16, the model's parameter 'emb.weight' is float32 (give the model the file's dtype, --dtype=bfloat16, or convert with --cast)" \
  "$tmp/err" || fail "dtype error: $(cat "$tmp/err")"
[ -e "$tmp/b2" ] && fail "a failed import left its output"
expect_exit 0 checkpoint shard --in="$tmp/hfb" --model="$tiny" \
  --world-size=2 --out="$tmp/b2" --cast
grep -q "7 cast" "$tmp/out" || fail "cast report: $(cat "$tmp/out")"
expect_exit 0 checkpoint export --in="$tmp/b2" --out="$tmp/b2f32"
np compare --expected="$tmp/hfb" --actual="$tmp/b2f32" --cast=float32
expect_exit 0 checkpoint export --in="$tmp/b2" --out="$tmp/b2bf16" \
  --dtype=bfloat16
np compare --expected="$tmp/hfb" --actual="$tmp/b2bf16"
# Or keep the file's dtype: --dtype gives the model bfloat16.
expect_exit 0 checkpoint shard --in="$tmp/hfb/model.safetensors" \
  --model="$tiny" --dtype=bfloat16 --world-size=3 --out="$tmp/b3"
expect_exit 0 checkpoint export --in="$tmp/b3" --out="$tmp/b3out"
np compare --expected="$tmp/hfb" --actual="$tmp/b3out"

# 4. Optimizer state: another tool's refused, or left behind; this
#    project's imported.
np make --spec="$tiny" --out="$tmp/hfo" --optimizer
expect_exit 1 checkpoint shard --in="$tmp/hfo" --model="$tiny" \
  --world-size=2 --out="$tmp/o2"
grep -q 'hfo/optimizer.pt: optimizer state written by another tool cannot be imported' \
  "$tmp/err" || fail "optimizer error: $(cat "$tmp/err")"
expect_exit 0 checkpoint shard --in="$tmp/hfo" --model="$tiny" \
  --world-size=2 --out="$tmp/o2" --weights-only
grep -q 'optimizer state left behind (--weights-only): optimizer.pt' \
  "$tmp/out" || fail "weights-only report: $(cat "$tmp/out")"
# A full checkpoint's files without its manifest: the optimizer state comes
# along, into the same files as sharding the checkpoint; so with PyTorch's
# param_groups (json.dumps(optimizer.state_dict()["param_groups"])) as
# optim.json. optim.safetensors alone is refused, or left behind.
expect_exit 0 checkpoint init --model="$tiny" --out="$tmp/ofull" --seed=3
expect_exit 0 checkpoint shard --in="$tmp/ofull" --model="$tiny" \
  --world-size=3 --out="$tmp/oref"
mkdir "$tmp/hfopt"
cp "$tmp/ofull/model.safetensors" "$tmp/ofull/optim.safetensors" \
  "$tmp/ofull/optim.json" "$tmp/hfopt/"
expect_exit 0 checkpoint shard --in="$tmp/hfopt" --model="$tiny" \
  --world-size=3 --out="$tmp/oimp"
grep -q 'optimizer state of 7 parameters in 1 param group imported' \
  "$tmp/out" || fail "optimizer import report: $(cat "$tmp/out")"
diff -r "$tmp/oref" "$tmp/oimp" >/dev/null || fail "import differs from shard"
"$python" - "$tmp/ofull/optim.json" "$tiny" "$tmp/hfopt/optim.json" <<'EOF_PY' ||
import json, sys
typed, spec = (json.load(open(f)) for f in sys.argv[1:3])
ids = {p["fqn"]: i for i, p in
       enumerate(p for p in spec["params"] if "tied_to" not in p)}
groups = [dict({k: list(v.values())[0] for k, v in g["hyperparams"].items()},
               params=[ids[f] for f in g["params"]])
          for g in typed["param_groups"]]
with open(sys.argv[3], "w") as f:
    json.dump(groups, f)
EOF_PY
  fail "PyTorch param_groups"
expect_exit 0 checkpoint shard --in="$tmp/hfopt" --model="$tiny" \
  --world-size=3 --out="$tmp/oimp2"
diff -r "$tmp/oref" "$tmp/oimp2" >/dev/null ||
  fail "import with PyTorch's param_groups differs from shard"
rm "$tmp/hfopt/optim.json"
expect_exit 1 checkpoint shard --in="$tmp/hfopt" --model="$tiny" \
  --world-size=3 --out="$tmp/oimp3"
grep -q 'hfopt/optim.safetensors: optimizer state without its optim.json' \
  "$tmp/err" || fail "optim.json missing: $(cat "$tmp/err")"
expect_exit 0 checkpoint shard --in="$tmp/hfopt" --model="$tiny" \
  --world-size=3 --out="$tmp/oimp3" --weights-only
grep -q 'optimizer state left behind (--weights-only): optim.safetensors' \
  "$tmp/out" || fail "weights-only report: $(cat "$tmp/out")"

# 5. Files that do not fit the model: exit 1, naming file and tensor.
expect_exit 1 checkpoint shard --in="$tmp/hf" --model=gpt2 --world-size=2 \
  --out="$tmp/x"
grep -q "hf/model.safetensors.index.json does not fit model 'gpt2'" "$tmp/err" ||
  fail "model mismatch: $(head -c 600 "$tmp/err")"
grep -q "model-00001-of-00003.safetensors: unexpected tensor '_orig_mod._fsdp_wrapped_module.emb._checkpoint_wrapped_module.weight' ('emb.weight') (F32 \[11, 3\])" \
  "$tmp/err" || fail "unexpected tensor: $(head -c 600 "$tmp/err")"
grep -q "missing tensor 'transformer.wte.weight'" "$tmp/err" ||
  fail "missing tensor: $(head -c 600 "$tmp/err")"
cp -r "$tmp/hf" "$tmp/hf_bad"
sed -i 's/"total_size": [0-9]*/"total_size": 1/' \
  "$tmp/hf_bad/model.safetensors.index.json"
expect_exit 1 checkpoint shard --in="$tmp/hf_bad" --model="$tiny" \
  --world-size=2 --out="$tmp/x"
grep -q 'metadata.total_size is 1, but the tensors of the weight_map hold 624 bytes' \
  "$tmp/err" || fail "total_size: $(cat "$tmp/err")"
expect_exit 1 checkpoint shard --in="$tmp/missing" --model="$tiny" \
  --world-size=2 --out="$tmp/x"
[ -e "$tmp/x" ] && fail "a failed import left its output"

# 6. Bad flags exit 2.
expect_exit 2 checkpoint export --in="$tmp/h6" --out="$tmp/x" \
  --max-shard-size=5Gb
grep -q "lowercase 'b' would mean bits" "$tmp/err" ||
  fail "--max-shard-size: $(cat "$tmp/err")"
expect_exit 2 checkpoint export --in="$tmp/h6" --out="$tmp/x" --dtype=int32
expect_exit 2 checkpoint export --in="$tmp/h6" --out="$tmp/x" --cast
expect_exit 2 checkpoint export --in="$tmp/h6" --out="$tmp/x" --model=gpt2
expect_exit 2 checkpoint reshard --in="$tmp/h6" --out="$tmp/x" \
  --max-shard-size=1GB
expect_exit 2 checkpoint export --in="$tmp/h6"
expect_exit 1 checkpoint shard --in="$tmp/full" --model="$tiny" \
  --world-size=2 --out="$tmp/x" --cast
grep -q 'applies to Hugging Face checkpoints only' "$tmp/err" ||
  fail "--cast on a flatparam checkpoint: $(cat "$tmp/err")"
expect_exit 0 checkpoint --help
grep -q 'fsdp checkpoint export' "$tmp/out" || fail "help lacks export"

# One shard file of an indexed checkpoint: the error points at the
# directory.
shard_file=$(ls "$tmp/hf"/model-*.safetensors | head -n 1)
expect_exit 1 checkpoint shard --in="$shard_file" --model="$tiny" \
  --world-size=2 --out="$tmp/x"
grep -q 'is one shard of the checkpoint that .*model.safetensors.index.json indexes: point --in at the directory' \
  "$tmp/err" || fail "a shard file as --in: $(head -c 2000 "$tmp/err")"

# Hugging Face names against a preset with the model's own names: the
# error points at the preset with Hugging Face's names.
cat >"$tmp/hfnames.json" <<'EOF'
{"params": [{"fqn": "model.embed_tokens.weight", "shape": [2, 2]}]}
EOF
np make --spec="$tmp/hfnames.json" --out="$tmp/hfnames" --shards=1 --seed=1
expect_exit 1 checkpoint shard --in="$tmp/hfnames" --model=llama2-7b \
  --world-size=2 --out="$tmp/x"
grep -q 'did you mean --model=llama2-7b-hf?' "$tmp/err" ||
  fail "no preset suggestion: $(head -c 2000 "$tmp/err")"

# No command deletes what it did not write. An export into a directory
# holding a model's config and tokenizer is refused and leaves them; so is
# an export back into the original download (its shards and config.json);
# an export replaces its own earlier export.
mkdir -p "$tmp/user"
echo '{"model_type": "tiny"}' >"$tmp/user/config.json"
echo '{}' >"$tmp/user/tokenizer.json"
expect_exit 1 checkpoint export --in="$tmp/h6" --out="$tmp/user"
grep -q 'holds 2 files that no Hugging Face export written here has: config.json, tokenizer.json' \
  "$tmp/err" || fail "export into a user's directory: $(cat "$tmp/err")"
[ "$(ls "$tmp/user")" = "$(printf 'config.json\ntokenizer.json')" ] ||
  fail "export into a user's directory changed it: $(ls "$tmp/user")"
echo '{}' >"$tmp/hf/config.json"
before=$(cd "$tmp/hf" && md5sum ./*)
expect_exit 1 checkpoint export --in="$tmp/h6" --out="$tmp/hf"
grep -q 'holds a file that no Hugging Face export written here has: config.json' \
  "$tmp/err" || fail "export into the download: $(cat "$tmp/err")"
[ "$(cd "$tmp/hf" && md5sum ./*)" = "$before" ] ||
  fail "export into the download changed it"
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/out150"
np check --dir="$tmp/out150" --max-shard-size=1000000000 --files=1 --tensors=7
# The same rule for the other commands that write a directory.
expect_exit 1 checkpoint reshard --in="$tmp/s4" --world-size=2 --out="$tmp/user"
grep -q 'refusing to write a sharded checkpoint there' "$tmp/err" ||
  fail "reshard into a user's directory: $(cat "$tmp/err")"
expect_exit 1 checkpoint consolidate --in="$tmp/s4" --out="$tmp/user"
grep -q 'refusing to write a full checkpoint there' "$tmp/err" ||
  fail "consolidate into a user's directory: $(cat "$tmp/err")"
expect_exit 1 checkpoint shard --in="$tmp/hf" --model="$tiny" \
  --world-size=2 --out="$tmp/user"
grep -q 'refusing to write a sharded checkpoint there' "$tmp/err" ||
  fail "shard into a user's directory: $(cat "$tmp/err")"
expect_exit 1 train --steps=1 --save="$tmp/user"
grep -q 'refusing to write a sharded checkpoint there' "$tmp/err" ||
  fail "train --save into a user's directory: $(cat "$tmp/err")"
[ "$(ls "$tmp/user")" = "$(printf 'config.json\ntokenizer.json')" ] ||
  fail "a command changed the user's directory: $(ls "$tmp/user")"

expect_exit 2 checkpoint reshard --in="$tmp/s4" --world-size=2 \
  --out="$tmp/user" --overwrite
grep -q 'checkpoint reshard does not take --overwrite: .*readers reject any file' \
  "$tmp/err" || fail "reshard --overwrite: $(cat "$tmp/err")"

# Told to (--overwrite), an export writes into the download: the previous
# weights (3 shards and the index) are replaced, the rest kept; the refusal
# said how. --copy-from brings the original's config and tokenizer; the
# summary says what was replaced and kept, with absolute paths.
expect_exit 1 checkpoint export --in="$tmp/h6" --out="$tmp/hf"
grep -q 'give overwrite (--overwrite) to write into this one' "$tmp/err" ||
  fail "the refusal does not name --overwrite: $(cat "$tmp/err")"
echo 'model card' >"$tmp/hf/README.md"
mkdir -p "$tmp/orig"
echo '{"model_type": "llama"}' >"$tmp/orig/config.json"
echo '{"version": "1.0"}' >"$tmp/orig/tokenizer.json"
hf_before=$(ls "$tmp/hf" | tr '\n' ' ')
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/hf" --overwrite \
  --copy-from="$tmp/orig" --max-shard-size=200
[ "$(ls "$tmp/hf" | tr '\n' ' ')" = "README.md config.json model-00001-of-00003.safetensors model-00002-of-00003.safetensors model-00003-of-00003.safetensors model.safetensors.index.json tokenizer.json " ] ||
  fail "export --overwrite of [$hf_before] left: $(ls "$tmp/hf" | tr '\n' ' ')"
[ "$(cat "$tmp/hf/README.md")" = "model card" ] || fail "README.md changed"
cmp -s "$tmp/orig/config.json" "$tmp/hf/config.json" || fail "config.json not copied"
grep -qF "$tmp/hf: replaced 5 files: config.json, model-00001-of-00003.safetensors, model-00002-of-00003.safetensors, model-00003-of-00003.safetensors, model.safetensors.index.json; kept 1 file: README.md" \
  "$tmp/out" || fail "export --overwrite summary: $(cat "$tmp/out")"
grep -qF "copied from $tmp/orig: config.json, tokenizer.json" "$tmp/out" ||
  fail "export --copy-from summary: $(cat "$tmp/out")"
np compare --expected="$tmp/out150" --actual="$tmp/hf"
# Exporting again with the same files needs no --overwrite; the summary
# says the previous export was replaced.
rm "$tmp/hf/README.md"
expect_exit 0 checkpoint export --in="$tmp/h6" --out="$tmp/hf" \
  --copy-from="$tmp/orig"
grep -qF "$tmp/hf: replaced the Hugging Face export that was there (6 files: " \
  "$tmp/out" || fail "re-export summary: $(cat "$tmp/out")"
expect_exit 2 checkpoint shard --in="$tmp/hf" --model="$tiny" \
  --world-size=2 --out="$tmp/x" --copy-from="$tmp/orig"
grep -q 'checkpoint shard does not take --copy-from (export only)' "$tmp/err" ||
  fail "shard --copy-from: $(cat "$tmp/err")"

# Files saved from another class than the model's (gpt2's published ones:
# no "transformer." prefix, attn.bias buffers) import with --add-prefix
# and --ignore-suffix, and equal the same weights under the model's names.
cat >"$tmp/bare.json" <<'EOF'
{"params": [{"fqn": "wte.weight", "shape": [4, 2]},
            {"fqn": "h.0.attn.c_attn.weight", "shape": [2, 6]},
            {"fqn": "h.0.attn.bias", "shape": [1, 1, 2, 2]}]}
EOF
cat >"$tmp/gpt2ish.json" <<'EOF'
{"params": [{"fqn": "transformer.wte.weight", "shape": [4, 2]},
            {"fqn": "transformer.h.0.attn.c_attn.weight", "shape": [2, 6]},
            {"fqn": "lm_head.weight", "tied_to": "transformer.wte.weight"}],
 "wrap": ["transformer.h.0"]}
EOF
np make --spec="$tmp/bare.json" --out="$tmp/bare" --seed=3
expect_exit 1 checkpoint shard --in="$tmp/bare" --model="$tmp/gpt2ish.json" \
  --world-size=2 --out="$tmp/g2"
grep -q "unexpected tensor 'wte.weight'" "$tmp/err" ||
  fail "bare names: $(head -c 2000 "$tmp/err")"
expect_exit 0 checkpoint shard --in="$tmp/bare" --model="$tmp/gpt2ish.json" \
  --world-size=2 --out="$tmp/g2" --add-prefix=transformer. \
  --ignore-suffix=.attn.bias,.attn.masked_bias
grep -q "imported 2 tensors of 1 Hugging Face file into model .* (0 tied copies checked, 1 buffer skipped, 0 cast)" \
  "$tmp/out" || fail "--add-prefix import report: $(cat "$tmp/out")"
# The same weights under the model's own names import to the same bytes.
expect_exit 0 checkpoint export --in="$tmp/g2" --out="$tmp/g2_hf"
expect_exit 0 checkpoint shard --in="$tmp/g2_hf" --model="$tmp/gpt2ish.json" \
  --world-size=2 --out="$tmp/g2b"
for f in "$tmp/g2"/rank*.safetensors; do
  cmp -s "$f" "$tmp/g2b/$(basename "$f")" || fail "--add-prefix import differs: $f"
done
expect_exit 2 checkpoint reshard --in="$tmp/g2" --world-size=1 \
  --out="$tmp/x" --add-prefix=transformer.
grep -q 'checkpoint reshard does not take --add-prefix' "$tmp/err" ||
  fail "reshard --add-prefix: $(cat "$tmp/err")"

cli_test_finish
