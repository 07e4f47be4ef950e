"""Meshes for the tests (the ``mesh_factory`` fixture of tests/conftest.py builds them)."""

import jax

# The two axis types every mesh-using test runs on (the ``axis_type`` fixture's params; a test
# that selects its rows with tests/support/pairwise.py parametrizes ``axis_type`` itself).
AXIS_TYPES = {
    "auto": jax.sharding.AxisType.Auto,
    "explicit": jax.sharding.AxisType.Explicit,
}


def make_mesh(shape, names, axis_type):
    """A mesh over the first prod(shape) CPU devices with one axis type for all axes."""
    n = 1
    for size in shape:
        n *= size
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices()[:n]
    )


#: The meshes the rewrite's pattern tests run on: TP alone, and data x TP.
TP_MESHES = {"tp4": ((4,), ("tp",)), "data2xtp4": ((2, 4), ("data", "tp"))}
