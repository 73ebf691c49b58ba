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

def flatparam_cc_test(name, copts = [], deps = [], **kwargs):
    """A GoogleTest test; gtest_main is added unless `deps` brings a main."""
    native.cc_test(
        name = name,
        copts = FLATPARAM_COPTS + copts,
        deps = deps + ["@flatparam//third_party:gtest_main"],
        **kwargs
    )
