#!/usr/bin/env bash
# Runs README.md's ```sh examples in order, in a scratch directory, and fails
# naming the README line of each command that fails.
#
#   readme_sh_test.sh README.md readme_blocks.py FSDP MPIRUN_TEST_SH
#
# readme_blocks.py extracts the commands (lines continued with a backslash
# joined, comments left out) and applies the README's markers
# (`<!-- readme-test: skip: REASON -->` before a block, and the others
# readme_blocks.py lists); every command not run is printed with its reason.
# The rest run as written, in one bash shell (so a function the README
# defines, `fsdp() { bazel run //tools:fsdp -- "$@"; }`, stays defined for the
# blocks after it), in the scratch directory, with:
#   - `bazel run [-c opt] //tools:fsdp -- ARGS`: the built binary with ARGS
#     (run in the scratch directory, as `bazel run` runs it in the directory
#     it was started from); any other `bazel run` target fails, asking for a
#     marker;
#   - `bazel build ...`: nothing (the test depends on //tools:fsdp);
#   - `bazel-bin/tools/fsdp`: the built binary (a link in the scratch
#     directory);
#   - `tools/setup.sh`: nothing (it installs packages; CI runs it first);
#   - `mpirun [--allow-run-as-root] [--oversubscribe] [--bind-to none] -np N
#     BINARY ARGS`: comm/mpi/mpirun_test.sh BINARY ARGS with N ranks, which
#     runs the same mpirun command (those options, and TMPDIR and OpenMPI's
#     shared memory in the test's directory); other options fail, asking for
#     a marker or a mapping here. Without OpenMPI the command is skipped;
#   - `/tmp/` in a command: the scratch directory's tmp/ (printed), and
#     TMPDIR is that directory too.
# Everything runs in every configuration: about 45 s in each of the default,
# ASan and UBSan builds on a 2-core machine, the gpt2 checkpoint examples
# (four checkpoints of 1.5 GB) about half of it.
# The scratch directory (5.6 GB by then) is deleted at the end.
# shellcheck disable=SC2317  # functions the sourced plan calls
set -uo pipefail

if [[ $# -ne 4 ]]; then
  echo "usage: $0 README.md readme_blocks.py FSDP MPIRUN_TEST_SH" >&2
  exit 2
fi
absolute() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
readme=$(absolute "$1")
blocks_py=$(absolute "$2")
fsdp_bin=$(absolute "$3")
mpirun_test=$(absolute "$4")

scratch=${TEST_TMPDIR:-$(mktemp -d)}/readme
rm -rf "$scratch"
mkdir -p "$scratch/tmp" "$scratch/bazel-bin/tools" "$scratch/tools" || exit 1
trap 'rm -rf "$scratch"' EXIT
ln -s "$fsdp_bin" "$scratch/bazel-bin/tools/fsdp"
cat >"$scratch/tools/setup.sh" <<'EOF'
#!/bin/sh
echo "  (tools/setup.sh: not run here; it installs packages, and CI runs it first)"
EOF
chmod +x "$scratch/tools/setup.sh"
export TMPDIR="$scratch/tmp"
unset BUILD_WORKING_DIRECTORY BUILD_WORKSPACE_DIRECTORY

plan="$(dirname "$scratch")/readme_plan.sh"
python3 "$blocks_py" sh "$readme" >"$plan" || {
  echo "FAIL: readme_blocks.py could not read README.md (above)" >&2
  exit 1
}

ran=0
failed=()
skipped=()
current_line=0

# `bazel` as the README's commands use it.
bazel() {
  local verb=${1:-}
  shift || true
  case "$verb" in
    build)
      echo "  (bazel build: nothing to do; this test depends on //tools:fsdp)"
      return 0
      ;;
    run) ;;
    *)
      echo "README test: no stand-in for \`bazel $verb\`" \
        "(README.md:$current_line): add a marker or a mapping in" \
        "readme/readme_sh_test.sh" >&2
      return 127
      ;;
  esac
  while [[ $# -gt 0 && $1 == -* ]]; do
    case "$1" in
      -c | --compilation_mode | --config) shift 2 ;;
      *) shift ;;
    esac
  done
  local target=${1:-}
  shift || true
  [[ ${1:-} == -- ]] && shift
  if [[ $target != //tools:fsdp ]]; then
    echo "README test: no stand-in for \`bazel run $target\`" \
      "(README.md:$current_line): add a skip marker before its block, or a" \
      "mapping in readme/readme_sh_test.sh" >&2
    return 127
  fi
  "$fsdp_bin" "$@"
}

# `mpirun` as the README's commands use it: through mpirun_test.sh.
mpirun() {
  local ranks=
  while [[ $# -gt 0 && $1 == -* ]]; do
    case "$1" in
      --allow-run-as-root | --oversubscribe) shift ;;
      --bind-to)
        if [[ ${2:-} != none ]]; then
          echo "README test: mpirun --bind-to ${2:-}: only 'none'" \
            "(mpirun_test.sh's) is mapped" >&2
          return 127
        fi
        shift 2
        ;;
      -np | -n)
        ranks=${2:-}
        shift 2
        ;;
      *)
        echo "README test: mpirun option $1 (README.md:$current_line) is not" \
          "mapped to comm/mpi/mpirun_test.sh: add a marker or a mapping in" \
          "readme/readme_sh_test.sh" >&2
        return 127
        ;;
    esac
  done
  if [[ -z $ranks ]]; then
    echo "README test: mpirun without -np (README.md:$current_line)" >&2
    return 127
  fi
  if [[ ${README_TEST_MPI:-1} != 1 ]] || ! command -v mpirun >/dev/null; then
    echo "  SKIPPED: this build has no OpenMPI"
    skipped+=("README.md:$current_line: no OpenMPI in this build")
    return 0
  fi
  MPI_TEST_RANKS=$ranks "$mpirun_test" "$@"
}

readme_file() {
  printf '%s' "$2" >"$scratch/$1"
  echo "README test: wrote $1 from its block in README.md"
}

readme_skip() {
  echo
  echo "README.md:$1: \$ $2"
  echo "  SKIPPED: $3"
  skipped+=("README.md:$1: $3")
}

readme_run() {
  local line=$1 command=$2 want=$3
  local run=${command//\/tmp\//$scratch/tmp/}
  echo
  echo "README.md:$line: \$ $command"
  [[ $run != "$command" ]] && echo "  as: $run"
  current_line=$line
  local start=$SECONDS status=0
  cd "$scratch" || exit 1
  eval "$run" </dev/null
  status=$?
  cd "$scratch" || exit 1
  echo "  -> exit $status ($((SECONDS - start)) s)"
  ran=$((ran + 1))
  if [[ $status -ne $want ]]; then
    local why="exited $status"
    [[ $want -ne 0 ]] && why+=", want $want (the README says it fails)"
    echo "FAIL: README.md:$line: $why: $command" >&2
    failed+=("README.md:$line: $why: $command")
  fi
}

# The files first (an example may read a file shown after it), then the
# commands in order.
(
  readme_run() { :; }
  readme_skip() { :; }
  # shellcheck disable=SC1090
  source "$plan"
) || exit 1
readme_file() { :; }
# shellcheck disable=SC1090
source "$plan"

echo
echo "README test: $ran commands run, ${#skipped[@]} not run," \
  "${#failed[@]} failed; scratch used $(du -sh "$scratch" | cut -f1)"
for s in "${skipped[@]}"; do echo "  not run: $s"; done
if [[ ${#failed[@]} -ne 0 ]]; then
  for f in "${failed[@]}"; do echo "FAIL: $f" >&2; done
  exit 1
fi
echo "PASS"
