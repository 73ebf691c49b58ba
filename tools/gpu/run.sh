#!/usr/bin/env bash
# Runs flatparam's GPU checks from a folder made by tools/gpu/bundle.sh, on a
# machine with a GPU but without Bazel or flatparam's build dependencies:
#
#   ./run.sh [--budget-s=SECONDS] [--out=DIR]
#
# Steps, in order (each one PASS, FAIL or SKIP, with its time):
#   gpu        nvidia-smi sees a GPU and a driver (card name, driver version)
#   nccl       the machine's libnccl.so.2 and its version, via
#              bin/gpu_versions: $FLATPARAM_NCCL_LIB, else the nvidia-nccl
#              wheel of any Python (python3 on PATH, /opt/*/.venv,
#              /opt/*/venv, /usr/local/lib/python3*, ~/.local), else the
#              CUDA and system library folders, else `ldconfig -p`; the
#              wheel's name and version go to the summary
#              (NCCL 2.30 and later: NCCL_MULTI_RANK_GPU_ENABLE=1, so
#              that the multi-rank tests run 2 ranks on one GPU; the
#              summary's ranks_per_gpu line says which)
#   cuda       the driver supports the CUDA runtime bundled in lib/
#              (cudaDriverGetVersion against cudaRuntimeGetVersion)
#   bundle     every binary resolves all its libraries (ldd); the machine's
#              own OpenSSL 3 is used, lib/fallback/'s copy only where the
#              machine has none (its library folders, or
#              $FLATPARAM_SYSTEM_LIB_DIRS, and `ldconfig -p`)
#   smoke, device_ops, nccl_unit, nccl_gpu, training
#              the GPU tests, with FLATPARAM_REQUIRE_GPU=1 (a missing GPU
#              fails instead of skipping)
#   torch_build  flatparam/torch, the GPT and their tests built with CMake
#              and Ninja (torch_kit/build.sh, into torch_kit/build, so a
#              second run is incremental) against this machine's PyTorch:
#              the first Python that imports torch ($FLATPARAM_TORCH_PYTHON,
#              python3 on PATH, /opt/*/.venv, /opt/*/venv, /usr/local/bin),
#              or $FLATPARAM_TORCH_CMAKE (Torch's cmake folder); its version
#              goes to the summary
#   torch_cuda, torch_gpu
#              that build's GPU tests: TorchCudaDeviceOps on LibTorch's
#              stream and allocator; the GPT trained 50 steps under
#              FsdpModule against plain LibTorch on the same GPU
#   torch_cpu  its CPU tests against this LibTorch: Recompute, and
#              FsdpModule bitwise against single-process LibTorch on
#              simulated ranks
#   torch_bench  the GPT's step (FULL_SHARD, one rank, the real NCCL) under
#              FsdpModule against plain LibTorch (torch_step_compare) and
#              against PyTorch's own FSDP on the same model and batch
#              (torch_kit/pytorch_fsdp_step.py, with the Python found
#              above); medians and ratios in the summary, the JSON in
#              torch_bench.log. The model: $FLATPARAM_TORCH_BENCH_ARGS
#              (default GPT-2 small's shape, 12 x 768, 512 tokens x 8);
#              $FLATPARAM_TORCH_BENCH_DEVICE=cpu times it on the CPU
#   bench      bin/gpu_bench (Google Benchmark JSON); more flags for it in
#              $FLATPARAM_BENCH_ARGS (e.g. --max_bytes=16777216). Before
#              the sanitizers, which are the slowest and the most likely to
#              be cut off.
#   memcheck   compute-sanitizer memcheck with stream-ordered race tracking
#              (--track-stream-ordered-races all: use before allocation and
#              after a stream-ordered free) over the CUDA DeviceOps and
#              handle tests
#   initcheck  compute-sanitizer initcheck (reads of uninitialised device
#              memory) over the same tests
#   racecheck and synccheck are not run: they check shared memory and
#   barriers, which flatparam's kernels do not use. API errors are not
#   reported (--report-api-errors no): NCCL probes the driver with calls that
#   are expected to fail, the tests provoke CUDA errors on purpose, and
#   flatparam checks every CUDA result itself. Where compute-sanitizer
#   answers "Device not supported", the step is a SKIP with that reason.
#
# Every kernel is loaded when a binary starts (CUDA_MODULE_LOADING=EAGER):
# with lazy loading, the first launch of a kernel waits for the device to
# drain, which deadlocks ranks of one process while an NCCL kernel waits for
# a peer.
#
# Without a GPU (the `gpu` step): a SKIP and exit 0, or with
# FLATPARAM_REQUIRE_GPU=1 in the environment a FAIL and exit 1.
#
# Time: before each step the remaining budget (--budget-s, default 360: a
# 6-minute window) is checked; each step runs under `timeout` with at most
# its own cap and what is left; once the budget is spent the remaining steps
# are SKIPped with a note. summary.txt is written step by step (the card,
# driver and NCCL lines as soon as they are known), so a run cut off
# mid-way still reports every step it finished; one stopped by SIGTERM or
# SIGINT also says where ("result: CUT OFF during STEP").
#
# Output, under --out (default $OUT, else ./out; at most 8 files):
#   summary.txt     one line per step, the card, driver and NCCL version
#   env.txt         nvidia-smi, the NCCL search, ldd of every binary
#   tests.log       the GPU tests' output
#   sanitizer.log   compute-sanitizer's output
#   gpu_bench.json  Google Benchmark's JSON
#   gpu_bench.log   the benchmark's console output
#   torch_build.log CMake's and Ninja's output
#   torch_bench.log torch_bench's output: a JSON line each, ours then PyTorch FSDP's
#
# Exit status: 0 when no step failed, 1 otherwise, 2 for bad arguments.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
budget_s=360
# The environment this script started with, for the programs that are the
# machine's own (Python and PyTorch, CMake) and for the kit's CMake-built
# binaries (whose RUNPATH names lib/ and LibTorch's folder): lib/, on
# LD_LIBRARY_PATH for bin/, holds the build machine's libcrypto, Abseil,
# ..., which must not shadow the libraries those were built against.
if [ -n "${LD_LIBRARY_PATH:-}" ]; then
  original_env=(env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH")
else
  original_env=(env -u LD_LIBRARY_PATH)
fi
out=${OUT:-$here/out}

for arg in "$@"; do
  case $arg in
    --budget-s=*) budget_s=${arg#--budget-s=} ;;
    --out=*) out=${arg#--out=} ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "run.sh: unknown argument '$arg' (see --help)" >&2
      exit 2
      ;;
  esac
done
if ! [[ $budget_s =~ ^[0-9]+$ ]]; then
  echo "run.sh: --budget-s wants whole seconds, got '$budget_s'" >&2
  exit 2
fi

mkdir -p "$out"
summary=$out/summary.txt
env_log=$out/env.txt
tests_log=$out/tests.log
san_log=$out/sanitizer.log
: >"$summary"
: >"$env_log"
: >"$tests_log"
: >"$san_log"

require_gpu=${FLATPARAM_REQUIRE_GPU:-}
start=$SECONDS
failed=0
card="unknown"
driver="unknown"
nccl_version="unknown"
cuda_versions="unknown"

say() { echo "run.sh: $*"; }

record() {  # $1: step, $2: PASS/FAIL/SKIP, $3: seconds, $4: detail
  printf '%-10s %-4s %5ss  %s\n' "$1" "$2" "$3" "$4" >>"$summary"
  say "$1: $2 (${3}s) $4"
  if [ "$2" = FAIL ]; then failed=1; fi
}

left() { echo $((budget_s - (SECONDS - start))); }

# Whether step $1 may start: false (and a SKIP recorded) when under 10 s of
# the budget remain.
have_budget() {
  if [ "$(left)" -lt 10 ]; then
    record "$1" SKIP 0 "budget spent (${budget_s}s): not run"
    return 1
  fi
}

# run_step NAME CAP_S LOG CMD...: runs CMD under `timeout` with the smaller
# of CAP_S and the budget left, appending its output to LOG; records PASS
# on exit 0, FAIL otherwise (124: out of time), SKIP when under 10 s remain.
run_step() {
  run_timed "$@" || return 0
  record_run
}

# run_timed NAME CAP_S LOG CMD...: the first half of run_step: runs CMD and
# leaves its exit status, time and limit in run_rc, run_s and run_limit
# (with run_name and run_log) for record_run; returns 1 (and records a
# SKIP) when the budget is spent.
run_timed() {
  run_name=$1
  local cap=$2 remaining t0
  run_log=$3
  shift 3
  have_budget "$run_name" || return 1
  step=$run_name
  remaining=$(left)
  run_limit=$((cap < remaining ? cap : remaining))
  echo "===== $run_name: $* (limit ${run_limit}s)" >>"$run_log"
  t0=$SECONDS
  # In the background, so that a SIGTERM to this script runs its trap at
  # once (bash defers traps while a foreground child runs).
  set +e
  timeout --kill-after=5 "$run_limit" "$@" >>"$run_log" 2>&1 &
  run_pid=$!
  wait "$run_pid"
  run_rc=$?
  run_pid=""
  set -e
  run_s=$((SECONDS - t0))
  echo "===== $run_name: exit $run_rc after ${run_s}s" >>"$run_log"
}

record_run() {
  if [ "$run_rc" -eq 0 ]; then
    record "$run_name" PASS "$run_s" ""
  elif [ "$run_rc" -eq 124 ] || [ "$run_rc" -eq 137 ]; then
    record "$run_name" FAIL "$run_s" "timed out after ${run_limit}s (see $(basename "$run_log"))"
  else
    record "$run_name" FAIL "$run_s" "exit $run_rc (see $(basename "$run_log"))"
  fi
}

# A fact about the machine, in the summary as soon as it is known.
fact() {  # $1: name, $2: value
  printf '%s: %s\n' "$1" "$2" >>"$summary"
}

step="setup"  # the step under way, for a cut-off run's last line
run_pid=""    # the step's process while it runs

finish() {
  {
    echo
    echo "total: $((SECONDS - start))s of ${budget_s}s budget"
    echo "result: $([ $failed -eq 0 ] && echo PASS || echo FAIL)"
  } >>"$summary"
  say "summary in $summary"
  cat "$summary"
  exit $failed
}

# shellcheck disable=SC2317  # called from the traps below
cut_off() {  # $1: the signal
  trap - TERM INT
  if [ -n "${run_pid:-}" ]; then kill -TERM "$run_pid" 2>/dev/null || true; fi
  {
    echo
    echo "total: $((SECONDS - start))s of ${budget_s}s budget"
    echo "result: CUT OFF during $step (SIG$1)"
  } >>"$summary"
  say "cut off during $step (SIG$1); summary in $summary"
  exit 1
}
trap 'cut_off TERM' TERM
trap 'cut_off INT' INT

{
  echo "flatparam GPU kit: $here"
  [ -f "$here/MANIFEST" ] && sed -n '/^files:/q; p' "$here/MANIFEST"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  echo "FLATPARAM_REQUIRE_GPU=${require_gpu:-<unset>}"
} >>"$summary"
echo >>"$summary"

# --- gpu: the driver and the card.
step=gpu
t0=$SECONDS
smi_ok=0
if command -v nvidia-smi >/dev/null 2>&1; then
  if timeout 60 nvidia-smi >>"$env_log" 2>&1 &&
    line=$(timeout 60 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>>"$env_log" | head -n 1) &&
    [ -n "$line" ]; then
    smi_ok=1
    card=${line%%,*}
    driver=${line#*, }
  fi
  why="nvidia-smi found no usable GPU (see env.txt)"
else
  why="no nvidia-smi on PATH: no GPU driver on this machine"
fi
if [ $smi_ok -eq 0 ]; then
  if [ "$require_gpu" = 1 ]; then
    record gpu FAIL $((SECONDS - t0)) "no GPU: $why; FLATPARAM_REQUIRE_GPU=1 makes that a failure"
  else
    record gpu SKIP $((SECONDS - t0)) "no GPU: $why; nothing else to run"
  fi
  finish
fi
record gpu PASS $((SECONDS - t0)) "$card, driver $driver"
fact card "$card"
fact driver "$driver"

# --- nccl: the machine's libnccl.so.2.
step=nccl
t0=$SECONDS
nccl_lib=""
nccl_from=""
nccl_wheel=""
# The folder holding libnccl.so.2 of an nvidia-nccl wheel under
# site-packages folder $1, and the wheel's name and version from its
# dist-info.
try_site_packages() {
  local sp=$1 info
  [ -e "$sp/nvidia/nccl/lib/libnccl.so.2" ] || return 1
  nccl_lib=$sp/nvidia/nccl/lib
  for info in "$sp"/nvidia_nccl_*.dist-info; do
    [ -d "$info" ] || continue
    info=$(basename "$info" .dist-info)
    nccl_wheel="${info%-*} ${info##*-}"
    nccl_wheel=${nccl_wheel//_/-}
  done
  return 0
}
if [ -n "${FLATPARAM_NCCL_LIB:-}" ]; then
  nccl_lib=$FLATPARAM_NCCL_LIB
  nccl_from="FLATPARAM_NCCL_LIB"
fi
if [ -z "$nccl_lib" ] && command -v python3 >/dev/null 2>&1; then
  for sp in $(python3 -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>>"$env_log" | sort -u); do
    if try_site_packages "$sp"; then
      nccl_from="python3 ($(command -v python3))"
      break
    fi
  done
fi
if [ -z "$nccl_lib" ]; then
  for sp in /opt/*/.venv/lib/python3*/site-packages /opt/*/venv/lib/python3*/site-packages \
    /opt/*/lib/python3*/site-packages /usr/local/lib/python3*/site-packages \
    /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages \
    "${HOME:-/root}"/.local/lib/python3*/site-packages; do
    if try_site_packages "$sp"; then
      nccl_from="$sp"
      break
    fi
  done
fi
if [ -z "$nccl_lib" ]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/libnccl.so.2" ]; then
      nccl_lib=$d
      nccl_from="$d"
      break
    fi
  done
fi
if [ -z "$nccl_lib" ] && command -v ldconfig >/dev/null 2>&1; then
  found=$(ldconfig -p 2>/dev/null | sed -n 's/^[[:space:]]*libnccl\.so\.2 .*=> //p' | head -n 1)
  if [ -n "$found" ]; then
    nccl_lib=$(dirname "$found")
    nccl_from="ldconfig -p"
  fi
fi
echo "libnccl.so.2 directory: ${nccl_lib:-<not found>} (from ${nccl_from:-nowhere}; wheel: ${nccl_wheel:-none})" >>"$env_log"
# lib/fallback/ holds what a Linux machine normally has itself, behind
# stable symbol versions (OpenSSL 3's libcrypto.so.3, which the bundled
# libzip needs). A copy on LD_LIBRARY_PATH would take the place of the
# machine's own in every process, LibTorch's included, and a LibTorch that
# links a newer OpenSSL would then fail to link (undefined OPENSSL_3.2.0
# symbols). So the machine's is used wherever it has one; only the ones it
# lacks are linked from a folder of links made here, last on the path.
machine_has_library() {
  local soname=$1 d ldconfig_cmd
  for d in ${FLATPARAM_SYSTEM_LIB_DIRS:-/lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/lib /lib}; do
    [ -e "$d/$soname" ] && return 0
  done
  ldconfig_cmd=$(command -v ldconfig || echo /sbin/ldconfig)
  [ -x "$ldconfig_cmd" ] &&
    "$ldconfig_cmd" -p 2>/dev/null | grep -qE "^[[:space:]]*${soname//./\\.} \(libc6,x86-64"
}
fallback_dir=""
for f in "$here"/lib/fallback/*; do
  [ -e "$f" ] || continue
  soname=${f##*/}
  if machine_has_library "$soname"; then
    echo "$soname: the machine's own (lib/fallback/ not used)" >>"$env_log"
    continue
  fi
  if [ -z "$fallback_dir" ]; then
    fallback_dir=$(mktemp -d "${TMPDIR:-/tmp}/flatparam-kit-lib.XXXXXX")
    trap 'rm -rf "$fallback_dir"' EXIT
  fi
  ln -s "$f" "$fallback_dir/$soname"
  echo "$soname: the kit's (lib/fallback/), which the machine lacks" >>"$env_log"
done
if [ -n "$fallback_dir" ]; then
  if [ -n "${LD_LIBRARY_PATH:-}" ]; then
    original_env=(env "LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$fallback_dir")
  else
    original_env=(env "LD_LIBRARY_PATH=$fallback_dir")
  fi
fi
cuda_lib=/usr/local/cuda/lib64
export LD_LIBRARY_PATH="$here/lib${nccl_lib:+:$nccl_lib}:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}${fallback_dir:+:$fallback_dir}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$env_log"
runtime_version=""
driver_version=""
if [ -z "$nccl_lib" ] || [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  record nccl FAIL $((SECONDS - t0)) "no libnccl.so.2 in FLATPARAM_NCCL_LIB, any Python's nvidia-nccl wheel, the CUDA or system library folders, or ldconfig -p (set FLATPARAM_NCCL_LIB=DIR)"
elif versions=$(timeout 60 "$here/bin/gpu_versions" 2>>"$env_log"); then
  echo "$versions" >>"$env_log"
  nccl_version=$(sed -n 's/^nccl: //p' <<<"$versions")
  runtime_version=$(sed -n 's/^cuda_runtime: //p' <<<"$versions")
  driver_version=$(sed -n 's/^cuda_driver: //p' <<<"$versions")
  cuda_versions="runtime $runtime_version, driver API $driver_version"
  record nccl PASS $((SECONDS - t0)) "NCCL $nccl_version from $nccl_lib (${nccl_wheel:-$nccl_from})"
  fact nccl "$nccl_version${nccl_wheel:+ (wheel $nccl_wheel)}"
  fact cuda "$cuda_versions"
else
  record nccl FAIL $((SECONDS - t0)) "bin/gpu_versions failed (see env.txt)"
fi
# Several ranks on one GPU: NCCL 2.30 and later allow it with
# NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental; 2 ranks per GPU in its default
# configuration); earlier releases fail "Duplicate GPU detected". With it,
# nccl_gpu's multi-rank tests (collectives, the timeout and abort path) run
# 2 ranks on a single GPU instead of skipping.
if [[ $nccl_version =~ ^([0-9]+)\.([0-9]+) ]] &&
  { [ "${BASH_REMATCH[1]}" -gt 2 ] || { [ "${BASH_REMATCH[1]}" -eq 2 ] && [ "${BASH_REMATCH[2]}" -ge 30 ]; }; }; then
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  fact ranks_per_gpu "up to 2 (NCCL $nccl_version, NCCL_MULTI_RANK_GPU_ENABLE=1)"
else
  fact ranks_per_gpu "1 (NCCL $nccl_version: several ranks on one GPU need NCCL 2.30; with one GPU the multi-rank tests skip)"
fi

# --- cuda: the driver must support the bundled CUDA runtime. A driver older
# than the runtime's major version cannot run it at all; within a major
# version, CUDA's minor version compatibility runs it (PTX of a newer minor
# version would not load).
step=cuda
t0=$SECONDS
if ! [[ $runtime_version =~ ^([0-9]+)\.([0-9]+) ]]; then
  record cuda FAIL 0 "no CUDA runtime version (bin/gpu_versions did not run or said '$runtime_version')"
else
  r_major=${BASH_REMATCH[1]}
  r_minor=${BASH_REMATCH[2]}
  if ! [[ $driver_version =~ ^([0-9]+)\.([0-9]+) ]]; then
    record cuda FAIL $((SECONDS - t0)) "the driver reports no CUDA version ($driver_version): the bundled CUDA $runtime_version runtime cannot run"
  elif [ "${BASH_REMATCH[1]}" -lt "$r_major" ]; then
    record cuda FAIL $((SECONDS - t0)) "the driver supports CUDA $driver_version, older than the bundled CUDA $runtime_version runtime: install a driver for CUDA $r_major"
  elif [ "${BASH_REMATCH[1]}" -eq "$r_major" ] && [ "${BASH_REMATCH[2]}" -lt "$r_minor" ]; then
    record cuda PASS $((SECONDS - t0)) "driver CUDA $driver_version runs the CUDA $runtime_version runtime by minor version compatibility"
  else
    record cuda PASS $((SECONDS - t0)) "driver CUDA $driver_version, runtime $runtime_version (bundled)"
  fi
fi

# --- bundle: every binary's libraries resolve, from lib/ unless the machine
# provides them (the C/C++ runtime, the driver's libcuda and NCCL; the CUDA
# runtime comes from lib/, the one the binaries were built against; those of
# lib/fallback/ from the machine, or from lib/fallback/ where it lacks them).
step=bundle
t0=$SECONDS
provided_re='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|ld-linux|libpthread|libdl|librt|libnccl|libcuda)\.so'
missing=""
for b in "$here"/bin/*; do
  echo "== ldd $(basename "$b")" >>"$env_log"
  if ! ldd_out=$(ldd "$b" 2>&1); then
    missing="$missing $(basename "$b")(ldd failed)"
  fi
  echo "$ldd_out" >>"$env_log"
  # "version `GLIBCXX_3.4.30' not found": this machine's C/C++ runtime is
  # older than the build machine's (MANIFEST says what the kit needs).
  if grep -q "version .* not found" <<<"$ldd_out"; then
    missing="$missing $(basename "$b"):$(grep -o "version [^ ]* not found" <<<"$ldd_out" | sort -u | tr '\n' ',')"
  fi
  while read -r soname arrow path _; do
    [ "$arrow" = "=>" ] || continue
    if [ "$path" = "not" ]; then
      missing="$missing $(basename "$b"):$soname(not found)"
    elif ! [[ $soname =~ $provided_re ]] && [[ $path != "$here/lib/"* ]] &&
      ! [ -e "$here/lib/fallback/$soname" ]; then
      missing="$missing $(basename "$b"):$soname(from $path, not lib/)"
    fi
  done <<<"$ldd_out"
done
if [ -n "$missing" ]; then
  record bundle FAIL $((SECONDS - t0)) "unresolved:$missing"
else
  record bundle PASS $((SECONDS - t0)) "$(find "$here/bin" -type f | wc -l) binaries"
fi

# --- the tests, each with FLATPARAM_REQUIRE_GPU=1.
export FLATPARAM_REQUIRE_GPU=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export CUDA_MODULE_LOADING=EAGER  # see the file comment
test_step() {  # $1: step, $2: cap, $3: binary in bin/
  have_budget "$1" || return 0
  if [ -x "$here/bin/$3" ]; then
    run_step "$1" "$2" "$tests_log" "$here/bin/$3" --gtest_brief=0
  else
    record "$1" FAIL 0 "bin/$3 is not in the bundle"
  fi
}
test_step smoke 60 cuda_smoke_test
test_step device_ops 120 cuda_device_test
test_step nccl_unit 60 nccl_communicator_test
test_step nccl_gpu 150 nccl_gpu_test
test_step training 150 training_nccl_test

# --- torch_build: flatparam/torch, the GPT and their tests, built with
# CMake against this machine's own LibTorch (torch_kit/build.sh), linked
# with lib/; then its tests: on the GPU (torch_cuda, torch_gpu) and on the
# CPU against this LibTorch (torch_cpu: bitwise against single-process
# LibTorch on simulated ranks).
torch_build_dir=$here/torch_kit/build
torch_built=0
torch_python=""  # the Python whose torch was built against
if have_budget torch_build; then
  step=torch_build
  t0=$SECONDS
  torch_cmake=""
  torch_info=""
  if [ -n "${FLATPARAM_TORCH_CMAKE:-}" ]; then
    torch_cmake=$FLATPARAM_TORCH_CMAKE
    torch_info="from FLATPARAM_TORCH_CMAKE=$torch_cmake"
  else
    # The first Python that imports torch: $FLATPARAM_TORCH_PYTHON, python3
    # on PATH, then the usual virtual environments.
    for py in "${FLATPARAM_TORCH_PYTHON:-}" "$(command -v python3 || true)" \
      /opt/*/.venv/bin/python3 /opt/*/venv/bin/python3 /opt/*/bin/python3 \
      /usr/local/bin/python3 /usr/bin/python3; do
      if [ -z "$py" ] || [ ! -x "$py" ]; then continue; fi
      if info=$(timeout 120 "${original_env[@]}" "$py" -c 'import torch, torch.utils; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(torch.version.cuda or "none")' 2>>"$env_log"); then
        torch_cmake=$(sed -n 1p <<<"$info")
        torch_info="PyTorch $(sed -n 2p <<<"$info") (CUDA $(sed -n 3p <<<"$info")) from $py"
        torch_python=$py
        break
      fi
    done
  fi
  echo "torch: ${torch_info:-<none>}" >>"$env_log"
  if [ -z "$torch_cmake" ]; then
    record torch_build FAIL $((SECONDS - t0)) "no Python here imports torch (python3 on PATH, /opt/*/.venv, /opt/*/venv, /usr/local/bin; or set FLATPARAM_TORCH_PYTHON, or FLATPARAM_TORCH_CMAKE to Torch's cmake folder)"
  elif [ -z "$nccl_lib" ]; then
    record torch_build FAIL $((SECONDS - t0)) "no libnccl.so.2 to link (see the nccl step)"
  else
    fact torch "$torch_info"
    if [ -d /usr/local/cuda/bin ]; then export PATH="$PATH:/usr/local/cuda/bin"; fi
    if run_timed torch_build 240 "$out/torch_build.log" "${original_env[@]}" "$here/torch_kit/build.sh" \
      --torch-cmake="$torch_cmake" --kit-lib="$here/lib" --nccl-lib="$nccl_lib" \
      --build="$torch_build_dir"; then
      record_run
      if [ "$run_rc" -eq 0 ]; then torch_built=1; fi
    fi
  fi
fi
torch_test_step() {  # $1: step, $2: cap, $3...: test binaries of the build
  local name=$1 cap=$2 missing="" t
  shift 2
  have_budget "$name" || return 0
  if [ $torch_built -eq 0 ]; then
    record "$name" SKIP 0 "torch_build did not pass"
    return 0
  fi
  for t in "$@"; do
    [ -x "$torch_build_dir/$t" ] || missing="$missing $t"
  done
  if [ -n "$missing" ]; then
    record "$name" FAIL 0 "not built:$missing (this LibTorch has no CUDA? see torch_build.log)"
    return 0
  fi
  local cmd=""
  for t in "$@"; do cmd="$cmd \"$torch_build_dir/$t\" --gtest_brief=0 &&"; done
  run_step "$name" "$cap" "$tests_log" "${original_env[@]}" bash -c "${cmd% &&}"
}
torch_test_step torch_cuda 60 torch_cuda_test
torch_test_step torch_gpu 150 fsdp_module_cuda_test
torch_test_step torch_cpu 120 recompute_test fsdp_module_test

# --- torch_bench: the GPT's step under flatparam's FsdpModule against plain
# LibTorch (torch_step_compare) and against PyTorch's own FSDP in Python
# (torch_kit/pytorch_fsdp_step.py, with the Python that had torch), on the
# same model and batch; the ratios go to the summary.
torch_bench_args=${FLATPARAM_TORCH_BENCH_ARGS:---layers=12 --width=768 --heads=12 --seq=512 --batch=8 --steps=20 --warmup=5}
torch_bench_device=${FLATPARAM_TORCH_BENCH_DEVICE:-cuda}
torch_bench_json=$out/torch_bench.log
if have_budget torch_bench; then
  if [ $torch_built -eq 0 ] || [ ! -x "$torch_build_dir/torch_step_compare" ]; then
    record torch_bench SKIP 0 "torch_build did not pass"
  else
    : >"$torch_bench_json"
    # shellcheck disable=SC2086  # the arguments are a list of flags
    if run_timed torch_bench 240 "$torch_bench_json" "${original_env[@]}" \
      "$torch_build_dir/torch_step_compare" --device="$torch_bench_device" $torch_bench_args; then
      ours=$(grep -o '"fsdp_ms_median": [0-9.e+-]*' "$torch_bench_json" | tail -n 1 | sed 's/.*: //')
      plain=$(grep -o '"plain_ms_median": [0-9.e+-]*' "$torch_bench_json" | tail -n 1 | sed 's/.*: //')
      vs_plain=$(grep -o '"fsdp_vs_plain": [0-9.e+-]*' "$torch_bench_json" | tail -n 1 | sed 's/.*: //')
      if [ "$run_rc" -ne 0 ] || [ -z "$ours" ]; then
        record_run
      elif [ -z "$torch_python" ]; then
        record torch_bench PASS "$run_s" "FsdpModule ${ours} ms, plain LibTorch ${plain} ms (x${vs_plain}); PyTorch FSDP not run: no Python with torch"
      else
        py_s=$SECONDS
        # shellcheck disable=SC2086
        py_limit=$(left)
        if [ "$py_limit" -gt 240 ]; then py_limit=240; fi
        if [ "$py_limit" -lt 10 ]; then py_limit=10; fi
        if timeout "$py_limit" "${original_env[@]}" "$torch_python" \
          "$here/torch_kit/pytorch_fsdp_step.py" $torch_bench_args >>"$torch_bench_json" 2>>"$tests_log"; then
          theirs=$(grep -o '"pytorch_fsdp_ms_median": [0-9.e+-]*' "$torch_bench_json" | tail -n 1 | sed 's/.*: //')
          ratio=$(awk -v a="$ours" -v b="$theirs" 'BEGIN { if (b > 0) printf "%.3f", a / b }')
          record torch_bench PASS $((run_s + SECONDS - py_s)) "FsdpModule ${ours} ms, plain LibTorch ${plain} ms (x${vs_plain}), PyTorch FSDP ${theirs} ms (FsdpModule / PyTorch FSDP = ${ratio})"
        else
          record torch_bench FAIL $((run_s + SECONDS - py_s)) "FsdpModule ${ours} ms, plain LibTorch ${plain} ms (x${vs_plain}); pytorch_fsdp_step.py failed (see tests.log)"
        fi
      fi
    fi
  fi
fi

# --- the benchmark.
if ! have_budget bench; then
  :
elif [ -x "$here/bin/gpu_bench" ]; then
  # shellcheck disable=SC2086  # FLATPARAM_BENCH_ARGS is a list of flags
  run_step bench 180 "$out/gpu_bench.log" "$here/bin/gpu_bench" \
    --benchmark_out="$out/gpu_bench.json" --benchmark_out_format=json \
    --benchmark_min_time=0.1 ${FLATPARAM_BENCH_ARGS:-}
else
  record bench FAIL 0 "bin/gpu_bench is not in the bundle"
fi

# --- compute-sanitizer over the CUDA DeviceOps and handle tests.
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
sanitize_step() {  # $1: step, $2: cap, $3...: compute-sanitizer options
  local name=$1 cap=$2 mark
  shift 2
  have_budget "$name" || return 0
  if [ -z "$sanitizer" ]; then
    record "$name" FAIL 0 "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
    return 0
  fi
  mark=$(wc -l <"$san_log")
  run_timed "$name" "$cap" "$san_log" "$sanitizer" "$@" \
    --report-api-errors no --error-exitcode 1 "$here/bin/cuda_device_test" ||
    return 0
  # Not a finding: this machine's sanitizer cannot instrument this device.
  if [ "$run_rc" -ne 0 ] &&
    tail -n +"$((mark + 1))" "$san_log" | grep -q "Device not supported"; then
    record "$name" SKIP "$run_s" "compute-sanitizer answers \"Device not supported\" on this machine (see sanitizer.log)"
  else
    record_run
  fi
}
sanitize_step memcheck 90 --tool memcheck --track-stream-ordered-races all
sanitize_step initcheck 90 --tool initcheck

finish
