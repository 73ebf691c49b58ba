#!/usr/bin/env bash
# Checks report.py's ratios on hand-made Google Benchmark JSON, and that
# run_benchmarks.sh --dry-run lists every benchmark run.
set -euo pipefail
report="$1"
runner="$2"
testdata="$(dirname "$3")"

out="$(python3 "${report}" "${testdata}")"
expect() {
  if ! grep -qF -- "$1" <<<"${out}"; then
    echo "report.py output lacks: $1" >&2
    echo "${out}" >&2
    exit 1
  fi
}
expect "| 1 MiB | 20 | 30 (1.50x) | - | - | - |"
expect "| all_gather | 1 KiB | 1 | 4 | 0.25 | 0 |"
expect "| reduce_grad | reduce_scatter | 4 | 1 MiB | 0.5 | 2 | 0.25 | 0 |"
expect "| unshard_reshard | all_gather | 4 | 1 MiB | 3 | 2 | 1.50 | 0 |"
expect "not run (no optim_state.json)"
expect "| mpi/step/gpt2/FULL_SHARD/ranks:2/kernel:sleep/overlap:1 | 2064 ms | 153 ms | 1967 ms | 56 ms | 1.05 |"
# Aggregates-only output: the medians are the rows.
expect "| checkpoint_load/ranks:4/saved:4/cache:cold/load | 256.0 MiB | 1.01 | 0.7 s | 1.14 |"

if python3 "${report}" /nonexistent-dir 2>/dev/null; then
  echo "report.py accepted a missing directory" >&2
  exit 1
fi

dry="$(bash "${runner}" --dry-run --out=/tmp/x)"
for run in flatparam_bench sim_bench "collectives_bench --backend=mpi" \
    "handle_bench --backend=sim" "handle_bench --backend=mpi" optim_state_bench \
    checkpoint_load_bench step_bench; do
  if ! grep -qF -- "${run}" <<<"${dry}"; then
    echo "run_benchmarks.sh --dry-run does not run ${run}:" >&2
    echo "${dry}" >&2
    exit 1
  fi
done
if bash "${runner}" --bogus 2>/dev/null; then
  echo "run_benchmarks.sh accepted --bogus" >&2
  exit 1
fi
echo PASS
