#!/bin/bash
# Builds dcp_metadata_fuzz.cc as a coverage-guided libFuzzer binary with
# clang (GCC has no libFuzzer), ASan and UBSan, against Debian's libzip and
# Abseil, and fuzzes the DCP reader (.metadata and the items it points at)
# from the checked-in seeds. Run from anywhere; needs clang with its
# compiler-rt (Debian: clang) and what tools/setup.sh installs.
#
#   flatparam/interop/dcp/run_dcp_fuzzer.sh [SECONDS] [LIBFUZZER FLAGS...]
#
# The growing corpus is kept in ${FUZZ_CORPUS:-/tmp/dcp_corpus}; crashers
# are written to the current directory (crash-*): add them to
# testdata/dcp_seeds as regression seeds.
set -euo pipefail

root=$(cd "$(dirname "$0")/../../.." && pwd)
seconds=${1:-60}
shift || true
out=${FUZZ_OUT:-/tmp/dcp_fuzz}
corpus=${FUZZ_CORPUS:-/tmp/dcp_corpus}
cxx=${CXX_FUZZ:-clang++}

absl_libs=$(pkg-config --libs absl_status absl_statusor absl_str_format \
  absl_strings absl_synchronization absl_hash absl_raw_hash_set absl_time)

"$cxx" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
  -DJSON_DIAGNOSTICS=1 -I"$root" \
  "$root/flatparam/interop/dcp/dcp_metadata_fuzz.cc" \
  "$root/flatparam/interop/dcp/dcp.cc" \
  "$root/flatparam/interop/internal/pickle.cc" \
  "$root/flatparam/interop/internal/zip_reader.cc" \
  "$root/flatparam/checkpoint/file_system.cc" \
  "$root/flatparam/flatten.cc" "$root/flatparam/layout.cc" \
  "$root/flatparam/base/dtype.cc" "$root/flatparam/base/copy.cc" \
  "$root/flatparam/base/shape.cc" "$root/flatparam/base/buffer.cc" \
  $absl_libs -lzip -pthread -o "$out"

mkdir -p "$corpus"
export FUZZ_DCP_ITEMS="$root/flatparam/interop/dcp/testdata/dcp/v2"
exec "$out" -max_len=262144 -rss_limit_mb=4096 -max_total_time="$seconds" \
  "$@" "$corpus" "$root/flatparam/interop/dcp/testdata/dcp_seeds"
