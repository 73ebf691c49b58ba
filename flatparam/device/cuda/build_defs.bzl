"""Rules for the CUDA parts of flatparam/device, defined only with CUDA.

Where cuda_configure found no CUDA installation these macros define nothing,
so `bazel test //...` there neither builds nor lists the CUDA targets; the
always-built `:cuda` target then reports Unimplemented at run time.

`nvcc_library` compiles .cu files with the installation's nvcc (a genrule:
Bazel 4 has no CUDA toolchain) into a static library of position-independent
code, wrapped in a cc_library that also links the CUDA runtime.
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH", "HAVE_CUDA")
load("//tools/bazel:defs.bzl", "flatparam_cc_library", "flatparam_cc_test")

# Real code (SASS) for these GPU generations (A100, H100), plus PTX of the
# newest for the driver to compile on later GPUs.
CUDA_ARCHS = ["80", "90"]

def cuda_cc_library(**kwargs):
    """A flatparam_cc_library defined only when CUDA was found."""
    if HAVE_CUDA:
        flatparam_cc_library(**kwargs)

def cuda_cc_test(**kwargs):
    """A flatparam_cc_test defined only when CUDA was found."""
    if HAVE_CUDA:
        flatparam_cc_test(**kwargs)

def nvcc_library(name, srcs, hdrs = [], visibility = None):
    """A cc_library of `srcs` (.cu) compiled by nvcc; only with CUDA.

    Args:
      name: the cc_library; the genrule running nvcc is `name + "_nvcc"`.
      srcs: .cu files, compiled separately and archived together.
      hdrs: headers of the library; the .cu files include them by bare name.
      visibility: of the cc_library.
    """
    if not HAVE_CUDA:
        return
    gencode = " ".join([
        "-gencode arch=compute_%s,code=sm_%s" % (a, a)
        for a in CUDA_ARCHS
    ] + ["-gencode arch=compute_%s,code=compute_%s" % (CUDA_ARCHS[-1], CUDA_ARCHS[-1])])
    compile_cmds = [
        ("TMPDIR=$$tmp %s/bin/nvcc -std=c++17 -O3 -Xcompiler -fPIC " +
         "-Xcompiler -Wall %s -c $(location %s) -o $$tmp/obj_%d.o") %
        (CUDA_PATH, gencode, src, i)
        for i, src in enumerate(srcs)
    ]
    archive = "lib%s_nvcc.a" % name
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs,
        outs = [archive],
        cmd = " && ".join([
            "tmp=$$(mktemp -d $(@D)/nvcc_tmp.XXXXXX)",
        ] + compile_cmds + [
            "ar rcs $@ $$tmp/obj_*.o",
            "rm -rf $$tmp",
        ]),
        message = "Compiling CUDA kernels of %s with nvcc" % name,
    )
    flatparam_cc_library(
        name = name,
        srcs = [":" + archive],
        hdrs = hdrs,
        visibility = visibility,
        deps = ["@local_cuda//:cudart"],
    )
