#!/usr/bin/env bash
# Builds flatparam's GPU tests and benchmarks with `bazel build -c opt` (the
# flags of CI's optimized build, so its outputs are reused) and packs them
# into DIR for a GPU machine that has the driver, CUDA and NCCL but none of
# flatparam's build dependencies:
#
#   tools/gpu/bundle.sh DIR
#
#   DIR/run.sh      runs everything there (tools/gpu/run.sh; see its header)
#   DIR/bin/        the binaries
#   DIR/lib/        the shared libraries they need that such a machine lacks
#                   (Abseil, Google Benchmark, xxHash, Bazel's own solibs...),
#                   found with ldd; run.sh puts lib/ on LD_LIBRARY_PATH. The
#                   CUDA runtime the binaries were built against
#                   (libcudart.so.N) is bundled too: the machine may have
#                   another one, or none outside its Python wheels. Not
#                   bundled: the C/C++ runtime (libc, libm, libstdc++,
#                   libgcc_s, ld-linux, libpthread, libdl, librt), the
#                   driver's libcuda and NCCL (libnccl), which the GPU
#                   machine's come from (run.sh checks that its driver
#                   supports the bundled runtime).
#   DIR/lib/fallback/  OpenSSL 3's libcrypto.so.3 and libssl.so.3 where a
#                   binary needs them: run.sh uses them only on a machine
#                   that lacks its own (a bundled copy on LD_LIBRARY_PATH
#                   would shadow the machine's, which its LibTorch may need
#                   a newer version of)
#   DIR/torch_kit/  flatparam/torch and the GPT as sources with a CMake
#                   build (build.sh) against the GPU machine's own PyTorch,
#                   linked with lib/ (see "torch_kit/" below)
#   DIR/MANIFEST    the commit, the build command and the file list
#
# DIR must not exist or be empty; the script fails if the result exceeds
# 64 MiB (what one call to the GPU machine carries), or if a binary needs a
# library that is neither bundled nor allowed to come from the machine.
#
# Environment:
#   FLATPARAM_BAZEL_STARTUP_OPTS  Bazel startup options (default none), e.g.
#                                 --output_base=... for a second checkout
#   FLATPARAM_BAZEL_BUILD_OPTS    extra build options that do not change the
#                                 outputs (e.g. --jobs=1)
set -euo pipefail

die() {
  echo "bundle.sh: $*" >&2
  exit 1
}

[ $# -eq 1 ] || die "usage: tools/gpu/bundle.sh DIR"
dir=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
max_bytes=$((64 * 1024 * 1024))

# Binary name in bin/ -> Bazel label. Tests that need OpenMPI cannot run on
# the GPU machine: none of these links it (bundle_test.sh checks).
targets=(
  cuda_smoke_test=//third_party:cuda_smoke_test
  cuda_device_test=//flatparam/device/cuda:cuda_device_test
  nccl_communicator_test=//comm/nccl:nccl_communicator_test
  nccl_gpu_test=//comm/nccl:nccl_gpu_test
  training_nccl_test=//verify:training_nccl_test
  gpu_bench=//benchmarks:gpu_bench
  gpu_versions=//tools/gpu:gpu_versions
  torch_kit_deps=//tools/gpu:torch_kit_deps
)

# Libraries the GPU machine provides: the C/C++ runtime, the driver's libcuda
# and NCCL.
provided_re='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|ld-linux|libpthread|libdl|librt|libnccl|libcuda)\.so'
# Libraries a Linux machine normally has itself, whose symbol versions only
# grow (OpenSSL 3): bundled in lib/fallback/, which run.sh uses only for
# those the machine lacks, so that the machine's own (which its LibTorch
# may need a newer version of) is never shadowed.
fallback_re='^lib(crypto|ssl)\.so\.3$'

if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
  die "$dir exists and is not empty: give a new or empty folder"
fi
command -v ldd >/dev/null || die "ldd is needed to find the libraries"

# shellcheck disable=SC2206  # word splitting of option lists is intended
startup=(${FLATPARAM_BAZEL_STARTUP_OPTS:-})
# shellcheck disable=SC2206
extra=(${FLATPARAM_BAZEL_BUILD_OPTS:-})
bazel_cmd() { bazel ${startup[@]+"${startup[@]}"} "$@"; }

cd "$root"
# The NCCL-only targets exist only where cuda_configure found CUDA and NCCL.
if ! bazel_cmd query //comm/nccl:nccl_gpu_test >/dev/null 2>&1; then
  die "this build found no CUDA with NCCL (//comm/nccl:nccl_gpu_test is not defined; see README.md on CUDA_PATH and NCCL_HOME): the GPU kit cannot be built here"
fi

labels=()
for t in "${targets[@]}"; do labels+=("${t#*=}"); done
echo "bundle.sh: bazel build -c opt ${labels[*]}"
bazel_cmd build ${extra[@]+"${extra[@]}"} -c opt "${labels[@]}"
bin_root=$(bazel_cmd info -c opt bazel-bin)

mkdir -p "$dir/bin" "$dir/lib"
dir=$(cd "$dir" && pwd)
declare -A bundled=()
for t in "${targets[@]}"; do
  name=${t%%=*}
  label=${t#*=}
  pkg=${label#//}
  pkg=${pkg%%:*}
  src="$bin_root/$pkg/${label##*:}"
  [ -x "$src" ] || die "$label built, but $src is not an executable"
  cp "$src" "$dir/bin/$name"
  chmod u+w,a+rx "$dir/bin/$name"
  # ldd on the built binary, where Bazel's RUNPATHs ($ORIGIN/../_solib_k8)
  # resolve: each `soname => path` that the GPU machine lacks is copied.
  ldd_out=$(ldd "$src") || die "ldd $src failed"
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ $soname =~ $provided_re ]] && continue
    if [ "$path" = "not" ]; then
      die "$label needs $soname, which is not found on this machine either"
    fi
    if [[ $soname == libmpi* || $soname == libopen-* ]]; then
      die "$label links OpenMPI ($soname), which the GPU machine does not have"
    fi
    if [ -z "${bundled[$soname]:-}" ]; then
      dest=$dir/lib
      [[ $soname =~ $fallback_re ]] && dest=$dir/lib/fallback
      mkdir -p "$dest"
      cp -L "$path" "$dest/$soname"
      chmod u+w,a+r "$dest/$soname"
      bundled[$soname]=$path
    fi
  done <<<"$ldd_out"
done
cp "$root/tools/gpu/run.sh" "$dir/run.sh"
chmod a+rx "$dir/run.sh"

# torch_kit/: flatparam/torch, the GPT and their tests as sources, for a
# CMake build against the GPU machine's own LibTorch (torch_kit/build.sh;
# run.sh's torch_build step), linked with lib/ (torch_kit_deps' libraries).
# The sources are those CMakeLists.txt names, with every header of the
# packages they include; the system headers they need (Abseil, nlohmann
# JSON, GoogleTest, NCCL) and GoogleTest's static libraries come from this
# machine, as the kit's libraries were built with them.
kit=$dir/torch_kit
mkdir -p "$kit/src" "$kit/include" "$kit/lib"
cp "$root/tools/gpu/torch_kit/CMakeLists.txt" \
  "$root/tools/gpu/torch_kit/cxx_standard.cmake" \
  "$root/tools/gpu/torch_kit/build.sh" \
  "$root/tools/gpu/torch_kit/pytorch_fsdp_step.py" "$kit/"
chmod a+rx "$kit/build.sh" "$kit/pytorch_fsdp_step.py"
# shellcheck disable=SC2016  # ${SRC} is CMake's, matched literally
kit_sources=$(grep -o '\${SRC}/[^"]*\.cc' "$root/tools/gpu/torch_kit/CMakeLists.txt" | sed 's|^\${SRC}/||' | sort -u)
[ -n "$kit_sources" ] || die "tools/gpu/torch_kit/CMakeLists.txt names no \${SRC}/... sources"
(
  cd "$root"
  for f in $kit_sources $(find flatparam comm sim refmodel testing -name '*.h' | sort); do
    [ -f "$f" ] || die "torch_kit: $f is missing"
    mkdir -p "$kit/src/$(dirname "$f")"
    cp "$f" "$kit/src/$f"
  done
)
nccl_header=""
for h in "${CUDA_PATH:-/usr/local/cuda}/include/nccl.h" /usr/include/nccl.h; do
  if [ -f "$h" ]; then
    nccl_header=$h
    break
  fi
done
[ -n "$nccl_header" ] || die "torch_kit: no nccl.h (CUDA_PATH/include, /usr/include)"
cp "$nccl_header" "$kit/include/nccl.h"
for d in absl nlohmann gtest gmock; do
  [ -d "/usr/include/$d" ] || die "torch_kit: /usr/include/$d is missing (tools/setup.sh installs it)"
  cp -r "/usr/include/$d" "$kit/include/$d"
done
# The libraries the CMake build links: torch_kit_deps' (lib/ also holds
# other binaries' libraries, some of which need what only those binaries
# link, RapidCheck say).
ldd "$bin_root/tools/gpu/torch_kit_deps" | awk '$2 == "=>" {print $1}' |
  while read -r soname; do
    if [ -e "$dir/lib/$soname" ]; then echo "$soname"; fi
  done >"$kit/kit_libraries.txt"
[ -s "$kit/kit_libraries.txt" ] || die "torch_kit: torch_kit_deps needs no library of lib/"
kernels=$bin_root/flatparam/device/cuda/libcuda_kernels_nvcc.a
[ -f "$kernels" ] || die "torch_kit: $kernels was not built"
cp "$kernels" "$kit/lib/"
for a in libgtest.a libgmock.a libgtest_main.a; do
  [ -f "/usr/lib/x86_64-linux-gnu/$a" ] || die "torch_kit: /usr/lib/x86_64-linux-gnu/$a is missing"
  cp "/usr/lib/x86_64-linux-gnu/$a" "$kit/lib/$a"
done
chmod -R u+w,a+rX "$kit"

{
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
  echo "build: bazel build -c opt ${labels[*]}"
  if command -v objdump >/dev/null; then
    # The newest symbol versions the kit needs of the machine's runtime.
    for v in GLIBC GLIBCXX; do
      echo "needs: $v >= $(cd "$dir" && find bin lib -maxdepth 2 -type f ! -name '*.a' -print0 | xargs -0 objdump -T 2>/dev/null |
        grep -oE "\b${v}_[0-9.]+" | sed "s/^${v}_//" | sort -V | tail -n 1)"
    done
  fi
  echo "files:"
  (cd "$dir" && find . -type f ! -name MANIFEST | sort | while read -r f; do
    printf '  %-60s %10s\n' "${f#./}" "$(stat -c %s "$f")"
  done)
} >"$dir/MANIFEST"

bytes=$(du -sb "$dir" | cut -f1)
if [ "$bytes" -gt "$max_bytes" ]; then
  die "$dir holds $bytes bytes, over the 64 MiB ($max_bytes) one call carries"
fi
echo "bundle.sh: $dir: $(find "$dir/bin" -type f | wc -l) binaries, $(find "$dir/lib" -type f | wc -l) libraries, $((bytes / 1024)) KiB"
echo "bundle.sh: on the GPU machine, run: ./run.sh   (from that folder)"
