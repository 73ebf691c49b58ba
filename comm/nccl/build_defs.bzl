"""Rules for targets that exist only where cuda_configure found NCCL.

On a machine without a CUDA installation these macros define nothing, so
`bazel test //...` there neither builds nor lists the NCCL-only targets; the
always-built `//comm/nccl:nccl` then reports Unimplemented at run time.
"""

load("@local_cuda//:defs.bzl", "HAVE_NCCL")
load("//tools/bazel:defs.bzl", "flatparam_cc_library", "flatparam_cc_test")

def nccl_cc_library(**kwargs):
    """A flatparam_cc_library defined only when NCCL was found."""
    if HAVE_NCCL:
        flatparam_cc_library(**kwargs)

def nccl_cc_test(**kwargs):
    """A flatparam_cc_test defined only when NCCL was found."""
    if HAVE_NCCL:
        flatparam_cc_test(**kwargs)
