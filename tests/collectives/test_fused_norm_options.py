"""psum_add_rms_norm's options are checked at trace time: a bad group size, eps or operand
dtype is a clear error, never a ZeroDivisionError, a silent truncation or a wrong answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc

from jax.sharding import AxisType

from tests.support.meshes import make_mesh


def _call(x, **kw):
    mesh = make_mesh((2,), ("tp",), AxisType.Explicit)
    residual, weight = jnp.zeros_like(x), jnp.ones(x.shape[-1], jnp.float32)

    def body(x, r):
        return fc.psum_add_rms_norm(x, r, weight, "tp", **kw)

    with jax.set_mesh(mesh):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                     out_specs=(P(), P()), check_vma=False))(x, residual)


X = jnp.ones((4, 128), jnp.float32)


@pytest.mark.parametrize("kw, error, match", [
    (dict(out_bits=8, out_group_size=0), ValueError, "out_group_size"),
    (dict(out_bits=8, out_group_size=3.5), TypeError, "out_group_size"),
    (dict(out_bits=8, out_group_size="128"), TypeError, "out_group_size"),
    (dict(eps="1e-5"), TypeError, "eps must be a real number"),
    (dict(eps=True), TypeError, "eps must be a real number"),
    (dict(eps=float("nan")), ValueError, "eps must be finite"),
    (dict(eps=-1.0), ValueError, "eps must be finite"),
])
def test_bad_options_raise_at_trace_time(kw, error, match):
    with pytest.raises(error, match=match):
        _call(X, bits=None, **kw)


def test_a_traced_eps_is_a_clear_error():
    mesh = make_mesh((2,), ("tp",), AxisType.Explicit)
    with jax.set_mesh(mesh), pytest.raises(TypeError, match="eps must be a Python or NumPy"):
        jax.jit(lambda e: jax.shard_map(
            lambda x: fc.psum_add_rms_norm(x, x, jnp.ones(128), "tp", eps=e, bits=None),
            mesh=mesh, in_specs=P(), out_specs=(P(), P()), check_vma=False)(X))(1e-5)


@pytest.mark.parametrize("bits", [None, 8])
def test_an_integer_operand_is_refused_on_every_path(bits):
    with pytest.raises(TypeError, match="must be a float array"):
        _call(jnp.ones((4, 128), jnp.int32), bits=bits)


def test_numpy_scalars_are_accepted():
    out, _ = _call(X, bits=None, eps=np.float32(1e-5), out_bits=8, out_group_size=np.int64(64))
    assert out.codes.shape[0] > 0


def test_a_concrete_0d_float_array_is_an_eps():
    out, _ = _call(X, bits=None, eps=jnp.float32(1e-5))
    np.testing.assert_allclose(np.asarray(out), np.ones((4, 128)), rtol=1e-5)
