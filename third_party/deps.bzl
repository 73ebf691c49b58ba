"""Offline dependencies of flatparam, for this workspace and for consumers.

A consuming workspace loads this file from `@flatparam` and calls
`flatparam_dependencies()`; nothing is downloaded.
"""

load("//third_party:system_libs.bzl", "cuda_configure", "libtorch_configure", "pkg_config_library", "stand_in_repository")

_ABSL_MODULES = [
    "absl_status",
    "absl_statusor",
    "absl_str_format",
    "absl_strings",
    "absl_span",
    "absl_synchronization",
    "absl_time",
    "absl_flags",
    "absl_flags_parse",
    "absl_flags_usage",
    "absl_hash",
    "absl_raw_hash_set",
    "absl_random_random",
]

def flatparam_dependencies():
    """Declares every external repository flatparam needs; idempotent."""
    if "rules_cc" not in native.existing_rules():
        stand_in_repository(name = "rules_cc", kind = "rules_cc")
    if "rules_java" not in native.existing_rules():
        stand_in_repository(name = "rules_java", kind = "rules_java")
    if "remote_coverage_tools" not in native.existing_rules():
        stand_in_repository(name = "remote_coverage_tools", kind = "remote_coverage_tools")
    if "system_absl" not in native.existing_rules():
        pkg_config_library(name = "system_absl", modules = _ABSL_MODULES)
    if "system_mpi" not in native.existing_rules():
        pkg_config_library(
            name = "system_mpi",
            modules = ["ompi-c"],
            defines = ["OMPI_SKIP_MPICXX=1"],
            optional = True,
        )
    if "local_cuda" not in native.existing_rules():
        cuda_configure(name = "local_cuda")
    if "system_libtorch" not in native.existing_rules():
        libtorch_configure(name = "system_libtorch")
