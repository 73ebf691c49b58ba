"""GCC precompiled headers, built by the C++ toolchain's own compile action.

`cc_pch` compiles one header (`-x c++-header`) with `cc_common.compile`, so
the precompiled header gets exactly the flags of an ordinary source file in
the same package and configuration: the toolchain's, `--copt`, the rule's
`copts`, its deps' defines and `--per_file_copt` (applied to the generated
source, named after `include_name` with `.cc` in place of `.h`). A target
uses it by depending on it and compiling with
`-include <include_name> -Winvalid-pch`: GCC then finds `<include_name>.gch`
beside the header's link, and takes the precompiled state instead of parsing
the header whenever the flags agree. Where they do not, GCC parses the real
header (the same code, only slower), and `-Winvalid-pch` says why (with
`-Werror`, a build failure). GCC does not check every flag: it takes a
header whose sanitizer flags differ, so tools/pch_flags_check.py compares
the flags of each user with its header's (tools/bazel/defs.bzl).

Compilers other than GCC look for other file names, so they never see the
`.gch`: they parse the header, and only the time spent building it is lost.

`precompiled_headers_flag` is a boolean command-line flag
(`--//tools/bazel:precompiled_headers`) that turns the use on.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _cc_pch_impl(ctx):
    if not ctx.attr.include_name.endswith(".h"):
        fail("include_name %r must end in .h" % ctx.attr.include_name)
    cc_toolchain = find_cpp_toolchain(ctx)
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    include_name = ctx.attr.include_name
    folder = ctx.label.name + "/"
    header = ctx.actions.declare_file(folder + include_name)
    ctx.actions.symlink(output = header, target_file = ctx.file.hdr)

    # Named like a source file so that --per_file_copt patterns match it as
    # they match the sources that use it.
    source = ctx.actions.declare_file(folder + include_name[:-len(".h")] + ".cc")
    ctx.actions.symlink(output = source, target_file = ctx.file.hdr)
    _, outputs = cc_common.compile(
        name = ctx.label.name,
        actions = ctx.actions,
        feature_configuration = feature_configuration,
        cc_toolchain = cc_toolchain,
        srcs = [source],
        compilation_contexts = [dep[CcInfo].compilation_context for dep in ctx.attr.deps],
        user_compile_flags = ["-x", "c++-header"] + ctx.attr.copts,
    )

    # One object: position-independent wherever the sources are (this
    # workspace builds with --force_pic).
    objects = outputs.pic_objects or outputs.objects
    gch = ctx.actions.declare_file(folder + include_name + ".gch")
    ctx.actions.symlink(output = gch, target_file = objects[0])
    return [
        CcInfo(compilation_context = cc_common.create_compilation_context(
            headers = depset([header, gch]),
            quote_includes = depset([header.dirname]),
        )),
        DefaultInfo(files = depset([gch])),
    ]

cc_pch = rule(
    implementation = _cc_pch_impl,
    doc = "A GCC precompiled header: `<include_name>` and `<include_name>.gch` on the quote include path.",
    attrs = {
        "hdr": attr.label(allow_single_file = [".h"], mandatory = True, doc = "The header to precompile."),
        "include_name": attr.string(mandatory = True, doc = "The name users pass to -include; unique among the precompiled headers one target can see."),
        "copts": attr.string_list(doc = "The copts of the targets that use it (warning flags aside, they must match)."),
        "deps": attr.label_list(providers = [CcInfo], doc = "The libraries whose headers it includes."),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    incompatible_use_toolchain_transition = True,
)

def _flag_impl(_ctx):
    return []

precompiled_headers_flag = rule(
    implementation = _flag_impl,
    doc = "A boolean flag set on the command line (--//pkg:name, --no//pkg:name).",
    build_setting = config.bool(flag = True),
)
