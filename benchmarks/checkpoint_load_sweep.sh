#!/usr/bin/env bash
# Runs checkpoint_load_bench under mpirun for W = 1..N ranks and prints one
# Markdown table of the medians (bytes read per rank, load time against a
# plain parallel read of the same bytes), as BENCHMARKS.md shows it.
#
#   benchmarks/checkpoint_load_sweep.sh [--ranks=1-8|4,8|3] [--out=DIR]
#                                       [--no-build] [-- BENCH_FLAGS...]
#
# Builds //benchmarks:checkpoint_load_bench with -c opt (unless --no-build),
# then for each W runs
#   mpirun --allow-run-as-root --oversubscribe --bind-to none -np W
#       $(bazel info -c opt bazel-bin)/benchmarks/checkpoint_load_bench
#       BENCH_FLAGS --benchmark_out=DIR/w<W>.json
# (a copy of it in DIR), keeping each run's log and Google Benchmark JSON
# in DIR (default bench-results/checkpoint_load-<UTC time>). BENCH_FLAGS go
# to the benchmark
# (--total_mib=N, --mode=load|verify_then_read|both, --cache=cold|warm|both,
# --saved_world_size=W0 to load a checkpoint saved on W0 ranks, resharding
# it, --reps=N, --dir=PATH; see the top of checkpoint_load_bench.cc). The
# ranks run one job at a time, so their /tmp and shared-memory files cannot
# collide.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ranks=(1 2 3 4 5 6 7 8)
out=""
build=1
bench_flags=()
while (($#)); do
  case "$1" in
    --ranks=*-*)
      range="${1#--ranks=}"
      ranks=()
      for ((w = ${range%-*}; w <= ${range#*-}; ++w)); do ranks+=("${w}"); done
      ;;
    --ranks=*) IFS=, read -r -a ranks <<<"${1#--ranks=}" ;;
    --out=*) out="${1#--out=}" ;;
    --no-build) build=0 ;;
    --)
      shift
      bench_flags=("$@")
      break
      ;;
    -h | --help)
      sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "checkpoint_load_sweep.sh: unknown argument $1 (see --help)" >&2
      exit 2
      ;;
  esac
  shift
done
if [[ -z "${out}" ]]; then
  out="${root}/bench-results/checkpoint_load-$(date -u +%Y%m%dT%H%M%SZ)"
fi
mkdir -p "${out}"

cd "${root}"
if ((build)); then
  bazel build -c opt //benchmarks:checkpoint_load_bench
fi
# Not the bazel-bin symlink: it follows the last build's configuration,
# which need not be -c opt. Copied, so that a rebuild during the sweep
# cannot change the binary between W, and the results keep the binary that
# made them.
bin="${out}/checkpoint_load_bench"
cp "$(bazel info -c opt bazel-bin 2>/dev/null)/benchmarks/checkpoint_load_bench" \
  "${bin}"

for w in "${ranks[@]}"; do
  echo "== W=${w}" >&2
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "${w}" \
    "${bin}" "${bench_flags[@]}" --benchmark_out="${out}/w${w}.json" \
    --benchmark_out_format=json 2>&1 | tee "${out}/w${w}.log" >&2
done

echo
echo "Checkpoint load, medians; times are the slowest rank's (logs and JSON in ${out}):"
grep -h -m2 -e '^| W |' -e '^| --- |' "${out}/w${ranks[0]}.log"
for w in "${ranks[@]}"; do
  grep -h '^| [0-9]' "${out}/w${w}.log"
done
