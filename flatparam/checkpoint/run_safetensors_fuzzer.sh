#!/bin/bash
# Builds safetensors_fuzz.cc as a libFuzzer binary with clang (GCC has no
# libFuzzer) and fuzzes SafetensorsReader, starting from the checked-in
# seeds. Run from anywhere; needs clang with its compiler-rt (Debian:
# clang, which ships libclang_rt.fuzzer) and the system Abseil.
#
#   flatparam/checkpoint/run_safetensors_fuzzer.sh [SECONDS] [LIBFUZZER FLAGS...]
#
# The growing corpus is kept in ${FUZZ_CORPUS:-/tmp/safetensors_corpus};
# crashers are written to the current directory (crash-*): add them to
# testdata/safetensors as regression seeds.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
seconds=${1:-60}
shift || true
out=${FUZZ_OUT:-/tmp/safetensors_fuzz}
corpus=${FUZZ_CORPUS:-/tmp/safetensors_corpus}
cxx=${CXX_FUZZ:-clang++}

absl_libs=$(pkg-config --libs absl_status absl_statusor absl_str_format \
  absl_strings absl_synchronization absl_hash absl_raw_hash_set)

"$cxx" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
  -DJSON_DIAGNOSTICS=1 -I"$root" \
  "$root/flatparam/checkpoint/safetensors_fuzz.cc" \
  "$root/flatparam/checkpoint/safetensors.cc" \
  "$root/flatparam/checkpoint/file_system.cc" \
  "$root/flatparam/flatten.cc" "$root/flatparam/layout.cc" \
  "$root/flatparam/base/dtype.cc" "$root/flatparam/base/copy.cc" \
  "$root/flatparam/base/json_limits.cc" "$root/flatparam/base/shape.cc" \
  "$root/flatparam/base/buffer.cc" \
  $absl_libs -o "$out"

mkdir -p "$corpus"
exec "$out" -max_len=4096 -max_total_time="$seconds" "$@" \
  "$corpus" "$root/flatparam/checkpoint/testdata/safetensors"
