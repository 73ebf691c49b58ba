# shellcheck shell=bash
# Helpers for the shell tests of the `fsdp` binary, sourced (not run):
#
#   source "$1"  # the test's first argument: $(location //tools/testing:cli_test_lib.sh)
#   cli_test_init "$2"
#   expect_exit 0 plan --model=gpt2
#   grep -q 'FULL_SHARD' "$tmp/out" || fail "table lacks FULL_SHARD"
#   cli_test_finish
#
# A test records every failed check (fail) and keeps going, so that one run
# lists them all; cli_test_finish turns the count into the exit status.
# Tests run with `set -uo pipefail` (not -e: a check's failing grep must not
# end the test).

# cli_test_init PATH_TO_FSDP: sets $fsdp, $tmp (the test's scratch directory:
# $TEST_TMPDIR under `bazel test`, a new one when run by hand) and the
# failure count.
cli_test_init() {
  fsdp=$1
  tmp=${TEST_TMPDIR:-$(mktemp -d)}
  failures=0
}

# fail MESSAGE...: records a failed check.
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# expect_exit CODE ARGS...: runs fsdp with ARGS, checks the exit code, and
# leaves stdout/stderr in $tmp/out and $tmp/err. With CLI_TEST_TIMEOUT_S set,
# a run that takes longer (times FLATPARAM_TEST_TIME_SCALE, which the
# sanitizer configs set) is killed (and exits 124).
expect_exit() {
  local want=$1
  shift
  if [ -n "${CLI_TEST_TIMEOUT_S:-}" ]; then
    timeout $((CLI_TEST_TIMEOUT_S * ${FLATPARAM_TEST_TIME_SCALE:-1})) \
      "$fsdp" "$@" >"$tmp/out" 2>"$tmp/err"
  else
    "$fsdp" "$@" >"$tmp/out" 2>"$tmp/err"
  fi
  local got=$?
  if [ "$got" -ne "$want" ]; then
    fail "fsdp $* exited $got, want $want; stderr: $(head -c 800 "$tmp/err")"
  fi
}

# mpi_rank_pid RANK PATTERN: the pid of rank RANK (OMPI_COMM_WORLD_RANK) of
# the running mpirun job whose command line contains PATTERN; fails if none.
mpi_rank_pid() {
  local pid
  for pid in $(pgrep -f -- "$2"); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null |
      grep -qx "OMPI_COMM_WORLD_RANK=$1"; then
      echo "$pid"
      return 0
    fi
  done
  return 1
}

# cli_test_finish: exits 1 if any check failed, else prints PASS.
cli_test_finish() {
  if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) failed" >&2
    exit 1
  fi
  echo "PASS"
}
