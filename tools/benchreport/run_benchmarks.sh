#!/usr/bin/env bash
# Reruns every flatparam benchmark and prints BENCHMARKS.md-style tables of
# ratios against each benchmark's baseline measured in the same run.
#
#   tools/benchreport/run_benchmarks.sh [--out=DIR] [--quick] [--only=NAME,...]
#                                       [--dry-run]
#
# Builds //benchmarks:* with -c opt, runs each binary with
# --benchmark_out=DIR/<name>.json (MPI benchmarks under mpirun, 4 ranks;
# NCCL ones only where `nvidia-smi -L` lists a GPU), then runs report.py on
# DIR. --quick shortens every run (--benchmark_min_time=0.01, smaller
# optimizer-state model and checkpoint, one repetition): for checking the
# script, not for figures. --only limits the runs to the named benchmarks
# (flatparam, sim, collectives_mpi, handle_sim, handle_mpi, optim_state,
# checkpoint_load, step, collectives_nccl); step_bench runs on 2 ranks. Not run here: checkpoint_save_bench
# (one process, no baseline to take a ratio to) and the W = 1..8 sweep of
# checkpoint_load (benchmarks/checkpoint_load_sweep.sh); see BENCHMARKS.md.
# --dry-run prints the commands without building or running anything.
#
# Exit status: non-zero if a build or any benchmark run fails (the report of
# the runs that finished is still printed).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out=""
quick=0
dry_run=0
only=""
for arg in "$@"; do
  case "${arg}" in
    --out=*) out="${arg#--out=}" ;;
    --quick) quick=1 ;;
    --dry-run) dry_run=1 ;;
    --only=*) only="${arg#--only=}" ;;
    -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run_benchmarks.sh: unknown argument ${arg} (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "${out}" ]]; then
  out="${root}/bench-results/$(date -u +%Y%m%dT%H%M%SZ)"
fi

min_time=()
optim_args=()
load_args=()
step_args=(--benchmark_repetitions=3)
if (( quick )); then
  min_time=(--benchmark_min_time=0.01)
  optim_args=(--state_mib=16)
  load_args=(--total_mib=64 --reps=1)
  step_args=(--model=gpt2 --tokens=8 --gflops=100000)
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun=(mpirun --oversubscribe --bind-to none -np 4)
mpirun2=(mpirun --oversubscribe --bind-to none -np 2)
# Where the binaries are. After the build it is asked of bazel: the
# bazel-bin symlink follows the workspace's last build, which need not be
# -c opt (another build may have run since).
bin="${root}/bazel-bin/benchmarks"

have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  have_gpu=1
fi

# name | command (words after the binary path are arguments)
runs=(
  "flatparam|${bin}/flatparam_bench ${min_time[*]:---benchmark_min_time=0.3}"
  "sim|${bin}/sim_bench ${min_time[*]:-}"
  "collectives_mpi|${mpirun[*]} ${bin}/collectives_bench --backend=mpi ${min_time[*]:---benchmark_min_time=0.05}"
  "handle_sim|${bin}/handle_bench --backend=sim ${min_time[*]:---benchmark_min_time=0.5}"
  "handle_mpi|${mpirun[*]} ${bin}/handle_bench --backend=mpi ${min_time[*]:---benchmark_min_time=0.5}"
  "optim_state|${bin}/optim_state_bench ${optim_args[*]:-} ${min_time[*]:-}"
  "checkpoint_load|${mpirun[*]} ${bin}/checkpoint_load_bench ${load_args[*]:-}"
  "step|${mpirun2[*]} ${bin}/step_bench ${step_args[*]:-}"
)
if (( have_gpu )); then
  gpus="$(nvidia-smi -L | grep -c '^GPU')"
  runs+=("collectives_nccl|mpirun --oversubscribe --bind-to none -np ${gpus} ${bin}/collectives_bench --backend=nccl ${min_time[*]:-}")
fi

selected() {
  [[ -z "${only}" ]] && return 0
  [[ ",${only}," == *",$1,"* ]]
}

if (( dry_run )); then
  echo "bazel build -c opt //benchmarks:all"
  for run in "${runs[@]}"; do
    name="${run%%|*}"
    selected "${name}" || continue
    echo "${run#*|} --benchmark_out=${out}/${name}.json --benchmark_out_format=json"
  done
  echo "python3 ${root}/tools/benchreport/report.py ${out}"
  exit 0
fi

mkdir -p "${out}"
cd "${root}"
echo "== building benchmarks (-c opt)" >&2
bazel build -c opt //benchmarks:all >&2
opt_bin="$(bazel info -c opt bazel-bin)/benchmarks"

failed=0
for run in "${runs[@]}"; do
  name="${run%%|*}"
  selected "${name}" || continue
  cmd="${run#*|}"
  cmd="${cmd//${bin}\//${opt_bin}/}"
  echo "== ${name}: ${cmd}" >&2
  # shellcheck disable=SC2086  # the command is a word list on purpose
  if ! ${cmd} --benchmark_color=false --benchmark_out="${out}/${name}.json" \
      --benchmark_out_format=json >"${out}/${name}.log" 2>&1; then
    echo "   FAILED; last lines of ${out}/${name}.log:" >&2
    tail -n 20 "${out}/${name}.log" >&2
    failed=1
  fi
done

python3 "${root}/tools/benchreport/report.py" "${out}"
echo "raw results: ${out}" >&2
exit "${failed}"
