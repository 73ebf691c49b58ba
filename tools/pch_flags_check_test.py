#!/usr/bin/env python3
"""Tests of tools/pch_flags_check.py: which flags it compares, which
differences it reports, and its verdict on Bazel's output."""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "pch_flags_check", os.path.join(HERE, "pch_flags_check.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

CONFIG = "k8-fastbuild-sanitize"
COMMON = ["-fPIC", "-fsanitize=address,undefined", "-O1", "-std=c++17", "-O0"]


def header(name="pch.h", flags=COMMON, macros=(), config=CONFIG):
  """The command that precompiles NAME (its generated source NAME.cc)."""
  return (["/usr/bin/gcc", "-x", "c++-header"] + list(macros) + list(flags) +
          ["-Wall", "-iquote", ".", "-frandom-seed=x", "-MD", "-MF", "x.d",
           "-c", "bazel-out/%s/bin/p/pch/%s.cc" % (config, name[:-2]),
           "-o", "bazel-out/%s/bin/p/_objs/pch/%s.pic.o" % (config, name[:-2])])


def source(path="p/a_test.cc", flags=COMMON, macros=(), config=CONFIG,
           include="pch.h"):
  return (["/usr/bin/gcc"] + list(macros) + list(flags) +
          ["-Wextra", "-Werror", "-isystem", "/usr/include/torch",
           "-Ibazel-out/x", "-include", include, "-Winvalid-pch",
           "-frandom-seed=y", "-c", path,
           "-o", "bazel-out/%s/bin/p/_objs/a/a.pic.o" % config])


class SplitFlagsTest(unittest.TestCase):

  def test_keeps_code_flags_and_macros_only(self):
    flags, macros = check.split_flags(
        source(macros=["-DA=1", "-U_FORTIFY_SOURCE"]))
    self.assertEqual(flags, COMMON)
    self.assertEqual(macros, ["-DA=1", "-U_FORTIFY_SOURCE"])


class CheckActionsTest(unittest.TestCase):

  def test_same_flags_pass(self):
    checked, problems = check.check_actions([header(), source()])
    self.assertEqual((checked, problems), (1, []))

  def test_a_sanitizer_flag_more_is_reported(self):
    checked, problems = check.check_actions(
        [header(), source(flags=COMMON + ["-fno-sanitize=undefined"])])
    self.assertEqual(checked, 1)
    self.assertEqual(len(problems), 1)
    self.assertIn("p/a_test.cc", problems[0])
    self.assertIn("only the source has [-fno-sanitize=undefined]",
                  problems[0])

  def test_an_optimization_level_less_is_reported(self):
    _, problems = check.check_actions(
        [header(), source(flags=COMMON[:-1])])
    self.assertEqual(len(problems), 1)
    self.assertIn("only the header [-O0]", problems[0])

  def test_order_matters(self):
    _, problems = check.check_actions(
        [header(), source(flags=["-O0"] + COMMON[:-1])])
    self.assertEqual(len(problems), 1)

  def test_macros_of_the_header_must_be_the_sources(self):
    _, problems = check.check_actions(
        [header(macros=["-DUSE_C10D_GLOO"]), source(macros=["-DOTHER"])])
    self.assertEqual(len(problems), 1)
    self.assertIn("precompiled with -DUSE_C10D_GLOO", problems[0])
    _, problems = check.check_actions(
        [header(macros=["-DA"]), source(macros=["-DA", "-DMORE"])])
    self.assertEqual(problems, [])

  def test_headers_are_matched_by_name_and_configuration(self):
    actions = [
        header("pch.h", flags=["-O0"]),
        header("pch_test.h", flags=COMMON),
        header("pch.h", flags=COMMON, config="k8-opt"),
        source(include="pch_test.h"),
        source(config="k8-opt"),
        source(include="unrelated.h", flags=["-O3"]),
    ]
    self.assertEqual(check.check_actions(actions), (2, []))


class MainTest(unittest.TestCase):

  def run_main(self, returncode, actions):
    output = json.dumps({"actions": [{"arguments": a} for a in actions]})
    result = subprocess.CompletedProcess([], returncode, output, "boom")
    printed = io.StringIO()
    with mock.patch.object(check.subprocess, "run",
                           return_value=result) as run, \
        contextlib.redirect_stdout(printed), \
        contextlib.redirect_stderr(io.StringIO()):
      status = check.main(["--config=sanitize"])
    self.assertIn("--config=sanitize", run.call_args[0][0])
    return status, printed.getvalue()

  def test_verdicts(self):
    self.assertEqual(self.run_main(0, [header(), source()])[0], 0)
    status, printed = self.run_main(
        0, [header(), source(flags=COMMON[:-1])])
    self.assertEqual(status, 1)
    self.assertIn("1 problems", printed)
    status, printed = self.run_main(0, [source()])
    self.assertEqual(status, 1)
    self.assertIn("no source uses a precompiled header", printed)
    self.assertEqual(self.run_main(1, [])[0], 2)


if __name__ == "__main__":
  unittest.main()
