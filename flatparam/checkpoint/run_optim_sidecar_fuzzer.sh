#!/bin/bash
# Builds optim_sidecar_fuzz.cc as a libFuzzer binary with clang (GCC has no
# libFuzzer) and fuzzes the optimizer sidecar parser and the rank/full
# state readers, starting from the checked-in seeds. Run from anywhere;
# needs clang with its compiler-rt (Debian: clang, which ships
# libclang_rt.fuzzer), the system Abseil and libxxhash.
#
#   flatparam/checkpoint/run_optim_sidecar_fuzzer.sh [SECONDS] [LIBFUZZER FLAGS...]
#
# The growing corpus is kept in ${FUZZ_CORPUS:-/tmp/optim_sidecar_corpus};
# crashers are written to the current directory (crash-*): add them to
# testdata/optim_sidecar as regression seeds (named valid_* or invalid_*).
#
# The source list is the transitive srcs of //flatparam/checkpoint:training_state
# (bazel query 'kind("source file", deps(//flatparam/checkpoint:training_state))').
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
seconds=${1:-60}
shift || true
out=${FUZZ_OUT:-/tmp/optim_sidecar_fuzz}
corpus=${FUZZ_CORPUS:-/tmp/optim_sidecar_corpus}
cxx=${CXX_FUZZ:-clang++}

absl_libs=$(pkg-config --libs absl_status absl_statusor absl_str_format \
  absl_strings absl_synchronization absl_hash absl_raw_hash_set absl_time \
  absl_random_random)

srcs=(
  flatparam/checkpoint/optim_sidecar_fuzz.cc
  flatparam/checkpoint/training_state.cc
  flatparam/checkpoint/checkpoint_dir.cc
  flatparam/checkpoint/checkpoint_dir_read.cc
  flatparam/checkpoint/checkpoint_names.cc
  flatparam/checkpoint/internal/checkpoint_format.cc
  flatparam/checkpoint/internal/checkpoint_write.cc
  flatparam/checkpoint/internal/verified_file.cc
  flatparam/checkpoint/manifest.cc
  flatparam/checkpoint/safetensors.cc
  flatparam/checkpoint/file_system.cc
  flatparam/optim/optim_state.cc
  flatparam/layout_json.cc
  flatparam/model_json.cc
  flatparam/presets.cc
  flatparam/model_layout.cc
  flatparam/flatten.cc
  flatparam/layout.cc
  flatparam/base/dtype.cc
  flatparam/base/json_limits.cc
  flatparam/base/copy.cc
  flatparam/base/shape.cc
  flatparam/base/buffer.cc
)

"$cxx" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -I"$root" "${srcs[@]/#/$root/}" \
  $absl_libs -lxxhash -o "$out"

mkdir -p "$corpus"
exec "$out" -max_len=8192 -max_total_time="$seconds" "$@" \
  "$corpus" "$root/flatparam/checkpoint/testdata/optim_sidecar"
