#!/usr/bin/env python3
"""Tests of tools/libtorch_headers_check.py's parts: which sources it
compiles, which headers it refuses, which standard it picks, the flags it
reads from the build's files, its download of Debian's package (checksum,
failures, the kept copy) and its cache (a file is compiled again when it or
a header it read changes)."""

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

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


def write(path, text):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def exit_code_and_stderr(call):
  """Runs `call`, which must fail(): (its exit code, what it printed)."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      call()
    except SystemExit as e:
      return e.code, err.getvalue()
  raise AssertionError("did not exit")


class BazelCoptsTest(unittest.TestCase):

  def setUp(self):
    self.root = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.root)

  def test_the_workspace_files(self):
    # The real tools/bazel/defs.bzl and .bazelrc (the test's data).
    copts = check.bazel_copts()
    for flag in ["-Wall", "-Wextra", "-Wno-maybe-uninitialized", "-Werror"]:
      self.assertIn(flag, copts)

  def test_lists_and_plain_build_lines_only(self):
    write(os.path.join(self.root, "tools", "bazel", "defs.bzl"), """
FLATPARAM_COPTS = [
    "-Wall",
    # why this one is off [see .bazelrc]
    "-Wno-sign-compare",  # trailing comment ]
]

LIBTORCH_COPTS = ["-Wno-maybe-uninitialized"]
def f(copts = []):
    pass
""")
    write(os.path.join(self.root, ".bazelrc"), """
build --nosandbox_debug
build --cxxopt=-std=c++17 --copt=-fexceptions
# build --copt=-Wcommented-out
build:sanitize --copt=-O1
test --copt=-Wtest-only
build --copt=-Werror  # warnings are errors
""")
    self.assertEqual(
        check.bazel_copts(self.root), [
            "-Wall", "-Wno-sign-compare", "-Wno-maybe-uninitialized",
            "-fexceptions", "-Werror"
        ])

  def test_werror_even_where_the_workspace_drops_it(self):
    write(os.path.join(self.root, "tools", "bazel", "defs.bzl"),
          'FLATPARAM_COPTS = ["-Wall"]\nLIBTORCH_COPTS = []\n')
    write(os.path.join(self.root, ".bazelrc"), "build --copt=-g\n")
    self.assertEqual(check.bazel_copts(self.root), ["-Wall", "-g", "-Werror"])

  def test_missing_files_are_an_error(self):
    code, err = exit_code_and_stderr(lambda: check.bazel_copts(self.root))
    self.assertEqual(code, 2)
    self.assertIn("cannot read the build's flags", err)

  def test_a_missing_or_computed_list_is_an_error(self):
    write(os.path.join(self.root, ".bazelrc"), "")
    for defs in ['FLATPARAM_COPTS = ["-Wall"]\n',
                 'FLATPARAM_COPTS = ["-Wall"]\nLIBTORCH_COPTS = [x]\n']:
      write(os.path.join(self.root, "tools", "bazel", "defs.bzl"), defs)
      code, err = exit_code_and_stderr(lambda: check.bazel_copts(self.root))
      self.assertEqual(code, 2)
      self.assertIn("no list of strings named LIBTORCH_COPTS", err)


class FetchDebianTest(unittest.TestCase):
  """fetch_debian against a file:// mirror holding a small .deb."""

  VERSION = "9.9.9-test"
  POOL = "pool/main/p/pytorch/libtorch-dev_9.9.9-test_amd64.deb"

  def setUp(self):
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    package = os.path.join(self.dir, "package")
    write(os.path.join(package, "DEBIAN", "control"),
          "Package: libtorch-dev\nVersion: 9.9.9-test\nArchitecture: amd64\n"
          "Maintainer: test <t@example.com>\nDescription: test\n")
    write(os.path.join(package, "usr", "include", "ATen", "ATen.h"),
          "#pragma once\n")
    self.deb = os.path.join(self.dir, "mirror", self.POOL)
    os.makedirs(os.path.dirname(self.deb))
    subprocess.run(["dpkg-deb", "--build", package, self.deb], check=True,
                   capture_output=True)
    with open(self.deb, "rb") as f:
      self.sha256 = hashlib.sha256(f.read()).hexdigest()
    self.cache = os.path.join(self.dir, "cache")
    for name, value in [
        ("CACHE", self.cache),
        ("DEBIAN_MIRROR", "file://" + os.path.join(self.dir, "mirror") + "/"),
        ("DEBIAN", {self.VERSION: (self.POOL, self.sha256)}),
    ]:
      patcher = mock.patch.object(check, name, value)
      patcher.start()
      self.addCleanup(patcher.stop)
    self.home = os.path.join(self.cache, "libtorch-headers", self.VERSION)

  def fetch(self):
    with contextlib.redirect_stdout(io.StringIO()):
      return check.fetch_debian(self.VERSION)

  def test_unpacked_once_then_kept(self):
    include = self.fetch()
    self.assertEqual(include, os.path.join(self.home, "usr", "include"))
    self.assertTrue(os.path.isfile(os.path.join(include, "ATen", "ATen.h")))
    os.remove(self.deb)  # the kept copy needs no mirror
    self.assertEqual(self.fetch(), include)
    # Nothing but the unpacked package is left beside it.
    self.assertEqual(os.listdir(os.path.dirname(self.home)), [self.VERSION])

  def test_an_incomplete_unpacking_of_ours_is_replaced(self):
    write(os.path.join(self.home, "usr", "include", "c10", "half.h"), "")
    include = self.fetch()
    self.assertTrue(os.path.isfile(os.path.join(include, "ATen", "ATen.h")))
    self.assertFalse(os.path.exists(os.path.join(include, "c10", "half.h")))

  def test_wrong_bytes_are_refused_and_not_unpacked(self):
    with open(self.deb, "ab") as f:
      f.write(b"tampered")
    code, err = exit_code_and_stderr(self.fetch)
    self.assertEqual(code, 2)
    self.assertIn(f"want {self.sha256}", err)
    self.assertFalse(os.path.exists(self.home))

  def test_a_failed_download(self):
    os.remove(self.deb)
    code, err = exit_code_and_stderr(self.fetch)
    self.assertEqual(code, 2)
    self.assertIn("cannot fetch file://", err)
    self.assertFalse(os.path.exists(self.home))

  def test_an_unknown_version(self):
    code, err = exit_code_and_stderr(lambda: check.fetch_debian("0.1"))
    self.assertEqual(code, 2)
    self.assertIn(f"--debian=0.1: unknown; known: {self.VERSION}", err)


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
