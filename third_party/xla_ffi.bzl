"""Repository rule for the XLA FFI headers (no download).

The header directory (the one that holds xla/ffi/api/ffi.h) is $FLASHCOMM_XLA_INCLUDE when set
(in the environment or with --repo_env=...; an XLA checkout or another jaxlib's include dir),
else the copy vendored in third_party/xla_ffi/include (jaxlib 0.10.2's headers). It is
symlinked into the external repository as `include`.
"""

_ENV_INCLUDE = "FLASHCOMM_XLA_INCLUDE"

def _xla_ffi_headers_impl(rctx):
    include = rctx.os.environ.get(_ENV_INCLUDE, "").strip()
    origin = "%s=%s" % (_ENV_INCLUDE, include)
    if include:
        path = rctx.path(include)
    else:
        path = rctx.path(rctx.attr.vendored).dirname.get_child("include")
        origin = "the vendored copy"
    if not path.get_child("xla").get_child("ffi").get_child("api").get_child("ffi.h").exists:
        fail("xla_ffi: %s (from %s) has no xla/ffi/api/ffi.h" % (path, origin))
    rctx.symlink(path, "include")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)

xla_ffi_headers = repository_rule(
    implementation = _xla_ffi_headers_impl,
    attrs = {
        "build_file": attr.label(default = Label("//third_party:xla_ffi.BUILD")),
        "vendored": attr.label(default = Label("//third_party:xla_ffi/README.md")),
    },
    environ = [_ENV_INCLUDE],
    local = True,
)
