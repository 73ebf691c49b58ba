#!/usr/bin/env bash
# Builds the kit's LibTorch glue and its tests with CMake and Ninja
# (CMakeLists.txt beside this file) against a LibTorch:
#
#   build.sh --torch-cmake=DIR --kit-lib=DIR --nccl-lib=DIR --build=DIR
#            [--jobs=N]
#
#   --torch-cmake  where TorchConfig.cmake is found (CMAKE_PREFIX_PATH): a
#                  PyTorch's torch.utils.cmake_prefix_path, or
#                  /usr/lib/x86_64-linux-gnu/cmake for Debian's LibTorch
#   --kit-lib      the kit's lib/ (flatparam's shared libraries)
#   --nccl-lib     the folder of the machine's libnccl.so.2
#   --build        the build folder (made; must not hold another build)
#   --jobs         parallel compiles (default: the number of CPUs)
#
# The C++ standard is the one LibTorch's headers need, at least C++17
# (cxx_standard.cmake); FLATPARAM_KIT_CXX_STANDARD in the environment
# (17, 20 or 23) overrides it.
#
# Prints the LibTorch version and whether it has CUDA; the test binaries
# are in the build folder (recompute_test, fsdp_module_test, and with CUDA
# torch_cuda_test, fsdp_module_cuda_test). Exit status: cmake's or ninja's.
set -euo pipefail

torch_cmake=""
kit_lib=""
nccl_lib=""
build=""
jobs=$(nproc 2>/dev/null || echo 4)
for arg in "$@"; do
  case $arg in
    --torch-cmake=*) torch_cmake=${arg#*=} ;;
    --kit-lib=*) kit_lib=${arg#*=} ;;
    --nccl-lib=*) nccl_lib=${arg#*=} ;;
    --build=*) build=${arg#*=} ;;
    --jobs=*) jobs=${arg#*=} ;;
    *)
      echo "build.sh: unknown argument '$arg'" >&2
      exit 2
      ;;
  esac
done
if [ -z "$torch_cmake" ] || [ -z "$kit_lib" ] || [ -z "$nccl_lib" ] || [ -z "$build" ]; then
  echo "build.sh: --torch-cmake, --kit-lib, --nccl-lib and --build are required" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
for tool in cmake ninja; do
  command -v "$tool" >/dev/null || {
    echo "build.sh: $tool is not on PATH" >&2
    exit 1
  }
done
cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_cmake" -DFLATPARAM_KIT_LIB="$kit_lib" \
  -DFLATPARAM_NCCL_LIB="$nccl_lib" \
  -DFLATPARAM_KIT_CXX_STANDARD="${FLATPARAM_KIT_CXX_STANDARD:-}"
cmake --build "$build" -j "$jobs"
