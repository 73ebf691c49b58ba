#!/usr/bin/env bash
# Runs flatparam's GPU checks from a folder made by tools/gpu/bundle.sh, on a
# machine with a GPU but without Bazel or flatparam's build dependencies:
#
#   ./run.sh [--budget-s=SECONDS] [--out=DIR]
#
# Steps, in order (each one PASS, FAIL or SKIP, with its time):
#   gpu        nvidia-smi sees a GPU and a driver (card name, driver version)
#   nccl       the machine's libnccl.so.2 (Python's nvidia-nccl package, or
#              $FLATPARAM_NCCL_LIB) and its version, via bin/gpu_versions
#   bundle     every binary resolves all its libraries (ldd)
#   smoke, device_ops, nccl_unit, nccl_gpu, training
#              the GPU tests, with FLATPARAM_REQUIRE_GPU=1 (a missing GPU
#              fails instead of skipping)
#   memcheck, racecheck, synccheck
#              compute-sanitizer over the CUDA DeviceOps and handle tests
#   bench      bin/gpu_bench (Google Benchmark JSON); more flags for it in
#              $FLATPARAM_BENCH_ARGS (e.g. --max_bytes=16777216)
#
# Without a GPU (the `gpu` step): a SKIP and exit 0, or with
# FLATPARAM_REQUIRE_GPU=1 in the environment a FAIL and exit 1.
#
# Time: before each step the remaining budget (--budget-s, default 480) is
# checked; each step runs under `timeout` with at most its own cap and what is
# left; once the budget is spent the remaining steps are SKIPped with a note.
#
# Output, under --out (default $OUT, else ./out; at most 8 files):
#   summary.txt     one line per step, the card, driver and NCCL version
#   env.txt         nvidia-smi, the NCCL search, ldd of every binary
#   tests.log       the GPU tests' output
#   sanitizer.log   compute-sanitizer's output
#   gpu_bench.json  Google Benchmark's JSON
#   gpu_bench.log   the benchmark's console output
#
# Exit status: 0 when no step failed, 1 otherwise, 2 for bad arguments.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
budget_s=480
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
  local name=$1 cap=$2 log=$3
  shift 3
  local remaining t0 rc limit
  have_budget "$name" || return 0
  remaining=$(left)
  limit=$((cap < remaining ? cap : remaining))
  echo "===== $name: $* (limit ${limit}s)" >>"$log"
  t0=$SECONDS
  set +e
  timeout --kill-after=5 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  set -e
  echo "===== $name: exit $rc after $((SECONDS - t0))s" >>"$log"
  if [ $rc -eq 0 ]; then
    record "$name" PASS $((SECONDS - t0)) ""
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    record "$name" FAIL $((SECONDS - t0)) "timed out after ${limit}s (see $(basename "$log"))"
  else
    record "$name" FAIL $((SECONDS - t0)) "exit $rc (see $(basename "$log"))"
  fi
}

finish() {
  {
    echo
    echo "card: $card"
    echo "driver: $driver"
    echo "nccl: $nccl_version"
    echo "cuda: $cuda_versions"
    echo "total: $((SECONDS - start))s of ${budget_s}s budget"
    echo "result: $([ $failed -eq 0 ] && echo PASS || echo FAIL)"
  } >>"$summary"
  say "summary in $summary"
  cat "$summary"
  exit $failed
}

{
  echo "flatparam GPU kit: $here"
  [ -f "$here/MANIFEST" ] && sed -n '/^files:/q; p' "$here/MANIFEST"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  echo "FLATPARAM_REQUIRE_GPU=${require_gpu:-<unset>}"
} >>"$summary"
echo >>"$summary"

# --- gpu: the driver and the card.
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

# --- nccl: the machine's libnccl.so.2.
t0=$SECONDS
nccl_lib=${FLATPARAM_NCCL_LIB:-}
if [ -z "$nccl_lib" ] && command -v python3 >/dev/null 2>&1; then
  nccl_lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>>"$env_log" || true)
  python3 -c 'import importlib.metadata as m; print("pip nvidia-nccl-cu13:", m.version("nvidia-nccl-cu13"))' >>"$env_log" 2>&1 || true
fi
if [ -z "$nccl_lib" ] || [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    if [ -e "$d/libnccl.so.2" ]; then
      nccl_lib=$d
      break
    fi
  done
fi
echo "libnccl.so.2 directory: ${nccl_lib:-<not found>}" >>"$env_log"
cuda_lib=/usr/local/cuda/lib64
export LD_LIBRARY_PATH="$here/lib${nccl_lib:+:$nccl_lib}:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$env_log"
if [ -z "$nccl_lib" ] || [ ! -e "$nccl_lib/libnccl.so.2" ]; then
  record nccl FAIL $((SECONDS - t0)) "no libnccl.so.2 (python3 -c 'import nvidia.nccl' failed; set FLATPARAM_NCCL_LIB=DIR)"
elif versions=$(timeout 60 "$here/bin/gpu_versions" 2>>"$env_log"); then
  echo "$versions" >>"$env_log"
  nccl_version=$(sed -n 's/^nccl: //p' <<<"$versions")
  cuda_versions="runtime $(sed -n 's/^cuda_runtime: //p' <<<"$versions"), driver API $(sed -n 's/^cuda_driver: //p' <<<"$versions")"
  record nccl PASS $((SECONDS - t0)) "NCCL $nccl_version from $nccl_lib"
else
  record nccl FAIL $((SECONDS - t0)) "bin/gpu_versions failed (see env.txt)"
fi

# --- bundle: every binary's libraries resolve, from lib/ unless the machine
# provides them (the C/C++ runtime, CUDA's and NCCL's own).
t0=$SECONDS
provided_re='^(linux-vdso|libc|libm|libstdc\+\+|libgcc_s|ld-linux-x86-64|ld-linux|libpthread|libdl|librt|libcudart|libnccl|libcuda)\.so'
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
    elif ! [[ $soname =~ $provided_re ]] && [[ $path != "$here/lib/"* ]]; then
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

# --- compute-sanitizer over the CUDA DeviceOps and handle tests.
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
for tool in memcheck racecheck synccheck; do
  have_budget "$tool" || continue
  if [ -z "$sanitizer" ]; then
    record "$tool" FAIL 0 "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
    continue
  fi
  run_step "$tool" "$([ "$tool" = synccheck ] && echo 60 || echo 90)" \
    "$san_log" "$sanitizer" --tool "$tool" \
    --error-exitcode 1 "$here/bin/cuda_device_test"
done

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

finish
