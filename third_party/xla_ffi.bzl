"""Repository rule for the XLA FFI headers shipped with jaxlib (no download).

The header directory (the one that holds xla/ffi/api/ffi.h) is, in order:
  1. $FLASHCOMM_XLA_INCLUDE (set it in the environment or with --repo_env=...);
  2. `$PYTHON -c "from jax import ffi; print(ffi.include_dir())"`, PYTHON defaulting to python3.
It is symlinked into the external repository as `include`; the rule is re-run whenever
FLASHCOMM_XLA_INCLUDE, PYTHON or PATH change (or on `bazel sync --configure`).
"""

_ENV_INCLUDE = "FLASHCOMM_XLA_INCLUDE"
_ENV_PYTHON = "PYTHON"
_QUERY = "from jax import ffi; print(ffi.include_dir())"

def _find_include_dir(rctx):
    include = rctx.os.environ.get(_ENV_INCLUDE, "").strip()
    if include:
        return include, "%s=%s" % (_ENV_INCLUDE, include)
    python = rctx.os.environ.get(_ENV_PYTHON, "").strip() or "python3"
    if "/" not in python:
        found = rctx.which(python)
        if found == None:
            fail("xla_ffi: %s not found on PATH; set %s to the XLA FFI include directory " %
                 (python, _ENV_INCLUDE) + "or PYTHON to a Python that has jax installed")
        python = str(found)
    result = rctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail(("xla_ffi: `%s -c '%s'` failed (is jax installed in that Python? set PYTHON to " +
              "one that has it, or %s to the include directory):\n%s") %
             (python, _QUERY, _ENV_INCLUDE, result.stderr))
    return result.stdout.strip(), "%s -c '%s'" % (python, _QUERY)

def _xla_ffi_headers_impl(rctx):
    include, origin = _find_include_dir(rctx)
    path = rctx.path(include)
    if not path.get_child("xla").get_child("ffi").get_child("api").get_child("ffi.h").exists:
        fail("xla_ffi: %s (from %s) has no xla/ffi/api/ffi.h" % (include, origin))
    rctx.symlink(path, "include")
    rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)

xla_ffi_headers = repository_rule(
    implementation = _xla_ffi_headers_impl,
    attrs = {
        "build_file": attr.label(default = Label("//third_party:xla_ffi.BUILD")),
    },
    environ = [_ENV_INCLUDE, _ENV_PYTHON, "PATH"],
    local = True,
)
