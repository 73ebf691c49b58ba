#!/usr/bin/env bash
# Installs everything flatparam's build, tests and checks need on a Debian
# bookworm machine (run as root, or with sudo available). Idempotent: when
# everything is present it returns in well under a second.
#
#   tools/setup.sh            # install what is missing
#
# What it installs:
#   Debian: Bazel 4 (bazel-bootstrap), Abseil, GoogleTest/GoogleMock, Google
#           Benchmark, RapidCheck, nlohmann-json, xxHash, OpenMPI, pkg-config,
#           clang-format, libtorch-dev (LibTorch 1.13 for //flatparam/torch,
#           CPU), cmake and ninja-build (the GPU kit's CMake build of
#           flatparam/torch, checked against that LibTorch by
#           tools/gpu/bundle_test.sh), libgloo-dev (the headers of c10d's gloo process group,
#           for //comm/c10d) and python3-torch (the independent reader and writer of
#           torch.save files in its tests), python3-numpy (the independent safetensors
#           reader of //tools:hf_cli_test), and iproute2 and nftables (the
#           test hosts of //tools:train_hosts_test: network namespaces, and
#           packet loss on their links).
#   npm:    buildifier (the @bazel/buildifier package ships its binaries).
# CUDA/NCCL are optional and detected at build time (/usr/local/cuda or
# $CUDA_PATH); this script does not install them.
set -euo pipefail

APT_PACKAGES=(
  bazel-bootstrap
  libabsl-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  librapidcheck-dev
  nlohmann-json3-dev
  libxxhash-dev
  libzip-dev
  openmpi-bin
  libopenmpi-dev
  pkgconf
  clang-format
  python3-numpy
  libtorch-dev
  cmake
  ninja-build
  libgloo-dev
  python3-torch
  iproute2
  nftables
  nodejs
  npm
)
BUILDIFIER_VERSION=8.2.1

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
    # A package may be satisfied by another that provides it (npm ships with
    # some nodejs builds).
    case "$p" in
      npm) command -v npm >/dev/null 2>&1 && continue ;;
      nodejs) command -v node >/dev/null 2>&1 && continue ;;
    esac
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v buildifier >/dev/null 2>&1 ||
   [ "$(buildifier --version 2>/dev/null | sed -n 's/^buildifier version: *\([0-9.]*\).*/\1/p')" != "$BUILDIFIER_VERSION" ]; then
  echo "setup: installing buildifier $BUILDIFIER_VERSION from npm" >&2
  as_root npm install -g --silent "@bazel/buildifier@$BUILDIFIER_VERSION" >/dev/null
fi
