#!/usr/bin/env bash
# `fsdp model --from=DIR` through the binary: a Hugging Face export of the
# tiny model (fsdp checkpoint init, then export) is described with wrap
# globs, imported with the model file (fsdp checkpoint shard) and inspected;
# the default wrap, stdout, an existing --out, and bad flags.
# Usage: model_cli_test.sh CLI_TEST_LIB FSDP TINY_MODEL_JSON
set -uo pipefail

# shellcheck source=tools/testing/cli_test_lib.sh
source "$1"
cli_test_init "$2"
tiny=$3
CLI_TEST_TIMEOUT_S=60

expect_exit 0 checkpoint init --model="$tiny" --out="$tmp/A"
expect_exit 0 checkpoint export --in="$tmp/A" --out="$tmp/B"

# 1. Globs: each seq.N is a unit; the file imports the export and lays out
#    as the units the glob stands for.
expect_exit 0 model --from="$tmp/B" --wrap='seq.*' --out="$tmp/m.json"
[ -s "$tmp/out" ] && fail "model --out wrote to stdout: $(cat "$tmp/out")"
grep -qxF "fsdp model: wrote $tmp/m.json: model \"B\", 7 parameters (119 elements) in 4 units, from 1 Hugging Face file of $tmp/B (0 buffers skipped)" \
  "$tmp/err" || fail "summary: $(cat "$tmp/err")"
grep -q 'A reconstruction' "$tmp/err" || fail "order note: $(cat "$tmp/err")"
grep -q '"wrap": \["seq.\*"\]' "$tmp/m.json" ||
  fail "the glob is not kept: $(cat "$tmp/m.json")"
grep -q '{"fqn": "seq.0.bias", "shape": \[5\], "dtype": "float32", "requires_grad": true},' \
  "$tmp/m.json" || fail "parameter line: $(cat "$tmp/m.json")"
expect_exit 0 checkpoint shard --in="$tmp/B" --model="$tmp/m.json" \
  --world-size=2 --out="$tmp/C"
grep -q "imported 7 tensors of 1 Hugging Face file into model B" "$tmp/out" ||
  fail "import: $(cat "$tmp/out")"
expect_exit 0 checkpoint verify --in="$tmp/C"
expect_exit 0 inspect --model="$tmp/m.json" --world-size=2 --format=json
units=$(python3 -c 'import json,sys; print(",".join(f["unit"] for f in json.load(sys.stdin)["flat_params"]))' \
  <"$tmp/out")
[ "$units" = ",seq.0,seq.2,seq.4" ] || fail "units: '$units'"
# Nested globs and explicit prefixes together.
expect_exit 0 model --from="$tmp/B" --wrap='seq.*, emb' --out="$tmp/m2.json"
grep -q 'in 4 units' "$tmp/err" || fail "seq.*, emb: $(cat "$tmp/err")"

# 2. The default: the one numbered list, said on stderr; stdout holds the
#    file.
expect_exit 0 model --from="$tmp/B"
grep -q '^fsdp model: wrap: default --wrap=seq.\* (the one numbered module list, 3 modules)' \
  "$tmp/err" || fail "default wrap: $(cat "$tmp/err")"
grep -q 'wrote stdout' "$tmp/err" || fail "stdout summary: $(cat "$tmp/err")"
cmp -s "$tmp/out" "$tmp/m.json" || fail "stdout differs from --out's file"

# 3. An existing --out: refused (unchanged), replaced with --overwrite.
expect_exit 1 model --from="$tmp/B" --wrap= --out="$tmp/m.json"
grep -q "m.json exists; pass --overwrite" "$tmp/err" ||
  fail "existing --out: $(cat "$tmp/err")"
grep -q '"wrap": \["seq.\*"\]' "$tmp/m.json" || fail "refused --out changed"
expect_exit 0 model --from="$tmp/B" --wrap= --out="$tmp/m.json" --overwrite
grep -q '"wrap": \[\]' "$tmp/m.json" || fail "--overwrite: $(cat "$tmp/m.json")"
expect_exit 1 model --from="$tmp/B" --out="$tmp/B"
grep -q "is a directory" "$tmp/err" || fail "directory --out: $(cat "$tmp/err")"

# 4. Failures exit 1 naming the value; bad flags exit 2.
expect_exit 1 model --from="$tmp/B" --wrap='layers.*' --out="$tmp/x.json"
grep -q 'wrap glob "layers.\*" matches no module' "$tmp/err" ||
  fail "glob matching nothing: $(cat "$tmp/err")"
[ -e "$tmp/x.json" ] && fail "a failed model left its output"
expect_exit 1 model --from="$tmp/missing"
grep -q "no Hugging Face checkpoint at $tmp/missing" "$tmp/err" ||
  fail "missing --from: $(cat "$tmp/err")"
expect_exit 2 model --wrap='seq.*'
expect_exit 2 model --from="$tmp/B" --wrap='seq.*,,emb'
grep -q 'entry "" is not a module prefix or glob' "$tmp/err" ||
  fail "bad --wrap: $(cat "$tmp/err")"
expect_exit 2 model --from="$tmp/B" --world-size=2
grep -q 'does not take --world-size' "$tmp/err" ||
  fail "foreign flag: $(cat "$tmp/err")"
expect_exit 2 model --from="$tmp/B" --overwrite
expect_exit 2 model --from="$tmp/B" stray

cli_test_finish
