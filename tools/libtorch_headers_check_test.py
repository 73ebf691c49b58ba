#!/usr/bin/env python3
"""Tests of tools/libtorch_headers_check.py's parts: which sources it
compiles, which headers it refuses, which standard it picks, and its cache
(a file is compiled again when it or a header it read changes)."""

import importlib.util
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "libtorch_headers_check", os.path.join(HERE, "libtorch_headers_check.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


class SourcesTest(unittest.TestCase):

  def test_through_our_headers_and_only_the_library(self):
    text = {
        "a/glue.h": "#include <torch/types.h>\n",
        "a/user.h": '#include "a/glue.h"\n',
        "a/user.cc": '#include "a/user.h"\n',
        "a/direct.cc": "#include <ATen/ATen.h>\n",
        "a/plain.cc": '#include "a/plain.h"\n#include <vector>\n',
        "a/plain.h": "",
        "a/user_test.cc": '#include "a/user.h"\n',
        "testing/util.cc": '#include "a/glue.h"\n',
    }
    self.assertEqual(
        check.sources_using_libtorch(text, "library"),
        ["a/direct.cc", "a/user.cc"])
    self.assertEqual(
        check.sources_using_libtorch(text, "all"),
        ["a/direct.cc", "a/user.cc", "a/user_test.cc", "testing/util.cc"])


class ForeignHeadersTest(unittest.TestCase):

  def test_only_libtorch_headers_from_elsewhere(self):
    include = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, include)
    deps = [
        os.path.join(include, "torch", "types.h"),
        "/usr/include/absl/status/status.h",
        "/usr/include/torch/csrc/api/include/torch/nn/module.h",
        "/usr/include/c10/core/Device.h",
        "flatparam/torch/fsdp_module.h",
    ]
    self.assertEqual(
        check.foreign_libtorch_headers(deps, include), [
            "/usr/include/torch/csrc/api/include/torch/nn/module.h",
            "/usr/include/c10/core/Device.h"
        ])


class StandardTest(unittest.TestCase):

  def test_cxx20_only_where_aten_requires_it(self):
    self.assertEqual(
        check.needed_standard(
            "#if !defined(_MSC_VER) && __cplusplus < 202002L\n#error x\n"),
        "20")
    self.assertEqual(
        check.needed_standard("#if !defined(_MSC_VER) && __cplusplus < 201703L"
                              "\n#error x\n"), "17")


class CacheTest(unittest.TestCase):

  def setUp(self):
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    self.cache = os.path.join(self.dir, "cache")
    os.makedirs(self.cache)
    self.header = os.path.join(self.dir, "h.h")
    self.src = os.path.join(self.dir, "s.cc")
    self.write(self.header, "inline int f() { return 1; }\n")
    self.write(self.src, '#include "h.h"\nint g() { return f(); }\n')
    self.flags = ["-std=c++17", "-fsyntax-only", "-Wall", "-Werror"]

  def write(self, path, text):
    with open(path, "w") as f:
      f.write(text)

  def run_check(self):
    return check.check_file(self.src, self.flags, self.dir, self.cache)[1]

  def test_compiled_once_until_a_file_it_read_changes(self):
    self.assertEqual(self.run_check(), "ok")
    self.assertEqual(self.run_check(), "cached")
    self.write(self.header, "inline int f() { return 2; }\n")
    self.assertEqual(self.run_check(), "ok")
    self.assertEqual(self.run_check(), "cached")
    self.write(self.header, "inline int f() { return 2 }\n")
    self.assertEqual(self.run_check(), "FAILED")
    self.assertEqual(self.run_check(), "FAILED")  # failures are not kept

  def test_warnings_fail(self):
    self.write(self.src, '#include "h.h"\nint g() { int unused; return f(); }\n')
    self.assertEqual(self.run_check(), "FAILED")


if __name__ == "__main__":
  unittest.main()
