"""Rule wrappers so every flatparam target is built with the same options."""

# -Werror comes from the workspace's .bazelrc, so that a consumer on another
# compiler is not broken by a new warning. GCC 12's -Warray-bounds and
# -Wstringop-* misfire inside std::map/nlohmann::json at -O2.
FLATPARAM_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wno-array-bounds",
    "-Wno-stringop-overflow",
    "-Wno-stringop-overread",
    "-Wno-sign-compare",
    "-Wno-unused-parameter",
    "-Wno-missing-field-initializers",
]

# Translation units that include LibTorch's headers: GCC 12 at -O1/-O2
# (ASan, -c opt) reports -Wmaybe-uninitialized inside c10's intrusive_ptr
# and std::optional<std::vector> once inlined, false positives that
# -Werror would turn into errors.
LIBTORCH_COPTS = ["-Wno-maybe-uninitialized"]

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
