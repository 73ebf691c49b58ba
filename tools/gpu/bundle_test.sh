#!/usr/bin/env bash
# Checks the GPU kit on a machine without a GPU (CI runs it right after the
# optimized build, whose outputs bundle.sh reuses):
#   0. the kit's CMake build picks the C++ standard LibTorch's headers need
#      (torch_kit/cxx_standard_test.cmake);
#   1. tools/gpu/bundle.sh builds a kit into a temporary folder, under 64 MiB;
#   2. every binary and library in it resolves each library it needs from
#      the kit's lib/ (the CUDA runtime included), except the C/C++ runtime,
#      the driver's libcuda and NCCL, with no LD_LIBRARY_PATH of this
#      machine (and nothing links OpenMPI); a copy of the kit with one
#      library removed must fail that check; OpenSSL (libcrypto.so.3) is
#      in lib/fallback/, not lib/, and the CMake build does not name it;
#   3. run.sh under `env -i PATH=/usr/bin:/bin` reaches its GPU check and
#      reports "no GPU" as a SKIP (exit 0), and with FLATPARAM_REQUIRE_GPU=1
#      as a FAIL (exit 1);
#   4. with a stand-in nvidia-smi (so that run.sh goes past its GPU check):
#      it finds NCCL and its version, its own ldd check passes (and fails on
#      the broken copy), the tests run and fail with FLATPARAM_REQUIRE_GPU=1's
#      message, the driver check fails for want of a driver, at most 8
#      output files; with --budget-s=0 the tests, the benchmark and then the
#      sanitizers are skipped as out of time; NCCL is found in an
#      nvidia-nccl wheel of python3's path and the wheel named; run.sh
#      keeps this machine's libcrypto.so.3, and on a machine without one
#      (stand-in ldconfig, FLATPARAM_SYSTEM_LIB_DIRS) links lib/fallback/'s
#      from a folder it removes on exit; and a run
#      stopped by SIGTERM in the middle of a step still reports the steps
#      before it and where it was cut off;
#   5. in that run, the kit's CMake build of flatparam/torch (torch_build)
#      against this machine's LibTorch (Debian's 1.13, CPU only, so C++17;
#      .ci/run's step 3c compiles the library as C++20, against 2.14)
#      passes, and so do the CPU tests it built (torch_cpu: Recompute, and
#      FsdpModule bitwise against single-process LibTorch), while the GPU
#      tests are reported as not built; torch_bench times
#      torch_step_compare on the CPU; pytorch_fsdp_step.py (PyTorch's FSDP,
#      GPU only) parses.
#
#   tools/gpu/bundle_test.sh
#
# Environment: as bundle.sh (FLATPARAM_BAZEL_STARTUP_OPTS,
# FLATPARAM_BAZEL_BUILD_OPTS). Prints "bundle_test: ok" and exits 0, or
# prints each failed check and exits 1.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bundle_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0

fail() {
  echo "bundle_test: FAIL: $*"
  failures=$((failures + 1))
}

# 0. The kit's choice of C++ standard (torch_kit/cxx_standard.cmake).
cmake -P "$root/tools/gpu/torch_kit/cxx_standard_test.cmake" >"$tmp/cxx_standard.log" 2>&1 ||
  fail "torch_kit/cxx_standard_test.cmake: $(cat "$tmp/cxx_standard.log")"

# Libraries the GPU machine provides (as in bundle.sh).
provided_re='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|ld-linux|libpthread|libdl|librt|libnccl|libcuda)\.so'

# check_libs KIT: every ELF file of KIT/bin, KIT/lib and KIT/lib/fallback
# resolves what it needs from KIT/lib or KIT/lib/fallback (which comes last,
# as run.sh puts it on a machine that lacks those), or is a provided
# library; prints what does not.
check_libs() {
  local kit=$1 bad=0 f out soname arrow path
  for f in "$kit"/bin/* "$kit"/lib/* "$kit"/lib/fallback/*; do
    [ -f "$f" ] || continue
    out=$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$kit/lib:$kit/lib/fallback" ldd "$f" 2>&1) || {
      echo "  ldd $f failed: $out"
      bad=1
      continue
    }
    while read -r soname arrow path _; do
      [ "$arrow" = "=>" ] || continue
      if [[ $soname == libmpi* || $soname == libopen-* ]]; then
        echo "  $(basename "$f") needs OpenMPI ($soname)"
        bad=1
      elif [[ $soname =~ $provided_re ]]; then
        continue
      elif [[ $path != "$kit/lib/"* ]]; then
        echo "  $(basename "$f") needs $soname from outside the kit: $path"
        bad=1
      fi
    done <<<"$out"
  done
  return $bad
}

# --- 0. Only where the build found CUDA and NCCL.
# shellcheck disable=SC2206  # word splitting of option lists is intended
startup=(${FLATPARAM_BAZEL_STARTUP_OPTS:-})
if ! (cd "$root" && bazel ${startup[@]+"${startup[@]}"} query \
  //comm/nccl:nccl_gpu_test >/dev/null 2>&1); then
  echo "bundle_test: skipped: this build found no CUDA with NCCL (//comm/nccl:nccl_gpu_test is not defined), so there is no GPU kit to build"
  exit 0
fi

# --- 1. The kit.
kit=$tmp/kit
if ! "$root/tools/gpu/bundle.sh" "$kit" >"$tmp/bundle.log" 2>&1; then
  tail -n 30 "$tmp/bundle.log"
  echo "bundle_test: FAIL: tools/gpu/bundle.sh failed (above)"
  exit 1
fi
bytes=$(du -sb "$kit" | cut -f1)
if [ "$bytes" -ge $((64 * 1024 * 1024)) ]; then
  fail "the kit holds $bytes bytes, not under 64 MiB"
fi
for f in run.sh MANIFEST bin/gpu_versions bin/cuda_smoke_test bin/gpu_bench; do
  [ -e "$kit/$f" ] || fail "the kit has no $f"
done
compgen -G "$kit/lib/libcudart.so.*" >/dev/null ||
  fail "the kit does not bundle the CUDA runtime (lib/libcudart.so.N)"
echo "bundle_test: kit of $((bytes / 1024)) KiB, $(find "$kit/bin" -type f | wc -l) binaries, $(find "$kit/lib" -type f | wc -l) libraries"

# --- 2. Libraries resolve from the kit; a kit missing one fails the check.
if ! check_libs "$kit" >"$tmp/libs.log"; then
  cat "$tmp/libs.log"
  fail "libraries of the kit do not all resolve from its lib/ (above)"
fi
broken=$tmp/broken
cp -r "$kit" "$broken"
victim=""
for f in "$broken"/lib/libabsl_status.so*; do
  [ -e "$f" ] && victim=$(basename "$f") && break
done
[ -n "$victim" ] || fail "no libabsl_status in the kit to remove for the negative check"
rm -f "$broken/lib/$victim"
if check_libs "$broken" >"$tmp/broken_libs.log"; then
  fail "the library check passed on a kit without lib/$victim"
elif ! grep -q "$victim" "$tmp/broken_libs.log"; then
  fail "the library check on a kit without lib/$victim did not name it"
fi

# OpenSSL, which this machine has, is in lib/fallback/, not lib/ (where it
# would shadow the machine's), nor linked by name by the CMake build.
if ldd "$kit/bin/torch_kit_deps" | grep -q "libcrypto\.so\.3 =>"; then
  [ -f "$kit/lib/fallback/libcrypto.so.3" ] ||
    fail "the kit does not bundle libcrypto.so.3 in lib/fallback/"
  [ ! -e "$kit/lib/libcrypto.so.3" ] ||
    fail "lib/libcrypto.so.3 would shadow the machine's OpenSSL"
  ! grep -q "^libcrypto" "$kit/torch_kit/kit_libraries.txt" ||
    fail "torch_kit/kit_libraries.txt names libcrypto"
else
  fail "torch_kit_deps no longer needs libcrypto.so.3: the lib/fallback/ checks below check nothing"
fi

# --- 3. run.sh without a GPU and without this machine's environment.
if env -i PATH=/usr/bin:/bin bash -c 'command -v nvidia-smi' >/dev/null; then
  echo "bundle_test: nvidia-smi is on /usr/bin:/bin: not checking the no-GPU paths"
else
  rc=0
  env -i PATH=/usr/bin:/bin "$kit/run.sh" --out="$tmp/out_skip" >"$tmp/skip.log" 2>&1 || rc=$?
  [ $rc -eq 0 ] || fail "run.sh without a GPU exited $rc, not 0: $(cat "$tmp/skip.log")"
  grep -qE '^gpu +SKIP .*no GPU' "$tmp/out_skip/summary.txt" ||
    fail "run.sh without a GPU did not report a skip: $(cat "$tmp/out_skip/summary.txt")"
  rc=0
  env -i PATH=/usr/bin:/bin FLATPARAM_REQUIRE_GPU=1 "$kit/run.sh" \
    --out="$tmp/out_req" >"$tmp/req.log" 2>&1 || rc=$?
  [ $rc -eq 1 ] || fail "run.sh without a GPU under FLATPARAM_REQUIRE_GPU=1 exited $rc, not 1"
  grep -qE '^gpu +FAIL .*no GPU' "$tmp/out_req/summary.txt" ||
    fail "run.sh under FLATPARAM_REQUIRE_GPU=1 did not report a failure: $(cat "$tmp/out_req/summary.txt")"
fi

# The PyTorch FSDP side of torch_bench runs only on a GPU machine: here it
# must at least parse.
if command -v python3 >/dev/null; then
  python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' \
    "$kit/torch_kit/pytorch_fsdp_step.py" ||
    fail "torch_kit/pytorch_fsdp_step.py does not parse"
fi

# --- 4. Past the GPU check, with a stand-in nvidia-smi.
fake=$tmp/fake_bin
mkdir -p "$fake"
cat >"$fake/nvidia-smi" <<'EOF'
#!/bin/sh
# A stand-in for bundle_test.sh: a card that is not there.
case "$*" in
  *--query-gpu*) echo "Stand-in GPU, 000.00" ;;
  *) echo "stand-in nvidia-smi (bundle_test.sh): no real GPU" ;;
esac
EOF
chmod +x "$fake/nvidia-smi"
if [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ]; then
  echo "bundle_test: no /usr/local/cuda/lib64/libnccl.so.2: not running run.sh past its GPU check"
else
  rc=0
  # This machine's LibTorch (Debian's 1.13, CPU only) for the kit's CMake
  # build, where it has its CMake files.
  torch_cmake=""
  if [ -f /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ]; then
    torch_cmake=/usr/lib/x86_64-linux-gnu/cmake
  fi
  env -i PATH="$fake:/usr/bin:/bin" FLATPARAM_REQUIRE_GPU=1 \
    FLATPARAM_NCCL_LIB=/usr/local/cuda/lib64 FLATPARAM_TORCH_CMAKE="$torch_cmake" \
    FLATPARAM_TORCH_PYTHON=/nonexistent FLATPARAM_TORCH_BENCH_DEVICE=cpu \
    FLATPARAM_TORCH_BENCH_ARGS="--steps=2 --warmup=1" "$kit/run.sh" --budget-s=600 \
    --out="$tmp/out_fake" >"$tmp/fake.log" 2>&1 || rc=$?
  summary=$tmp/out_fake/summary.txt
  [ $rc -eq 1 ] || fail "run.sh with a stand-in GPU and no device exited $rc, not 1"
  grep -qE '^gpu +PASS .*Stand-in GPU, driver 000.00' "$summary" || fail "no gpu PASS line with the stand-in card"
  grep -qE '^nccl +PASS .*NCCL 2\.[0-9]+\.[0-9]+' "$summary" || fail "no nccl PASS line with a version"
  grep -qE '^bundle +PASS' "$summary" || fail "run.sh's own library check did not pass"
  grep -qE '^smoke +FAIL' "$summary" || fail "the smoke test did not fail without a device"
  grep -q 'FLATPARAM_REQUIRE_GPU=1, so a missing GPU is a failure' "$tmp/out_fake/tests.log" ||
    fail "tests.log lacks FLATPARAM_REQUIRE_GPU=1's failure message"
  grep -qE '^nccl: 2\.' "$summary" || fail "the summary does not give the NCCL version"
  # Ranks per GPU follow the NCCL version (NCCL_MULTI_RANK_GPU_ENABLE from 2.30).
  nccl_minor=$(sed -n 's/^nccl: 2\.\([0-9]*\)\..*/\1/p' "$summary")
  if [ "${nccl_minor:-0}" -ge 30 ]; then
    grep -qE '^ranks_per_gpu: up to 2 .*NCCL_MULTI_RANK_GPU_ENABLE=1' "$summary" ||
      fail "NCCL 2.$nccl_minor, but the summary does not say 2 ranks per GPU"
  else
    grep -qE '^ranks_per_gpu: 1 .*need NCCL 2\.30' "$summary" ||
      fail "NCCL 2.$nccl_minor, but the summary does not say 1 rank per GPU and why"
  fi
  grep -qE '^cuda +FAIL .*reports no CUDA version' "$summary" ||
    fail "the driver check did not fail without a driver"
  # The kit's CMake build of flatparam/torch against this machine's
  # LibTorch, and its CPU tests; the GPU tests are not built (no CUDA).
  if [ -n "$torch_cmake" ]; then
    grep -qE '^torch: from FLATPARAM_TORCH_CMAKE' "$summary" || fail "the summary does not say which LibTorch"
    grep -qE 'flatparam kit: LibTorch .*, C\+\+17$' "$tmp/out_fake/torch_build.log" ||
      fail "the kit's CMake build against LibTorch 1.13 did not pick C++17"
    grep -qE '^torch_build +PASS' "$summary" ||
      fail "the kit's CMake build against $torch_cmake failed: $(grep -E 'error|Error' "$tmp/out_fake/torch_build.log" | head -n 5)"
    grep -qE '^torch_cpu +PASS' "$summary" ||
      fail "the kit-built recompute_test and fsdp_module_test did not pass: $(grep -E '^torch_cpu' "$summary")"
    grep -qE '^torch_gpu +FAIL .*not built: fsdp_module_cuda_test' "$summary" ||
      fail "torch_gpu did not say that this LibTorch built no GPU test: $(grep -E '^torch_gpu' "$summary")"
    grep -qE '^torch_bench +PASS .*FsdpModule [0-9.]+ ms, plain LibTorch [0-9.]+ ms \(x[0-9.]+\); PyTorch FSDP not run' "$summary" ||
      fail "torch_bench on the CPU did not report FsdpModule against plain LibTorch: $(grep -E '^torch_bench' "$summary")"
    grep -q '"fsdp_vs_plain"' "$tmp/out_fake/torch_bench.log" || fail "torch_bench.log has no fsdp_vs_plain"
  else
    grep -qE '^torch_build +FAIL .*no Python here imports torch' "$summary" ||
      fail "without a LibTorch, torch_build did not say so: $(grep -E '^torch_build' "$summary")"
  fi
  # This machine has OpenSSL 3: its own is used, not lib/fallback/'s.
  grep -q '^libcrypto.so.3: the machine.s own' "$tmp/out_fake/env.txt" ||
    fail "run.sh did not take this machine's libcrypto.so.3: $(grep libcrypto "$tmp/out_fake/env.txt" | head -n 3)"
  if grep -E 'libcrypto\.so\.3 => ' "$tmp/out_fake/env.txt" | grep -q "$kit/"; then
    fail "a binary took libcrypto.so.3 from the kit on a machine that has its own"
  fi
  n=$(find "$tmp/out_fake" -type f | wc -l)
  [ "$n" -le 8 ] || fail "run.sh wrote $n files, more than 8"
  if [ $failures -gt 0 ]; then cat "$summary"; fi

  # The broken copy: run.sh's own check names the missing library.
  rc=0
  env -i PATH="$fake:/usr/bin:/bin" FLATPARAM_NCCL_LIB=/usr/local/cuda/lib64 \
    "$broken/run.sh" --budget-s=0 --out="$tmp/out_broken" >/dev/null 2>&1 || rc=$?
  [ $rc -eq 1 ] || fail "run.sh on the kit without lib/$victim exited $rc, not 1"
  grep -qE "^bundle +FAIL .*$victim" "$tmp/out_broken/summary.txt" ||
    fail "run.sh on the kit without lib/$victim did not report it: $(cat "$tmp/out_broken/summary.txt")"

  # No budget: every step after the bundle check is skipped, not run.
  rc=0
  env -i PATH="$fake:/usr/bin:/bin" FLATPARAM_NCCL_LIB=/usr/local/cuda/lib64 \
    "$kit/run.sh" --budget-s=0 --out="$tmp/out_budget" >/dev/null 2>&1 || rc=$?
  # Nothing ran; the one failure is the driver check (the stand-in has no
  # driver).
  [ $rc -eq 1 ] || fail "run.sh --budget-s=0 exited $rc, not 1 (the driver check fails)"
  others=$(grep -E '^[a-z_]+ +FAIL' "$tmp/out_budget/summary.txt" | grep -v '^cuda ' || true)
  [ -z "$others" ] || fail "run.sh --budget-s=0 failed more than the driver check: $others"
  grep -qE '^smoke +SKIP .*budget spent' "$tmp/out_budget/summary.txt" ||
    fail "run.sh --budget-s=0 did not skip the tests for lack of time"
  grep -qE '^bench +SKIP .*budget spent' "$tmp/out_budget/summary.txt" ||
    fail "run.sh --budget-s=0 did not skip the benchmark for lack of time"
  # The benchmark comes before the sanitizers, which are the likeliest to be
  # cut off; racecheck and synccheck are gone.
  order=$(grep -oE '^(bench|memcheck|initcheck|racecheck|synccheck) ' "$tmp/out_budget/summary.txt" | tr -d ' ' | tr '\n' ' ')
  [ "$order" = "bench memcheck initcheck " ] ||
    fail "run.sh's last steps are '$order', not 'bench memcheck initcheck '"

  # A machine without OpenSSL 3 (no such file in its library folders, none
  # in ldconfig's cache): lib/fallback/'s copy is linked from a folder of
  # run.sh's own, which is gone when it exits.
  no_ssl=$tmp/no_ssl_bin
  mkdir -p "$no_ssl" "$tmp/no_ssl_tmp"
  printf '#!/bin/sh\necho "0 libs found in cache"\n' >"$no_ssl/ldconfig"
  chmod +x "$no_ssl/ldconfig"
  rc=0
  env -i PATH="$no_ssl:$fake:/usr/bin:/bin" TMPDIR="$tmp/no_ssl_tmp" \
    FLATPARAM_SYSTEM_LIB_DIRS=/nonexistent FLATPARAM_NCCL_LIB=/usr/local/cuda/lib64 \
    "$kit/run.sh" --budget-s=0 --out="$tmp/out_no_ssl" >/dev/null 2>&1 || rc=$?
  grep -q '^libcrypto.so.3: the kit.s (lib/fallback/)' "$tmp/out_no_ssl/env.txt" ||
    fail "run.sh on a machine without OpenSSL did not take lib/fallback/'s: $(grep libcrypto "$tmp/out_no_ssl/env.txt" | head -n 3)"
  grep -qE "libcrypto\.so\.3 => $tmp/no_ssl_tmp/flatparam-kit-lib\.[^/]+/libcrypto\.so\.3" \
    "$tmp/out_no_ssl/env.txt" ||
    fail "on a machine without OpenSSL, the binaries did not resolve libcrypto.so.3 from lib/fallback/: $(grep -m 3 'libcrypto.so.3 =>' "$tmp/out_no_ssl/env.txt")"
  grep -qE '^bundle +PASS' "$tmp/out_no_ssl/summary.txt" ||
    fail "run.sh's library check failed on a machine without OpenSSL"
  [ -z "$(ls -A "$tmp/no_ssl_tmp")" ] || fail "run.sh left $(ls "$tmp/no_ssl_tmp") behind"

  # NCCL from an nvidia-nccl wheel on python3's path, named in the summary.
  if command -v python3 >/dev/null; then
    sp=$tmp/site-packages
    mkdir -p "$sp/nvidia/nccl/lib" "$sp/nvidia_nccl_cu13-2.28.9.dist-info"
    ln -s /usr/local/cuda/lib64/libnccl.so.2 "$sp/nvidia/nccl/lib/libnccl.so.2"
    rc=0
    env -i PATH="$fake:/usr/bin:/bin" PYTHONPATH="$sp" "$kit/run.sh" \
      --budget-s=0 --out="$tmp/out_wheel" >/dev/null 2>&1 || rc=$?
    grep -qE "^nccl +PASS .*from $sp/nvidia/nccl/lib \(nvidia-nccl-cu13 2\.28\.9\)" \
      "$tmp/out_wheel/summary.txt" ||
      fail "run.sh did not find NCCL in the wheel on PYTHONPATH: $(grep '^nccl' "$tmp/out_wheel/summary.txt")"
  fi

  # Cut off mid-way: a kit whose smoke test hangs, stopped by SIGTERM once
  # the smoke test has started (it leaves a file saying so), as a call's
  # time limit would stop it.
  slow=$tmp/slow
  cp -r "$kit" "$slow"
  printf '#!/bin/sh\ntouch "%s"\nsleep 60\n' "$tmp/smoke_started" >"$slow/bin/cuda_smoke_test"
  rc=0
  env -i PATH="$fake:/usr/bin:/bin" FLATPARAM_NCCL_LIB=/usr/local/cuda/lib64 \
    timeout -s KILL 120 "$slow/run.sh" --budget-s=150 --out="$tmp/out_cut" \
    >"$tmp/cut.log" 2>&1 &
  cut_pid=$!
  for _ in $(seq 1 600); do
    [ -e "$tmp/smoke_started" ] && break
    kill -0 "$cut_pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -e "$tmp/smoke_started" ] || fail "run.sh never reached the smoke test: $(tail -n 5 "$tmp/cut.log")"
  # timeout passes SIGTERM on to run.sh.
  kill -TERM "$cut_pid" 2>/dev/null
  wait "$cut_pid" || rc=$?
  [ $rc -ne 0 ] || fail "run.sh cut off by SIGTERM exited 0"
  grep -qE '^gpu +PASS' "$tmp/out_cut/summary.txt" ||
    fail "run.sh cut off mid-way lost the steps before it: $(cat "$tmp/out_cut/summary.txt")"
  grep -qE '^nccl: 2\.' "$tmp/out_cut/summary.txt" ||
    fail "run.sh cut off mid-way did not keep the NCCL version"
  grep -qE '^result: CUT OFF during smoke \(SIGTERM\)' "$tmp/out_cut/summary.txt" ||
    fail "run.sh cut off mid-way did not say where: $(tail -n 3 "$tmp/out_cut/summary.txt")"
fi

if [ $failures -gt 0 ]; then
  echo "bundle_test: $failures checks failed"
  exit 1
fi
echo "bundle_test: ok"
