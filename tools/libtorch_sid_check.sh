#!/usr/bin/env bash
# Builds and runs flatparam's LibTorch code against Debian sid's LibTorch
# (2.14 in 2026-12), on the CPU, in a Debian sid chroot: the check behind
# the README's "2.14.1 (Debian sid, CPU)" row. CI cannot run it (root, a
# chroot, minutes of downloads); run it by hand when LibTorch moves on.
#
#   sudo tools/libtorch_sid_check.sh DIR
#
# DIR: the chroot, made by debootstrap (needs the debootstrap package and
# deb.debian.org) if it does not exist, reused if this script made it
# before (DIR/.flatparam_sid_check), refused otherwise. About 1.5 GB.
#
# In the chroot:
#   1. Debian sid's libtorch-dev, cmake, ninja, g++ and libgloo-dev;
#   2. the GPU kit (tools/gpu/bundle.sh, from this checkout's optimized
#      build), its CMake build against that LibTorch (the standard its
#      CMake target names, C++20 for 2.14), and its CPU tests:
#      recompute_test, fsdp_module_test (bitwise against single-process
#      LibTorch), torch_step_compare on the CPU;
#   3. comm/c10d and its conformance suite (c10d_communicator_test), built
#      with g++ against that LibTorch and the kit's libraries, at 1 and 3
#      ranks on 127.0.0.1 (USE_LIBUV=0: Debian builds LibTorch without
#      libuv).
# The kit's OpenSSL (bookworm's 3.0, in its lib/fallback/) stays out of
# the chroot's link, as run.sh keeps it out on a machine with its own: sid's
# LibTorch links sid's libssl, which needs sid's libcrypto. Prints each
# step's result; exits 0 when all pass.
set -euo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$1
marker="$dir/.flatparam_sid_check"
apt_opts=(-o Acquire::Check-Valid-Until=false)

if [ -e "$dir" ] && [ ! -e "$marker" ]; then
  echo "libtorch_sid_check: $dir exists and is not a chroot this script made; give a new folder" >&2
  exit 2
fi
if [ ! -e "$marker" ]; then
  command -v debootstrap >/dev/null || {
    echo "libtorch_sid_check: needs debootstrap (apt-get install debootstrap)" >&2
    exit 2
  }
  echo "libtorch_sid_check: debootstrap sid into $dir"
  debootstrap --variant=minbase --include=ca-certificates sid "$dir" \
    http://deb.debian.org/debian >"$dir.debootstrap.log" 2>&1 || {
    echo "libtorch_sid_check: debootstrap failed: see $dir.debootstrap.log" >&2
    exit 1
  }
  touch "$marker"
fi

mounted=()
cleanup() {
  local m
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || true; done
}
trap cleanup EXIT
for m in proc dev dev/pts; do
  if ! mountpoint -q "$dir/$m"; then
    case $m in
      proc) mount -t proc proc "$dir/proc" ;;
      *) mount --bind "/$m" "$dir/$m" ;;
    esac
    mounted=("$dir/$m" "${mounted[@]}")
  fi
done
cp /etc/resolv.conf "$dir/etc/resolv.conf"

in_chroot() {
  chroot "$dir" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"
}

echo "libtorch_sid_check: 1. LibTorch and the build tools"
in_chroot bash -c "export DEBIAN_FRONTEND=noninteractive; apt-get ${apt_opts[*]} update -q &&
  apt-get ${apt_opts[*]} install -y -q --no-install-recommends libtorch-dev cmake ninja-build g++ libgloo-dev" \
  >"$dir/root/apt.log" 2>&1 || {
  echo "libtorch_sid_check: apt-get failed: see $dir/root/apt.log" >&2
  exit 1
}
# shellcheck disable=SC2016  # dpkg-query's own ${Version}
version=$(in_chroot dpkg-query -W -f '${Version}' libtorch-dev)
echo "libtorch_sid_check: libtorch-dev $version, $(in_chroot g++ --version | head -n 1)"

echo "libtorch_sid_check: 2. the GPU kit's build and CPU tests"
rm -rf "$dir/kit" "$dir/src"
"$root/tools/gpu/bundle.sh" "$dir/kit" >"$dir/root/bundle.log" 2>&1 || {
  echo "libtorch_sid_check: bundle.sh failed: see $dir/root/bundle.log" >&2
  exit 1
}
mkdir -p "$dir/opt/nccl"
nccl=${FLATPARAM_NCCL_LIB:-/usr/local/cuda/lib64}
cp -L "$nccl/libnccl.so.2" "$dir/opt/nccl/"

failures=0
step() {  # NAME COMMAND...: runs COMMAND in the chroot, logs to /root/NAME.log
  local name=$1
  shift
  if in_chroot bash -c "set -o pipefail; $*" >"$dir/root/$name.log" 2>&1; then
    echo "  PASS $name: $(tail -n 1 "$dir/root/$name.log")"
  else
    echo "  FAIL $name (log: $dir/root/$name.log):"
    tail -n 15 "$dir/root/$name.log" | sed 's/^/    /'
    failures=$((failures + 1))
  fi
}
step kit_build "cd /kit/torch_kit && ./build.sh --torch-cmake=/usr/lib/x86_64-linux-gnu/cmake \
  --kit-lib=/kit/lib --nccl-lib=/opt/nccl --build=/kit/build >/root/kit_build_full.log 2>&1;
  rc=\$?; grep -o 'flatparam kit: .*' /root/kit_build_full.log; exit \$rc"
step recompute_test "/kit/build/recompute_test 2>&1 | tail -n 3"
step fsdp_module_test "/kit/build/fsdp_module_test 2>&1 | tail -n 3"
step torch_step_compare "/kit/build/torch_step_compare --device=cpu --steps=5 --warmup=1"

echo "libtorch_sid_check: 3. comm/c10d's conformance suite"
mkdir -p "$dir/src"
(cd "$root" && cp -r --parents comm flatparam sim refmodel testing "$dir/src/")
cat >"$dir/src/build_c10d.sh" <<'EOF'
set -e
cd /src
k=/kit/torch_kit
# shellcheck disable=SC2046  # one argument per library
g++ -std=c++20 -O1 -DJSON_DIAGNOSTICS=1 -DUSE_C10D_GLOO -Wno-maybe-uninitialized \
  -I/src -I$k/include -isystem /usr/include/torch/csrc/api/include \
  comm/c10d/c10d_communicator.cc comm/c10d/c10d_environment.cc \
  comm/c10d/c10d_communicator_test.cc comm/c10d/c10d_test_main.cc \
  testing/multirank_test_main.cc -o /src/c10d_test \
  -Wl,-rpath,/kit/lib:/opt/nccl -L/kit/lib -ltorch -ltorch_cpu -lc10 -lgloo \
  -Wl,--no-as-needed $(sed 's|^|/kit/lib/|' $k/kit_libraries.txt) \
  -lcomm_Sconformance_Slibcollective_Ucases \
  -lcomm_Sconformance_Slibcollective_Ucases_Utestutil \
  -lcomm_Sconformance_Slibdevice_Umemory -lcomm_Sconformance_Slibcase_Uvalues \
  -lcomm_Sconformance_Slibbandwidth /opt/nccl/libnccl.so.2 \
  -Wl,--whole-archive $k/lib/libcuda_kernels_nvcc.a -Wl,--no-whole-archive \
  $k/lib/libgmock.a $k/lib/libgtest.a -pthread
echo built
EOF
cat >"$dir/src/run_c10d.sh" <<'EOF'
n=$1
port=$((29500 + n))
pids=()
for ((r = 0; r < n; r++)); do
  env RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$port GLOO_SOCKET_IFNAME=lo USE_LIBUV=0 \
    timeout 120 /src/c10d_test >"/root/c10d_rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
grep -h 'PASSED\|FAILED' /root/c10d_rank*.log | sort | uniq -c
exit $rc
EOF
step c10d_build "bash /src/build_c10d.sh"
step c10d_1_rank "bash /src/run_c10d.sh 1"
step c10d_3_ranks "bash /src/run_c10d.sh 3"

echo "libtorch_sid_check: LibTorch $version: $failures failed"
[ "$failures" -eq 0 ]
