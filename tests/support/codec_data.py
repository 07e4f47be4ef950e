"""Test inputs for the codec: groups of every kind the wire format has to survive."""

import numpy as np
import jax.numpy as jnp

KINDS = ("gaussian", "offset", "constant", "huge", "tiny", "denormal", "mixed_sign_spike",
         "zeros", "two_values", "extremes", "lowest")


def group_of_kind(rng, kind, group_size, dtype):
    """One group of ``group_size`` values of ``kind``, representable in ``dtype``."""
    finfo = jnp.finfo(dtype)
    if kind == "gaussian":
        v = rng.standard_normal(group_size) * 3.0 + 0.5
    elif kind == "offset":  # a narrow range far from zero (1000.0 .. 1000.5)
        v = 1000.0 + rng.uniform(0.0, 0.5, group_size)
    elif kind == "constant":
        v = np.full(group_size, rng.standard_normal() * 10)
    elif kind == "huge":  # near the dtype's largest finite value, both signs
        v = rng.uniform(-0.9, 0.9, group_size) * float(finfo.max)
    elif kind == "tiny":  # smallest normals
        v = rng.uniform(1.0, 4.0, group_size) * float(finfo.tiny)
    elif kind == "denormal":
        v = rng.uniform(-1.0, 1.0, group_size) * float(finfo.tiny) * 0.5
    elif kind == "mixed_sign_spike":
        v = rng.standard_normal(group_size) * 0.01
        v[rng.integers(group_size)] = 80.0
    elif kind == "extremes":  # the dtype's largest finite values, both signs
        v = np.where(rng.random(group_size) < 0.5, -1.0, 1.0) * float(finfo.max)
        v[rng.integers(group_size)] = 0.0
    elif kind == "lowest":  # the bottom of the range only (for f32: below the lowest bf16)
        v = -float(finfo.max) * (1.0 - rng.uniform(0, 2e-3, group_size))
    elif kind == "zeros":
        v = np.where(rng.random(group_size) < 0.5, -0.0, 0.0)
    elif kind == "two_values":
        v = np.where(rng.random(group_size) < 0.5, -1.5, 2.25)
    else:
        raise ValueError(kind)
    return np.asarray(v, np.float64)


def structured(rng, n_groups, group_size, dtype, kinds=KINDS):
    """``n_groups`` groups cycling through ``kinds``, as an array of ``dtype``."""
    groups = [group_of_kind(rng, kinds[i % len(kinds)], group_size, dtype)
              for i in range(n_groups)]
    return jnp.asarray(np.concatenate(groups).astype(np.float32)).astype(dtype)


def bit_view(a):
    """An array's bits: uint16 for 2-byte dtypes, uint8 otherwise (for bit-equality asserts)."""
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint8)


def jit_quantize(x, backend, **options):
    """``codec.quantize`` under jit with the given backend."""
    import jax
    from jax_flashcomm import codec

    fn = jax.jit(lambda v: codec.quantize(v, backend=backend, **options))
    return every_isa(fn, x) if backend == "ffi" else fn(x)



def every_isa(fn, *args):
    """``fn(*args)`` (FFI kernels inside) once per instruction-set build of the CPU kernels that
    this CPU runs (avx512 / avx2 / baseline, neon / baseline): asserts that every build gives the
    same bits and returns the result of the first (the best) build. The parity tests call their
    FFI side through this, so each compiled executable runs on every build without being
    compiled again (the kernels are looked up at run time)."""
    import jax
    from jax_flashcomm import codec
    from jax_flashcomm.codec import kernels

    if not kernels.available("cpu") or jax.default_backend() != "cpu":
        return fn(*args)
    results = {}
    for isa in codec.cpu_isas():
        with codec.use_cpu_isa(isa):
            results[isa] = jax.block_until_ready(fn(*args))
    first_isa, first = next(iter(results.items()))
    for isa, result in results.items():
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(result), strict=True):
            np.testing.assert_array_equal(
                bit_view(a), bit_view(b), f"the {isa} and {first_isa} builds differ")
    return first
