#!/bin/bash
# Builds torch_save_fuzz.cc as a coverage-guided libFuzzer binary with clang
# (GCC has no libFuzzer), ASan and UBSan, against Debian's LibTorch, libzip
# and Abseil, and fuzzes the torch.save reader from the checked-in seeds.
# Run from anywhere; needs clang with its compiler-rt (Debian: clang) and
# what tools/setup.sh installs.
#
#   flatparam/interop/torch_save/run_torch_save_fuzzer.sh [SECONDS] [LIBFUZZER FLAGS...]
#
# The growing corpus is kept in ${FUZZ_CORPUS:-/tmp/torch_save_corpus};
# crashers are written to the current directory (crash-*): add them to
# testdata/pickles as regression seeds. Only flatparam's code is
# instrumented; LibTorch's zip writer (used to wrap pickles) is not.
set -euo pipefail

root=$(cd "$(dirname "$0")/../../.." && pwd)
seconds=${1:-60}
shift || true
out=${FUZZ_OUT:-/tmp/torch_save_fuzz}
corpus=${FUZZ_CORPUS:-/tmp/torch_save_corpus}
cxx=${CXX_FUZZ:-clang++}
api=/usr/include/torch/csrc/api/include

absl_libs=$(pkg-config --libs absl_status absl_statusor absl_str_format \
  absl_strings absl_synchronization absl_hash absl_raw_hash_set absl_time)

"$cxx" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
  -DJSON_DIAGNOSTICS=1 -I"$root" -I"$api" -Wno-deprecated-declarations \
  "$root/flatparam/interop/torch_save/torch_save_fuzz.cc" \
  "$root/flatparam/interop/torch_save/torch_save_format.cc" \
  "$root/flatparam/interop/internal/pickle.cc" \
  "$root/flatparam/interop/internal/zip_reader.cc" \
  "$root/flatparam/checkpoint/file_system.cc" \
  "$root/flatparam/optim/optim_state.cc" \
  "$root/flatparam/flatten.cc" "$root/flatparam/layout.cc" \
  "$root/flatparam/base/dtype.cc" "$root/flatparam/base/copy.cc" \
  "$root/flatparam/base/json_limits.cc" "$root/flatparam/base/shape.cc" \
  "$root/flatparam/base/buffer.cc" \
  $absl_libs -ltorch -ltorch_cpu -lc10 -lzip -pthread -o "$out"

mkdir -p "$corpus"
exec "$out" -max_len=65536 -rss_limit_mb=4096 -max_total_time="$seconds" \
  "$@" "$corpus" "$root/flatparam/interop/torch_save/testdata/pickles"
