"""Repository rules that expose system libraries without downloading anything.

* `pkg_config_library`: a cc_library whose flags come from pkg-config.
* `cuda_configure`: CUDA runtime from a local CUDA installation when there is
  one, and NCCL from `$NCCL_HOME` (or `$NCCL_PATH`), else that installation,
  else the system (Debian's libnccl-dev); empty targets and
  `HAVE_CUDA = False` when there is no CUDA. Prints which NCCL it chose.
* `libtorch_configure`: LibTorch (PyTorch's C++ frontend) from
  `$LIBTORCH_HOME` (an unpacked LibTorch distribution: include/ and lib/),
  else Debian's libtorch-dev; an empty target and `AVAILABLE = False` when
  there is none. Prints which it chose. Its `:cuda` target is LibTorch's
  CUDA API (`CUDA_HEADERS_AVAILABLE`: compiles here;
  `CUDA_LIBRARIES_AVAILABLE`: links too).
* `stand_in_repository`: tiny local replacements for the repositories that
  Bazel 4's built-in WORKSPACE suffix would otherwise fetch.
"""

def _pkg_config(ctx, args):
    result = ctx.execute(["pkg-config"] + args)
    if result.return_code != 0:
        return None
    return result.stdout.strip()

def _quote_list(items):
    return "[" + ", ".join(['"%s"' % i for i in items]) + "]"

def _pkg_config_library_impl(ctx):
    modules = ctx.attr.modules
    libs = _pkg_config(ctx, ["--libs"] + modules)
    inc = _pkg_config(ctx, ["--cflags-only-I"] + modules)
    other = _pkg_config(ctx, ["--cflags-only-other"] + modules)
    available = libs != None and inc != None and other != None
    if not available and not ctx.attr.optional:
        fail("pkg-config could not find %s; run tools/setup.sh" % " ".join(modules))
    linkopts = []
    copts = []
    includes = []
    if available:
        linkopts = libs.split(" ") if libs else []
        copts = other.split(" ") if other else []

        # Headers outside /usr/include are linked into the repository so Bazel
        # can track them as inputs.
        for flag in (inc.split(" ") if inc else []):
            path = flag[2:]
            name = "include_%d" % len(includes)
            ctx.symlink(path, name)
            includes.append(name)
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    hdrs = " + ".join(['glob(["%s/**/*.h"])' % i for i in includes]) or "[]"
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "lib",
    hdrs = {hdrs},
    includes = {includes},
    copts = {copts},
    defines = {defines},
    linkopts = {linkopts},
)
""".format(
        hdrs = hdrs,
        includes = _quote_list(includes),
        copts = _quote_list(copts),
        defines = _quote_list(ctx.attr.defines if available else []),
        linkopts = _quote_list(linkopts),
    ))
    ctx.file("defs.bzl", "AVAILABLE = %s\n" % available)

pkg_config_library = repository_rule(
    implementation = _pkg_config_library_impl,
    attrs = {
        "modules": attr.string_list(mandatory = True),
        "defines": attr.string_list(),
        "optional": attr.bool(default = False),
    },
    environ = ["PKG_CONFIG_PATH"],
    local = True,
)

def _nccl_lib_dir(ctx, dirs):
    """The first of `dirs` with a library `-lnccl` links (libnccl.so or .a)."""
    for d in dirs:
        if ctx.path(d + "/libnccl.so").exists or ctx.path(d + "/libnccl.a").exists:
            return d
    return None

def _multiarch(ctx):
    """Debian's multiarch triplet (x86_64-linux-gnu), for /usr/lib/<triplet>."""
    for cc in ["gcc", "cc"]:
        if ctx.which(cc):
            result = ctx.execute([cc, "-print-multiarch"])
            if result.return_code == 0 and result.stdout.strip():
                return result.stdout.strip()
    result = ctx.execute(["uname", "-m"])
    machine = result.stdout.strip() if result.return_code == 0 else "x86_64"
    return {"ppc64le": "powerpc64le"}.get(machine, machine) + "-linux-gnu"

def _nccl_version(ctx, header):
    fields = {}
    for line in ctx.read(header).splitlines():
        words = [w for w in line.replace("\t", " ").split(" ") if w]
        if len(words) == 3 and words[0] == "#define" and words[1] in ["NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"]:
            fields[words[1]] = words[2]
    if len(fields) != 3:
        return "unknown"
    return "%s.%s.%s" % (fields["NCCL_MAJOR"], fields["NCCL_MINOR"], fields["NCCL_PATCH"])

def _find_nccl(ctx, cuda_root, cuda_lib):
    """The NCCL to use: struct(origin, include, lib), or None.

    In order: `$NCCL_HOME` (or `$NCCL_PATH`) with include/ and lib/ (or lib64/)
    under it, which must hold NCCL when set; the CUDA installation; the system
    layout of Debian's libnccl-dev (/usr/include with /usr/lib/<multiarch>,
    /usr/lib64 or /usr/lib).
    """
    for var in ["NCCL_HOME", "NCCL_PATH"]:
        home = ctx.os.environ.get(var, "").strip()
        if not home:
            continue
        if home != "/":
            home = home.rstrip("/")
        lib_dirs = [home + "/lib64", home + "/lib", home + "/lib/" + _multiarch(ctx)]
        lib = _nccl_lib_dir(ctx, lib_dirs)
        if not ctx.path(home + "/include/nccl.h").exists or lib == None:
            fail(("%s=%s, but there is no NCCL there: want %s/include/nccl.h and " +
                  "libnccl.so in one of %s. Fix or unset %s.") %
                 (var, home, home, ", ".join(lib_dirs), var))
        return struct(origin = "$%s" % var, include = home + "/include", lib = lib)
    if ctx.path(cuda_root + "/include/nccl.h").exists and _nccl_lib_dir(ctx, [cuda_lib]):
        return struct(origin = "the CUDA installation", include = cuda_root + "/include", lib = cuda_lib)
    if ctx.path("/usr/include/nccl.h").exists:
        lib = _nccl_lib_dir(ctx, ["/usr/lib/" + _multiarch(ctx), "/usr/lib64", "/usr/lib"])
        if lib:
            return struct(origin = "the system", include = "/usr/include", lib = lib)
    return None

def _cuda_configure_impl(ctx):
    root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    have_cuda = ctx.path(root + "/include/cuda_runtime.h").exists
    lib = root + "/lib64"
    if not ctx.path(lib).exists:
        lib = root + "/lib"

    # NCCL needs CUDA; without it NCCL is not looked for.
    nccl = _find_nccl(ctx, root, lib) if have_cuda else None
    have_nccl = nccl != None
    nccl_source = nccl.include + "/nccl.h" if have_nccl else "none"
    if have_nccl:
        print("NCCL %s from %s: %s, library in %s" %
              (_nccl_version(ctx, nccl_source), nccl.origin, nccl_source, nccl.lib))
    elif have_cuda:
        print(("NCCL: none (no nccl.h with libnccl in %s or /usr/include; " +
               "set NCCL_HOME to use another); NCCL targets are empty") % root)
    else:
        print("NCCL: none (no CUDA installation at %s); CUDA and NCCL targets are empty" % root)
    archs = ctx.os.environ.get("FLATPARAM_CUDA_ARCHS", "").strip()
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("defs.bzl", """\"\"\"What cuda_configure found on this machine.\"\"\"

HAVE_CUDA = {have_cuda}
HAVE_NCCL = {have_nccl}
CUDA_PATH = "{root}"

# The nccl.h that @local_cuda//:nccl uses, or "none".
NCCL_SOURCE = {nccl_source}

# $FLATPARAM_CUDA_ARCHS when the repository was fetched ("" when unset): the
# GPU architectures nvcc_library builds for unless --define=cuda_archs=... .
FLATPARAM_CUDA_ARCHS = {archs}

def if_cuda(if_true, if_false = []):
    return if_true if HAVE_CUDA else if_false

def if_nccl(if_true, if_false = []):
    return if_true if HAVE_NCCL else if_false
""".format(
        have_cuda = have_cuda,
        have_nccl = have_nccl,
        root = root,
        nccl_source = repr(nccl_source),
        archs = repr(archs),
    ))
    if not have_cuda:
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

# No CUDA installation was found at {root}; these targets are empty.
cc_library(name = "cudart")

cc_library(name = "nccl")
""".format(root = root))
        return

    # The CUDA headers, less NCCL's: those come only from the NCCL chosen
    # above (nccl_include/), so that a CUDA installation's nccl.h cannot shadow
    # the headers of another NCCL.
    for entry in ctx.path(root + "/include").readdir():
        if not entry.basename.startswith("nccl"):
            ctx.symlink(entry, "include/" + entry.basename)
    if have_nccl:
        for entry in ctx.path(nccl.include).readdir():
            if entry.basename.startswith("nccl"):
                ctx.symlink(entry, "nccl_include/" + entry.basename)
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob([
        "include/*.h",
        "include/*.hpp",
        "include/crt/**",
        "include/nv/**",
    ]),
    includes = ["include"],
)

cc_library(
    name = "cudart",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcudart"],
    deps = [":cuda_headers"],
)

# NCCL: {nccl_source}
cc_library(
    name = "nccl",
    hdrs = glob(["nccl_include/**"]),
    includes = {nccl_includes},
    linkopts = {nccl_linkopts},
    deps = [":cudart"],
)
""".format(
        lib = lib,
        nccl_source = nccl_source,
        nccl_includes = _quote_list(["nccl_include"] if have_nccl else []),
        nccl_linkopts = _quote_list(["-L" + nccl.lib, "-Wl,-rpath," + nccl.lib, "-lnccl"] if have_nccl else []),
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "NCCL_HOME", "NCCL_PATH", "FLATPARAM_CUDA_ARCHS"],
    local = True,
)

def _libtorch_configure_impl(ctx):
    home = ctx.os.environ.get("LIBTORCH_HOME", "").strip()
    if home:
        home = home.rstrip("/") or "/"
        include = home + "/include"
        lib = home + "/lib"
        if not ctx.path(include + "/torch/csrc/api/include/torch/torch.h").exists or \
           not ctx.path(lib + "/libtorch.so").exists:
            fail(("LIBTORCH_HOME=%s, but there is no LibTorch there: want " +
                  "%s/torch/csrc/api/include/torch/torch.h and %s/libtorch.so. " +
                  "Fix or unset LIBTORCH_HOME.") % (home, include, lib))
        origin = "$LIBTORCH_HOME"
    else:
        include = "/usr/include"
        lib = "/usr/lib/" + _multiarch(ctx)
        origin = "the system (libtorch-dev)"
    api = include + "/torch/csrc/api/include"
    available = ctx.path(api + "/torch/torch.h").exists and ctx.path(lib + "/libtorch.so").exists

    # c10d's gloo process group (//comm/c10d): its header includes gloo's.
    # Debian's libtorch links the system's libgloo (libgloo-dev has the
    # headers and libgloo.so); a LibTorch from pytorch.org has gloo inside
    # libtorch_cpu.so and ships its headers under include/gloo.
    gloo_linkopts = []
    if ctx.path(include + "/gloo/algorithm.h").exists:
        gloo_include = include
    else:
        gloo_include = "/usr/include"
    c10d_available = available and \
                     ctx.path(include + "/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp").exists and \
                     ctx.path(gloo_include + "/gloo/algorithm.h").exists
    if c10d_available and not home:
        for d in ["/usr/lib/" + _multiarch(ctx), "/usr/lib"]:
            if ctx.path(d + "/libgloo.so").exists:
                gloo_linkopts = ["-L" + d, "-lgloo"]
                break
        if not gloo_linkopts:
            c10d_available = False

    # LibTorch's CUDA headers (c10/cuda, ATen/cuda) with a CUDA
    # installation's: flatparam/torch's CUDA glue compiles wherever both are
    # present, and links and runs only where LibTorch has its CUDA libraries
    # (libc10_cuda.so; Debian's build is CPU-only but installs the headers).
    cuda_root = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    cuda_headers = available and \
                   ctx.path(include + "/c10/cuda/CUDAStream.h").exists and \
                   ctx.path(include + "/ATen/cuda/CUDAEvent.h").exists and \
                   ctx.path(cuda_root + "/include/cuda_runtime_api.h").exists
    cuda_libraries = cuda_headers and ctx.path(lib + "/libc10_cuda.so").exists
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("defs.bzl", """AVAILABLE = {available}
C10D_AVAILABLE = {c10d}

# flatparam/torch's CUDA glue compiles here (LibTorch's c10/cuda and
# ATen/cuda headers and a CUDA installation's headers are present)...
CUDA_HEADERS_AVAILABLE = {cuda_headers}

# ...and links and runs here (LibTorch has libc10_cuda.so).
CUDA_LIBRARIES_AVAILABLE = {cuda_libraries}
""".format(available = available, c10d = c10d_available, cuda_headers = cuda_headers, cuda_libraries = cuda_libraries))
    if not available:
        print("LibTorch: none (no %s/torch/torch.h with %s/libtorch.so; run tools/setup.sh or set LIBTORCH_HOME); LibTorch targets are skipped" % (api, lib))
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

# No LibTorch was found; these targets are empty.
cc_library(name = "lib")

cc_library(name = "gloo")

cc_library(name = "cuda")
""")
        return
    if not c10d_available:
        print("LibTorch's c10d gloo process group: not buildable here (no gloo headers or libgloo.so; tools/setup.sh installs libgloo-dev); //comm/c10d is skipped")

    # The C++ API's headers live below the main include directory, so they
    # need an include path of their own; linked in here so that Bazel tracks
    # them. The rest (ATen, c10, torch/csrc) is found under `include`, which
    # for Debian's package is /usr/include.
    ctx.symlink(api, "api_include")
    includes = ["api_include"]
    hdrs = 'glob(["api_include/**/*.h"])'
    if include != "/usr/include":
        ctx.symlink(include, "include")
        includes.append("include")
        hdrs = 'glob(["api_include/**/*.h", "include/**/*.h", "include/**/*.cuh"])'

    # PyTorch's CMake generates c10/cuda/impl/cuda_cmake_macros.h, which
    # CUDAMacros.h includes; a CPU-only build (Debian's) installs the other
    # c10/cuda headers without it. Supplied here as a shared-library build
    # writes it, where the installation lacks it.
    cuda_includes = []
    cuda_hdrs = "[]"
    if cuda_headers and not ctx.path(include + "/c10/cuda/impl/cuda_cmake_macros.h").exists:
        ctx.file("c10_cuda_generated/c10/cuda/impl/cuda_cmake_macros.h", """#pragma once

// Written by flatparam's libtorch_configure (third_party/system_libs.bzl):
// the header PyTorch's CMake generates for a shared-library build, which
// this LibTorch installation lacks.
#define C10_CUDA_BUILD_SHARED_LIBS
""")
        cuda_includes = ["c10_cuda_generated"]
        cuda_hdrs = 'glob(["c10_cuda_generated/**/*.h"])'
    cuda_linkopts = ["-L" + lib, "-Wl,-rpath," + lib, "-ltorch_cuda", "-lc10_cuda"] if cuda_libraries else []
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

# LibTorch from {origin}: headers {include}, libraries {lib}.
cc_library(
    name = "lib",
    hdrs = {hdrs},
    includes = {includes},
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-pthread"],
)

# What c10d's ProcessGroupGloo header needs beyond LibTorch: the macro
# that enables it, and gloo's library (its headers are under the include
# path above).
cc_library(
    name = "gloo",
    defines = {gloo_defines},
    linkopts = {gloo_linkopts},
    deps = [":lib"],
)

# LibTorch's CUDA API (c10/cuda, ATen/cuda) over the CUDA installation's
# headers (@local_cuda//:cuda_headers, which the user adds). Headers only
# where CUDA_LIBRARIES_AVAILABLE (defs.bzl) is False: a library using them
# compiles, and a binary linking it fails.
cc_library(
    name = "cuda",
    hdrs = {cuda_hdrs},
    includes = {cuda_includes},
    linkopts = {cuda_linkopts},
    deps = [":lib"],
)
""".format(origin = origin, include = include, lib = lib, hdrs = hdrs, includes = _quote_list(includes), gloo_linkopts = _quote_list(gloo_linkopts), gloo_defines = _quote_list(["USE_C10D_GLOO"] if c10d_available else []), cuda_hdrs = cuda_hdrs, cuda_includes = _quote_list(cuda_includes), cuda_linkopts = _quote_list(cuda_linkopts)))

libtorch_configure = repository_rule(
    implementation = _libtorch_configure_impl,
    environ = ["LIBTORCH_HOME", "CUDA_PATH"],
    local = True,
)

_RULES_CC_DEFS = """\"\"\"Offline stand-in for rules_cc: forwards to the native rules.\"\"\"

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
"""

_RULES_JAVA_DEFS = """\"\"\"Offline stand-in for rules_java: forwards to the native rules.\"\"\"

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
"""

_COVERAGE_SCRIPT = """#!/bin/sh
# Offline stand-in for Bazel's coverage_report_generator: concatenates the
# per-test lcov files listed in --filelist into --output_file.
out=""
list=""
for arg in "$@"; do
  case "$arg" in
    --output_file=*) out="${arg#--output_file=}" ;;
    --filelist=*) list="${arg#--filelist=}" ;;
  esac
done
[ -n "$out" ] || exit 0
: > "$out"
[ -n "$list" ] && [ -f "$list" ] || exit 0
while IFS= read -r f; do
  [ -f "$f" ] && cat "$f" >> "$out"
done < "$list"
exit 0
"""

def _stand_in_repository_impl(ctx):
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    kind = ctx.attr.kind
    if kind == "rules_cc":
        ctx.file("BUILD.bazel", "")
        ctx.file("cc/BUILD.bazel", "")
        ctx.file("cc/defs.bzl", _RULES_CC_DEFS)
    elif kind == "rules_java":
        ctx.file("BUILD.bazel", "")
        ctx.file("java/BUILD.bazel", "")
        ctx.file("java/defs.bzl", _RULES_JAVA_DEFS)
    elif kind == "remote_coverage_tools":
        ctx.file("coverage_report_generator.sh", _COVERAGE_SCRIPT, executable = True)
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

sh_binary(
    name = "coverage_report_generator",
    srcs = ["coverage_report_generator.sh"],
)

filegroup(
    name = "lcov_merger",
    srcs = ["coverage_report_generator.sh"],
)
""")
    else:
        fail("unknown stand-in kind " + kind)

stand_in_repository = repository_rule(
    implementation = _stand_in_repository_impl,
    attrs = {"kind": attr.string(mandatory = True)},
)
