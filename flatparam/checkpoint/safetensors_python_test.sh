#!/bin/bash
# Writes a sample safetensors file with the C++ writer and reads it back with
# Python's json and struct modules only (testdata/check_safetensors.py).
# Skips, passing, where python3 is not installed.
set -euo pipefail

writer=$1
checker=$2
if ! command -v python3 >/dev/null 2>&1; then
  echo "SKIPPED: python3 is not installed"
  exit 0
fi
tmp=${TEST_TMPDIR:-$(mktemp -d)}
"$writer" "$tmp/sample.safetensors"
python3 "$checker" "$tmp/sample.safetensors"
