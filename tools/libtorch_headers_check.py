#!/usr/bin/env python3
"""Compiles flatparam's LibTorch code against another LibTorch's headers.

The Bazel build compiles against the LibTorch installed here (Debian
bookworm's 1.13). LibTorch teams run 2.x, whose C++ API moved on (autograd
nodes held by c10::intrusive_ptr, ProcessGroupGloo a c10d::Backend,
TCPStore's libuv backend, C++20 headers). This check compiles, syntax only
(g++ -fsyntax-only: no libraries, no GPU), every source file that includes
LibTorch's headers, directly or through flatparam's own headers, against a
second LibTorch's headers, and fails on any error or warning in flatparam's
code, or on a LibTorch header taken from anywhere but that LibTorch.

  # Debian's libtorch-dev of a pinned version (fetched from
  # deb.debian.org, its SHA-256 checked, kept in ~/.cache/flatparam):
  tools/libtorch_headers_check.py --debian=2.14.1+dfsg-1
  # Any LibTorch's include folder (a pytorch.org LibTorch's include/, a
  # wheel's torch/include):
  tools/libtorch_headers_check.py --include=/opt/libtorch/include

Options: --files=library (the default: what users link, tests and tools
left out) or --files=all; --std=17|20 (default: 20 where the headers
require it, else 17); --jobs=N. A file whose source and every header it
read last time are unchanged is not compiled again (the result is kept
under ~/.cache/flatparam/libtorch-headers-check; --no-cache ignores it).
The flags are those the build compiles LibTorch code with (read from
tools/bazel/defs.bzl and .bazelrc), always with -Werror.
FLATPARAM_DEBIAN_MIRROR names a Debian mirror other than deb.debian.org
(its URL, ending in /debian/).

Prints one line per compiled file and a summary; exits 0 when every file
compiles, 1 otherwise, 2 for bad arguments or a failed download.
"""

import argparse
import ast
import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flatparam")

# Debian's libtorch-dev packages this check knows: version -> (pool path,
# SHA-256 of the .deb). trixie (stable) has 2.6; sid had 2.14 in 2026-11.
DEBIAN = {
    "2.6.0+dfsg-7": (
        "pool/main/p/pytorch/libtorch-dev_2.6.0+dfsg-7_amd64.deb",
        "d63886ac7482184e96d38cbbbb346430f1cc3a68b59319eb2ca1ababd501535b"),
    "2.14.1+dfsg-1": (
        "pool/main/p/pytorch/libtorch-dev_2.14.1+dfsg-1_amd64.deb",
        "d941cb918c760250305f2fd3c4fa63f1b86069fe6996e8c439b48af79ed27636"),
}
# FLATPARAM_DEBIAN_MIRROR names another (a local mirror, a file:// folder).
DEBIAN_MIRROR = os.environ.get("FLATPARAM_DEBIAN_MIRROR",
                               "http://deb.debian.org/debian/")

# The defines Bazel gives these targets (third_party/: nlohmann_json's,
# c10d's gloo, libstdc++'s string ABI); the warning flags are read from the
# build's own files (bazel_copts).
DEFINES = ["-DJSON_DIAGNOSTICS=1", "-DUSE_C10D_GLOO", "-D_GLIBCXX_USE_CXX11_ABI=1"]

TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.M)
LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# Where the library's sources are not: tests, test utilities, benchmarks,
# command-line tools, examples (--files=all takes them too).
NOT_LIBRARY = re.compile(
    r"(_test\.cc$|_main\.cc$|^testing/|^benchmarks/|^tools/|^readme/|^examples/)")
LIBTORCH_DIRS = ("torch", "ATen", "c10", "caffe2")


def fail(message, code=2):
  print(f"libtorch_headers_check: {message}", file=sys.stderr)
  sys.exit(code)


def bazel_copts(root=ROOT):
  """The flags Bazel compiles flatparam's LibTorch code with, read from the
  build's files so that this check cannot drift from them: FLATPARAM_COPTS
  and LIBTORCH_COPTS of tools/bazel/defs.bzl, then the --copt's of
  .bazelrc's plain `build` lines (a `build:CONFIG` line belongs to a
  config the check does not compile with), and -Werror."""
  defs = os.path.join(root, "tools", "bazel", "defs.bzl")
  bazelrc = os.path.join(root, ".bazelrc")
  try:
    with open(defs) as f:
      # Comments go first: a Starlark list of strings is then a Python
      # literal (no flag holds a '#').
      text = re.sub(r"#[^\n]*", "", f.read())
    with open(bazelrc) as f:
      rc_lines = f.readlines()
  except OSError as e:
    fail(f"cannot read the build's flags: {e}")
  copts = []
  for name in ("FLATPARAM_COPTS", "LIBTORCH_COPTS"):
    m = re.search(rf"^{name}\s*=\s*(\[.*?\])", text, re.M | re.S)
    try:
      value = ast.literal_eval(m.group(1)) if m else None
    except (SyntaxError, ValueError):
      value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
      fail(f"{defs}: no list of strings named {name}")
    copts += value
  for line in rc_lines:
    words = line.split("#", 1)[0].split()
    if words[:1] == ["build"]:
      copts += [w[len("--copt="):] for w in words[1:] if w.startswith("--copt=")]
  # Warnings fail this check whatever the workspace does with them.
  return copts if "-Werror" in copts else copts + ["-Werror"]


def fetch_debian(version):
  """Returns the include folder of Debian's libtorch-dev `version`."""
  if version not in DEBIAN:
    fail(f"--debian={version}: unknown; known: {', '.join(sorted(DEBIAN))}")
  path, sha256 = DEBIAN[version]
  home = os.path.join(CACHE, "libtorch-headers", version)
  include = os.path.join(home, "usr", "include")
  if os.path.isfile(os.path.join(include, "ATen", "ATen.h")):
    return include
  os.makedirs(os.path.dirname(home), exist_ok=True)
  url = DEBIAN_MIRROR + path
  print(f"libtorch_headers_check: fetching {url}", flush=True)
  try:
    with urllib.request.urlopen(url, timeout=120) as response:
      data = response.read()
  except OSError as e:
    fail(f"cannot fetch {url}: {e}")
  got = hashlib.sha256(data).hexdigest()
  if got != sha256:
    fail(f"{url}: SHA-256 {got}, want {sha256}")
  work = tempfile.mkdtemp(dir=os.path.dirname(home), prefix=".fetch.")
  try:
    deb = os.path.join(work, "libtorch-dev.deb")
    with open(deb, "wb") as f:
      f.write(data)
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(work, "root")],
                   check=True)
    if os.path.isdir(home):
      shutil.rmtree(home)  # a previous, incomplete extraction of ours
    os.rename(os.path.join(work, "root"), home)
  except (OSError, subprocess.CalledProcessError) as e:
    fail(f"cannot unpack {url}: {e}")
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return include


def tracked_files():
  out = subprocess.run(["git", "ls-files", "*.cc", "*.h"], cwd=ROOT,
                       check=True, capture_output=True, text=True).stdout
  return [f for f in out.split() if not f.startswith("third_party/")]


def read_sources(files):
  text = {}
  for f in files:
    with open(os.path.join(ROOT, f), encoding="utf-8", errors="replace") as h:
      text[f] = h.read()
  return text


def sources_using_libtorch(text, which):
  """The .cc files of `text` (path -> contents) that include LibTorch,
  directly or through our headers; with which="library", not the tests,
  tools and benchmarks."""
  uses = {f for f, t in text.items() if TORCH_INCLUDE.search(t)}
  changed = True
  while changed:
    changed = False
    for f, t in text.items():
      if f not in uses and any(i in uses for i in LOCAL_INCLUDE.findall(t)):
        uses.add(f)
        changed = True
  cc = sorted(f for f in uses if f.endswith(".cc"))
  if which == "library":
    cc = [f for f in cc if not NOT_LIBRARY.search(f)]
  return cc


def needed_standard(aten_h):
  """"20" where ATen/ATen.h stops below C++20 (2.1x), else "17"."""
  return "20" if re.search(r"__cplusplus\s*<\s*202002L", aten_h) else "17"


def include_flags(include, std):
  flags = [f"-std=c++{std}", "-fsyntax-only", "-I."]
  # LibTorch's headers as system headers (as Bazel has Debian's): their own
  # warnings are not flatparam's to fix.
  # (/usr/include, the compiler's own, is searched already: naming it
  # again would break libstdc++'s #include_next.)
  if os.path.realpath(include) != "/usr/include":
    flags += ["-isystem", include]
  flags += ["-isystem", os.path.join(include, "torch", "csrc", "api", "include")]
  # A CPU-only LibTorch installs c10/cuda without the header its CMake
  # generates (as third_party/system_libs.bzl supplies it).
  generated = os.path.join(CACHE, "libtorch-headers", "generated")
  macros = os.path.join(generated, "c10", "cuda", "impl", "cuda_cmake_macros.h")
  if not os.path.exists(os.path.join(include, "c10", "cuda", "impl",
                                     "cuda_cmake_macros.h")):
    os.makedirs(os.path.dirname(macros), exist_ok=True)
    if not os.path.exists(macros):
      with open(macros, "w") as f:
        f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    flags += ["-isystem", generated]
  cuda = os.environ.get("CUDA_PATH", "/usr/local/cuda")
  if os.path.isfile(os.path.join(cuda, "include", "cuda_runtime_api.h")):
    flags += ["-isystem", os.path.join(cuda, "include")]
  try:
    mpi = subprocess.run(["mpicxx", "--showme:incdirs"], capture_output=True,
                         text=True, check=True).stdout.split()
    for d in mpi:
      flags += ["-isystem", d]
  except (OSError, subprocess.CalledProcessError):
    pass
  return flags + DEFINES + bazel_copts()


def digest_of(paths):
  """A digest of the files' names and contents (relative to the checkout)."""
  h = hashlib.sha256()
  for p in paths:
    h.update(p.encode() + b"\0")
    try:
      with open(os.path.join(ROOT, p), "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
    except OSError:
      h.update(b"missing")
  return h.hexdigest()


def relative(path):
  """`path` relative to the checkout when inside it (so that the cache holds
  for every clone), else absolute."""
  real = os.path.realpath(os.path.join(ROOT, path))
  root = os.path.realpath(ROOT) + os.sep
  return real[len(root):] if real.startswith(root) else real


def read_deps(path):
  with open(path) as f:
    text = f.read().replace("\\\n", " ")
  return [p for p in text.split(":", 1)[1].split()] if ":" in text else []


def foreign_libtorch_headers(deps, include):
  """LibTorch headers read from outside `include` (another LibTorch's)."""
  bad = []
  for d in deps:
    real = os.path.realpath(os.path.join(ROOT, d))
    if real.startswith(os.path.realpath(include) + os.sep):
      continue
    parts = real.split(os.sep)
    if "include" in parts:
      after = parts[len(parts) - 1 - parts[::-1].index("include") + 1:]
      if after and after[0] in LIBTORCH_DIRS:
        bad.append(real)
  return bad


def check_file(src, flags, include, cache_dir):
  """(source, status, message): status "ok", "cached" or "FAILED"."""
  key = hashlib.sha256((src + "\0" + "\0".join(flags)).encode()).hexdigest()
  deps_file = os.path.join(cache_dir, key + ".deps") if cache_dir else None
  if deps_file and os.path.exists(deps_file):
    with open(deps_file) as f:
      deps = f.read().split("\n")
    stamp = os.path.join(cache_dir, key + "." + digest_of(deps) + ".ok")
    if os.path.exists(stamp):
      return src, "cached", ""
  with tempfile.TemporaryDirectory() as tmp:
    dep_out = os.path.join(tmp, "deps.d")
    result = subprocess.run(["g++"] + flags + ["-MD", "-MF", dep_out, src],
                            cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
      return src, "FAILED", result.stderr
    deps = [relative(d) for d in read_deps(dep_out)]
  bad = foreign_libtorch_headers(deps, include)
  if bad:
    return src, "FAILED", ("LibTorch headers from outside " + include + ":\n  " +
                           "\n  ".join(sorted(set(bad))[:10]))
  if cache_dir:
    with open(deps_file, "w") as f:
      f.write("\n".join(deps))
    open(os.path.join(cache_dir, key + "." + digest_of(deps) + ".ok"),
         "w").close()
  return src, "ok", ""


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  where = parser.add_mutually_exclusive_group(required=True)
  where.add_argument("--debian", metavar="VERSION",
                     help="Debian's libtorch-dev of this version")
  where.add_argument("--include", metavar="DIR",
                     help="a LibTorch's include folder")
  parser.add_argument("--files", choices=["library", "all"], default="library")
  parser.add_argument("--std", choices=["17", "20"])
  parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--no-cache", action="store_true")
  args = parser.parse_args()

  include = fetch_debian(args.debian) if args.debian else os.path.abspath(
      args.include)
  aten = os.path.join(include, "ATen", "ATen.h")
  if not os.path.isfile(aten):
    fail(f"no ATen/ATen.h under {include}: not a LibTorch include folder")
  with open(aten) as f:
    std = args.std or needed_standard(f.read())
  version = "of unknown version"
  for version_h in [
      os.path.join(include, "torch", "headeronly", "version.h"),  # 2.1x
      os.path.join(include, "torch", "csrc", "api", "include", "torch",
                   "version.h")
  ]:
    if os.path.isfile(version_h):
      with open(version_h) as f:
        parts = [
            re.search(rf"define\s+TORCH_VERSION_{p}\s+(\d+)", text)
            for text in [f.read()] for p in ("MAJOR", "MINOR", "PATCH")
        ]
      if all(parts):
        version = ".".join(m.group(1) for m in parts)
        break
  flags = include_flags(include, std)
  cache_dir = None
  if not args.no_cache:
    cache_dir = os.path.join(CACHE, "libtorch-headers-check")
    os.makedirs(cache_dir, exist_ok=True)

  sources = sources_using_libtorch(read_sources(tracked_files()), args.files)
  print(f"libtorch_headers_check: LibTorch {version} ({include}), C++{std}, "
        f"{len(sources)} files ({args.files})", flush=True)
  counts = {"ok": 0, "cached": 0, "FAILED": 0}
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
    futures = [pool.submit(check_file, s, flags, include, cache_dir)
               for s in sources]
    for future in concurrent.futures.as_completed(futures):
      src, status, message = future.result()
      counts[status] += 1
      if status != "cached":
        print(f"  {status:6} {src}", flush=True)
      if message:
        print("\n".join("    " + l for l in message.splitlines()[:40]),
              flush=True)
  print(f"libtorch_headers_check: {counts['ok']} compiled, {counts['cached']} "
        f"unchanged since they compiled, {counts['FAILED']} failed")
  return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
  sys.exit(main())
