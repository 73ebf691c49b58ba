"""Rules for the CUDA parts of flatparam/device, defined only with CUDA.

Where cuda_configure found no CUDA installation these macros define nothing,
so `bazel test //...` there neither builds nor lists the CUDA targets; the
always-built `:cuda` target then reports Unimplemented at run time.

`nvcc_library` compiles .cu files with the installation's nvcc (a small rule
of its own: Bazel 4 has no CUDA toolchain) into a static library of
position-independent code, wrapped in a cc_library that also links the CUDA
runtime.

The GPU architectures are a comma-separated list of `sm_XX` (real code for
that GPU generation) and `compute_XX` (PTX of that virtual architecture, which
the driver compiles for later GPUs) tokens, e.g. `sm_80,sm_90,compute_90`,
taken from the first of:
  * `--define=cuda_archs=...` on the command line (per build);
  * `$FLATPARAM_CUDA_ARCHS` when the @local_cuda repository was fetched;
  * DEFAULT_CUDA_ARCHS.
"""

load("@local_cuda//:defs.bzl", "CUDA_PATH", "FLATPARAM_CUDA_ARCHS", "HAVE_CUDA")
load("//tools/bazel:defs.bzl", "flatparam_cc_library", "flatparam_cc_test")

# Real code (SASS) for these GPU generations (A100, H100), plus PTX of the
# newest for the driver to compile on later GPUs.
DEFAULT_CUDA_ARCHS = "sm_80,sm_90,compute_90"

def parse_cuda_archs(value, origin):
    """The tokens of a GPU architecture list, checked; fails on a bad one.

    Args:
      value: comma-separated `sm_XX` / `compute_XX` tokens (XX: two or more
        digits, optionally followed by `a` or `f`, as in sm_90a).
      origin: where `value` came from, for the error message.

    Returns:
      The tokens in order, without duplicates.
    """
    archs = []
    for token in value.split(","):
        token = token.strip()
        kind, _, number = token.partition("_")
        digits = number[:-1] if number and number[-1] in "af" else number
        if kind not in ["sm", "compute"] or len(digits) < 2 or not digits.isdigit():
            fail(("bad GPU architecture %r in %s=%r: want a comma-separated " +
                  "list of sm_XX (real code) and compute_XX (PTX) tokens, " +
                  "e.g. %s") % (token, origin, value, DEFAULT_CUDA_ARCHS))
        if token not in archs:
            archs.append(token)
    return archs

def _gencode_flags(archs):
    flags = []
    for arch in archs:
        kind, _, number = arch.partition("_")
        flags.append("-gencode arch=compute_%s,code=%s_%s" % (number, kind, number))
    return flags

def _nvcc_archive_impl(ctx):
    if "cuda_archs" in ctx.var:
        value, origin = ctx.var["cuda_archs"], "--define=cuda_archs"
    elif FLATPARAM_CUDA_ARCHS:
        value, origin = FLATPARAM_CUDA_ARCHS, "FLATPARAM_CUDA_ARCHS"
    else:
        value, origin = DEFAULT_CUDA_ARCHS, "DEFAULT_CUDA_ARCHS"
    gencode = " ".join(_gencode_flags(parse_cuda_archs(value, origin)))
    out = ctx.outputs.out
    compile_cmds = [
        # -lineinfo: compute-sanitizer (tools/gpu/run.sh) names the source
        # line of a fault; it does not change the code.
        ("TMPDIR=$tmp %s/bin/nvcc -std=c++17 -O3 -lineinfo -Xcompiler -fPIC " +
         "-Xcompiler -Wall %s -c %s -o $tmp/obj_%d.o") %
        (CUDA_PATH, gencode, src.path, i)
        for i, src in enumerate(ctx.files.srcs)
    ]
    ctx.actions.run_shell(
        inputs = ctx.files.srcs + ctx.files.hdrs,
        outputs = [out],
        command = " && ".join([
            "tmp=$(mktemp -d %s/nvcc_tmp.XXXXXX)" % out.dirname,
        ] + compile_cmds + [
            "ar rcs %s $tmp/obj_*.o" % out.path,
            "rm -rf $tmp",
        ]),
        mnemonic = "Nvcc",
        progress_message = "Compiling CUDA kernels of %s with nvcc for %s" % (
            ctx.attr.library,
            value,
        ),
        use_default_shell_env = True,
    )

_nvcc_archive = rule(
    implementation = _nvcc_archive_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"], mandatory = True),
        "hdrs": attr.label_list(allow_files = True),
        "out": attr.output(mandatory = True),
        "library": attr.string(doc = "The cc_library, for messages."),
    },
)

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
      name: the cc_library; the target running nvcc is `name + "_nvcc"`.
      srcs: .cu files, compiled separately and archived together.
      hdrs: headers of the library; the .cu files include them by bare name.
      visibility: of the cc_library.
    """
    if not HAVE_CUDA:
        return
    archive = "lib%s_nvcc.a" % name
    _nvcc_archive(
        name = name + "_nvcc",
        srcs = srcs,
        hdrs = hdrs,
        out = archive,
        library = name,
    )
    flatparam_cc_library(
        name = name,
        srcs = [":" + archive],
        hdrs = hdrs,
        visibility = visibility,
        deps = ["@local_cuda//:cudart"],
    )
