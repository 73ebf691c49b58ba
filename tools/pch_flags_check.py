#!/usr/bin/env python3
"""Checks that every source compiled with a precompiled header is compiled
with the flags the header was precompiled with.

GCC takes a precompiled header (`-include NAME` finding `NAME.gch`) without
a word when some flags differ: the sanitizers, for one. GCC 12 accepts a
header precompiled with -fsanitize=address,undefined in a file compiled
with -fno-sanitize=undefined, whose inline functions from LibTorch then
carry the checks the file asked not to have (or, the other way round, lack
the ones it asked for). tools/bazel/defs.bzl chooses each target's header by
the kind of its sources; this check proves the choice from the compile
commands Bazel will run (`bazel aquery`), for one configuration:

  python3 tools/pch_flags_check.py [BAZEL FLAGS...]   # e.g. --config=sanitize

For each compile action that passes `-include NAME` where NAME is a header
some action precompiles (`-x c++-header`) in the same configuration, the
flags that change the code (all but warnings, include folders, file names
and -frandom-seed) must be the same in the same order, and each -D/-U of the
header's must be among the file's. Exit status 0 when all agree and at least
one source uses a precompiled header, 1 otherwise, 2 when Bazel fails.
"""

import json
import subprocess
import sys

# Flags followed by a value that names a file or folder.
_PATH_PAIRS = {"-MF", "-o", "-c", "-x", "-include", "-iquote", "-isystem", "-I"}


def split_flags(arguments):
  """(flags that change the code, -D/-U macros) of a compile command."""
  flags, macros = [], []
  args = iter(arguments[1:])
  for arg in args:
    if arg in _PATH_PAIRS:
      next(args, None)
    elif arg == "-MD" or arg.startswith("-frandom-seed="):
      pass
    elif arg.startswith(("-W", "-I", "-isystem", "-iquote")):
      pass  # warnings (-Winvalid-pch, -Werror, -Wno-...) and joined paths
    elif arg.startswith(("-D", "-U")):
      macros.append(arg)
    else:
      flags.append(arg)
  return flags, macros


def _value_after(arguments, flag):
  for i, arg in enumerate(arguments[:-1]):
    if arg == flag:
      return arguments[i + 1]
  return None


def _configuration(arguments):
  """The output folder's configuration (bazel-out/CONFIG/...)."""
  out = _value_after(arguments, "-o") or ""
  parts = out.split("/")
  return parts[1] if len(parts) > 2 and parts[0] == "bazel-out" else ""


def check_actions(actions):
  """Returns (number of sources checked, list of problems)."""
  headers = {}  # (configuration, include name) -> arguments
  for arguments in actions:
    if _value_after(arguments, "-x") == "c++-header":
      source = _value_after(arguments, "-c") or ""
      name = source.rsplit("/", 1)[-1]
      if name.endswith(".cc"):
        name = name[:-len(".cc")] + ".h"
      headers[(_configuration(arguments), name)] = arguments
  checked, problems = 0, []
  for arguments in actions:
    if _value_after(arguments, "-x") == "c++-header":
      continue
    for i, arg in enumerate(arguments[:-1]):
      if arg != "-include":
        continue
      key = (_configuration(arguments), arguments[i + 1])
      if key not in headers:
        continue
      checked += 1
      source = _value_after(arguments, "-c")
      flags, macros = split_flags(arguments)
      header_flags, header_macros = split_flags(headers[key])
      if flags != header_flags:
        only_source = [f for f in flags if f not in header_flags]
        only_header = [f for f in header_flags if f not in flags]
        problems.append(
            "%s (%s): flags differ from %s's: only the source has [%s], only "
            "the header [%s] (in order, the source: %s; the header: %s)" %
            (source, key[0], key[1], " ".join(only_source),
             " ".join(only_header), " ".join(flags), " ".join(header_flags)))
      missing = [m for m in header_macros if m not in macros]
      if missing:
        problems.append("%s (%s): %s was precompiled with %s, which the "
                        "source lacks" % (source, key[0], key[1],
                                          " ".join(missing)))
  return checked, problems


def main(bazel_flags):
  command = ["bazel", "aquery"] + bazel_flags + [
      "mnemonic(CppCompile, //...)", "--output=jsonproto"
  ]
  result = subprocess.run(command, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, check=False)
  if result.returncode != 0:
    sys.stderr.write(result.stderr[-4000:])
    print("pch_flags_check: %s failed (exit %d)" %
          (" ".join(command), result.returncode))
    return 2
  actions = [a.get("arguments", []) for a in
             json.loads(result.stdout or "{}").get("actions", [])]
  checked, problems = check_actions(actions)
  for problem in problems:
    print("pch_flags_check: " + problem)
  config = " ".join(bazel_flags) or "the default configuration"
  if checked == 0:
    print("pch_flags_check: no source uses a precompiled header in %s (is "
          "--//tools/bazel:precompiled_headers on?)" % config)
    return 1
  print("pch_flags_check: %d sources with a precompiled header in %s, %d "
        "problems" % (checked, config, len(problems)))
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
