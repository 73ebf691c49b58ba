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

# LibTorch's API headers, precompiled (flatparam/torch/internal/libtorch_pch.h;
# tools/bazel/pch.bzl) where --//tools/bazel:precompiled_headers is on. GCC
# uses a precompiled header only for a file compiled with the same flags, and
# --config=sanitize compiles files with different flags by their path
# (.bazelrc's --per_file_copt), so a target names the kind of its sources:
#   "library": -O0 with both sanitizers there (flatparam/torch, refmodel's
#              torch_gpt.cc, the *_main.cc programs);
#   "test":    -O0 with AddressSanitizer alone (*_test.cc, testing/);
#   "other":   -O1 with both (benchmarks/, readme/): no precompiled header in
#              that one configuration.
# Outside --config=sanitize every kind uses the library's. GCC refuses a
# header whose macros or optimization level differ (-Winvalid-pch, an error
# under -Werror) but takes one whose sanitizers differ without a word, so
# tools/pch_flags_check.py compares every user's flags with its header's in
# CI. Targets whose sources see USE_C10D_GLOO (from //third_party:c10d) take
# none: GCC refuses a header precompiled without that define, and the ten
# files that have it would not repay a header of their own.
_PCH_ON = "@flatparam//tools/bazel:precompiled_headers_on"
_PCH_SANITIZE = "@flatparam//tools/bazel:precompiled_headers_sanitize"
_LIBTORCH_PCH_TARGET = {
    "library": "@flatparam//flatparam/torch:libtorch_pch",
    "test": "@flatparam//flatparam/torch:libtorch_pch_for_tests",
}
_LIBTORCH_PCH_INCLUDE = {
    "library": "flatparam_libtorch_pch.h",
    "test": "flatparam_libtorch_pch_test.h",
}

def _pch_copts(kind):
    if kind == None:
        return []
    return ["-include", _LIBTORCH_PCH_INCLUDE[kind], "-Winvalid-pch"]

def _pch_deps(kind):
    return [] if kind == None else [_LIBTORCH_PCH_TARGET[kind]]

def _libtorch_pch(kind):
    """The copts and deps that make a target's sources use the header."""
    if kind == None:
        return [], []
    if kind not in ["library", "test", "other"]:
        fail("libtorch_pch = %r: want \"library\", \"test\" or \"other\"" % kind)
    under_sanitize = _LIBTORCH_PCH_TARGET.get(kind) and kind
    copts = select({
        _PCH_SANITIZE: _pch_copts(under_sanitize),
        _PCH_ON: _pch_copts("library"),
        "//conditions:default": [],
    })
    deps = select({
        _PCH_SANITIZE: _pch_deps(under_sanitize),
        _PCH_ON: _pch_deps("library"),
        "//conditions:default": [],
    })
    return copts, deps

def flatparam_cc_library(name, copts = [], deps = [], libtorch_pch = None, **kwargs):
    """A cc_library with the workspace's warnings.

    Args:
      name: the target's name.
      copts: more compiler flags.
      deps: its dependencies.
      libtorch_pch: None, or the kind of its sources that include LibTorch's
        API headers ("library", "test" or "other", see above).
      **kwargs: as for cc_library.
    """
    pch_copts, pch_deps = _libtorch_pch(libtorch_pch)
    native.cc_library(
        name = name,
        copts = FLATPARAM_COPTS + copts + pch_copts,
        deps = deps + pch_deps,
        **kwargs
    )

def flatparam_cc_binary(name, copts = [], deps = [], libtorch_pch = None, **kwargs):
    """A cc_binary with the workspace's warnings; arguments as flatparam_cc_library's."""
    pch_copts, pch_deps = _libtorch_pch(libtorch_pch)
    native.cc_binary(
        name = name,
        copts = FLATPARAM_COPTS + copts + pch_copts,
        deps = deps + pch_deps,
        **kwargs
    )

def flatparam_cc_test(name, copts = [], deps = [], size = "small", libtorch_pch = None, **kwargs):
    """A GoogleTest test linked with gtest_main; small unless told otherwise."""
    pch_copts, pch_deps = _libtorch_pch(libtorch_pch)
    native.cc_test(
        name = name,
        size = size,
        copts = FLATPARAM_COPTS + copts + pch_copts,
        deps = deps + ["@flatparam//third_party:gtest_main"] + pch_deps,
        **kwargs
    )
