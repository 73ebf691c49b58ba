#!/usr/bin/env bash
# Peak host memory per rank while FsdpModule::Wrap initialises a model ten
# times one rank's shard (fsdp_module_init_memory_main.cc), on 10 MPI
# ranks: eager initialisation (the whole model on every rank), deferred
# (param_init_fn, unit by unit) and rank 0 alone (param_init_fn on rank 0,
# sync_module_states). The binary checks each rank's bound; this prints
# every rank's figure and fails if any rank fails.
#
#   fsdp_module_init_memory_test.sh MPIRUN_TEST_SH BINARY
set -euo pipefail

mpirun_test=$1
binary=$2
export MPI_TEST_RANKS=10
for init in eager deferred rank0; do
  out=$("$mpirun_test" "$binary" --init="$init" 2>&1) || {
    echo "FAIL: --init=$init:"
    echo "$out"
    exit 1
  }
  grep "^init_memory:" <<<"$out" | sort -t' ' -k3,3n
  n=$(grep -c "^init_memory: rank .* init=$init" <<<"$out" || true)
  if [ "$n" != 10 ]; then
    echo "FAIL: --init=$init: $n of 10 ranks reported"
    echo "$out"
    exit 1
  fi
done
echo PASS
