"""Meshes for the tests (the ``mesh_factory`` fixture of tests/conftest.py builds them)."""

import jax


def make_mesh(shape, names, axis_type):
    """A mesh over the first prod(shape) CPU devices with one axis type for all axes."""
    n = 1
    for size in shape:
        n *= size
    return jax.make_mesh(
        shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices()[:n]
    )
