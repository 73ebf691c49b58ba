"""Rule wrappers so every flatparam target is built with the same options."""

FLATPARAM_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-sign-compare",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

def flatparam_cc_library(name, copts = [], **kwargs):
    native.cc_library(name = name, copts = FLATPARAM_COPTS + copts, **kwargs)

def flatparam_cc_binary(name, copts = [], **kwargs):
    native.cc_binary(name = name, copts = FLATPARAM_COPTS + copts, **kwargs)

def flatparam_cc_test(name, copts = [], deps = [], size = "small", **kwargs):
    """A GoogleTest test linked with gtest_main; small unless told otherwise."""
    native.cc_test(
        name = name,
        size = size,
        copts = FLATPARAM_COPTS + copts,
        deps = deps + ["@flatparam//third_party:gtest_main"],
        **kwargs
    )
