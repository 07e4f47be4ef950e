"""The p2p transport gives the xla transport's bits: psum, psum_scatter and all_gather on 2, 4
and 8 devices, 1-D, 2-D and 3-D meshes (one axis, several, tuple orders), bits 8/6/4 and
mixed phases, spikes and rotation on and off, f32/bf16/f16, padded shapes, under jit, vmap
and scan, values and quantized gradients; 1000 calls in a row; a peer that never arrives is
a Python exception within the timeout; bad options are errors at trace time."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.transport import p2p

from tests.support.meshes import make_mesh

# (bits, rs_bits, ag_bits, spikes, rotation, dtype): every width, mixed phases, spikes
# auto / 0 / 2, no rotation / Hadamard / signed Hadamard, every operand dtype.
CONFIGS = (
    (8, None, None, 0, 0, jnp.float32),
    (6, None, None, "auto", 0, jnp.bfloat16),
    (4, None, None, 2, 2, jnp.float32),
    (8, 4, 8, "auto", 1, jnp.float16),
    (5, None, None, 0, 2, jnp.bfloat16),
)
TRANSFORMED = (1, 2)  # the configs also run under vmap and scan (6-bit spiked, 4-bit rotated)
# 2, 4 and 8 ranks per group: 1-D meshes of 2 and 8, one axis of a 2-D mesh (4), a tuple in
# mesh order's reverse, a non-adjacent pair of a 3-D mesh.
MESHES = (
    ((2,), ("i",), ("i",)),
    ((8,), ("i",), ("i",)),
    ((2, 4), ("a", "b"), ("b",)),
    ((2, 4), ("a", "b"), ("b", "a")),
    ((2, 2, 2), ("a", "b", "c"), ("c", "a")),
)
LOCAL = (4, 48)  # 192 values: padded to whole groups (G=32) per chunk for N = 4, 8


def _cfg(bits, rs, ag, spikes, rotation, transport, group_size=32):
    return fc.CommConfig(bits=bits, rs_bits=rs, ag_bits=ag, spikes=spikes, rotation=rotation,
                         group_size=group_size, min_bytes=0, transport=transport,
                         p2p_timeout_ms=30_000)


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


@functools.lru_cache(maxsize=None)
def _program(mesh, axes, transport):
    """Every config's psum / psum_scatter / all_gather (values, vmap, scan) on one transport,
    one jitted program per mesh case and transport (docs/transport.md: a program that mixes
    p2p calls with XLA's own collectives inside one loop can trip XLA:CPU's rendezvous)."""
    names = mesh.axis_names
    ax = axes if len(axes) > 1 else axes[0]
    n = int(np.prod([mesh.shape[a] for a in axes]))

    def ops(v, cfg):
        rows = v.reshape(n, -1)
        return (fc.psum(v, ax, config=cfg),
                fc.psum_scatter(rows, ax, scatter_dimension=0, tiled=True, config=cfg),
                fc.all_gather(v, ax, axis=1, tiled=False, config=cfg))

    def body(xl):
        out = []
        for c, (bits, rs, ag, spikes, rot, dtype) in enumerate(CONFIGS):
            v = xl.reshape(LOCAL).astype(dtype)
            cfg = _cfg(bits, rs, ag, spikes, rot, transport)
            out += ops(v, cfg)
            if c in TRANSFORMED:
                out += jax.vmap(lambda w: ops(w, cfg))(jnp.stack([v, 2 * v]))
                _, scanned = lax.scan(lambda c, w: (c, ops(w, cfg)), 0, jnp.stack([v, -v]))
                out += scanned
        return tuple(o[None] for o in out)

    n_out = 3 * len(CONFIGS) + 6 * len(TRANSFORMED)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                 out_specs=(P(names),) * n_out))


@pytest.mark.parametrize("mesh_shape,names,axes", MESHES,
                         ids=["x".join(map(str, m)) + "-" + "".join(a) for m, _, a in MESHES])
def test_p2p_bit_identical_to_xla(mesh_shape, names, axes):
    # Explicit axes here; test_quantized_gradients_identical and the others run both types.
    mesh = make_mesh(mesh_shape, names, jax.sharding.AxisType.Explicit)
    x = jax.random.normal(jax.random.key(1), (mesh.size, *LOCAL), jnp.float32) * 3
    x = x.at[:, 0, 7].mul(40.0)  # an outlier channel: spikes and rotation matter
    xla = [np.asarray(o) for o in _program(mesh, axes, "xla")(_put(mesh, x))]
    p2p_ = [np.asarray(o) for o in _program(mesh, axes, "p2p")(_put(mesh, x))]
    for i, (a, b) in enumerate(zip(xla, p2p_, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i
    assert p2p.meetings_in_progress() == 0


def test_p2p_is_not_the_xla_program(axis_type):
    """The transports really differ: p2p lowers to its fused custom call and no XLA
    all-to-all, xla to all-to-all and no p2p call (so bit-equality above is not trivial)."""
    mesh = make_mesh((4,), ("i",), axis_type)
    x = _put(mesh, jnp.ones((4, 256), jnp.float32))

    def hlo(transport):
        cfg = _cfg(8, None, None, 0, 0, transport)
        f = jax.jit(jax.shard_map(lambda v: fc.psum(v, "i", config=cfg), mesh=mesh,
                                  in_specs=P("i"), out_specs=P()))
        return f.lower(x).as_text()

    assert "flashcomm_p2p_all_reduce" in hlo("p2p") and "all_to_all" not in hlo("p2p")
    assert "all_to_all" in hlo("xla") and "flashcomm_p2p" not in hlo("xla")


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_quantized_gradients_identical(op, axis_type):
    """grad="quantized": the cotangent collectives (psum's of an operand invariant over the
    axis, psum_scatter's all_gather, all_gather's psum_scatter) run on the chosen transport."""
    mesh = make_mesh((2, 4), ("a", "b"), axis_type)
    x = jax.random.normal(jax.random.key(2), (2, 4, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (4, 64), jnp.float32)

    def grads(transport):
        cfg = dataclass_replace(_cfg(6, None, None, "auto", 0, transport), grad="quantized")

        def loss(v):
            if op == "psum":
                y = fc.psum(v, "b", config=cfg)
            elif op == "psum_scatter":
                y = jnp.tile(fc.psum_scatter(v, "b", tiled=True, config=cfg), (4, 1))
            else:
                y = fc.all_gather(v, "b", tiled=True, config=cfg)[:4]
            return jnp.sum(jnp.sin(y) * w)

        def body(v):  # v is invariant over "b": its cotangent is all-reduced over "b" too
            return jax.grad(loss)(v[0])[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a")))
        return np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("a")))))

    g_xla, g_p2p = grads("xla"), grads("p2p")
    assert np.abs(g_xla).max() > 0
    assert np.array_equal(g_xla, g_p2p)


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_thousand_calls(axis_type):
    """1000 fused calls in a row inside one program (a fori_loop feeding each result into the
    next call) and 1000 dispatches of a program: no hang, no mismatch with xla."""
    mesh = make_mesh((8,), ("i",), axis_type)
    x = _put(mesh, jax.random.normal(jax.random.key(4), (8, 512), jnp.float32))

    def looped(transport):
        cfg = _cfg(8, None, None, 0, 0, transport, group_size=128)

        def body(v):
            def step(_, y):
                y = fc.psum(y * 0.5 + v, "i", config=cfg) / 8
                return lax.pcast(y, "i", to="varying")

            return lax.fori_loop(0, 1000, step, v)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        return np.asarray(f(x))

    assert np.array_equal(looped("xla"), looped("p2p"))

    cfg = _cfg(4, None, None, 2, 2, "p2p", group_size=128)
    f = jax.jit(jax.shard_map(lambda v: fc.psum(v, "i", config=cfg), mesh=mesh,
                              in_specs=P("i"), out_specs=P()))
    first = np.asarray(f(x))
    results = []
    for k in range(1000):
        results.append(f(x))
        if k % 8 == 7:  # bounded depth: see docs/transport.md (XLA:CPU's gang scheduling)
            results[-1].block_until_ready()
    assert all(np.array_equal(np.asarray(r), first) for r in results[-16:])
    assert all(np.array_equal(np.asarray(r), first) for r in results[::97])
    assert p2p.meetings_in_progress() == 0


def test_missing_peer_raises_within_timeout(axis_type):
    """Rank 0 skips the collective (a branch on its index): the other ranks give up after the
    timeout with an error naming it, as a Python exception, and nothing stays in progress."""
    mesh = make_mesh((4,), ("i",), axis_type)
    cfg = _cfg(8, None, None, 0, 0, "p2p")
    cfg = dataclass_replace(cfg, p2p_timeout_ms=1500)

    def body(v):
        return lax.cond(lax.axis_index("i") == 0, lambda w: w,
                        lambda w: fc.psum(w, "i", config=cfg) + 0 * w, v)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    x = _put(mesh, jnp.ones((4, 256), jnp.float32))
    start = time.monotonic()
    with pytest.raises(Exception, match=r"timed out .*missing: rank 0"):
        np.asarray(f(x))
    assert time.monotonic() - start < 1.5 + 10
    _no_meetings_left()


def _no_meetings_left(within_s: float = 5.0):
    """Every call finished (the other devices' failed calls may complete just after the
    exception reaches Python)."""
    deadline = time.monotonic() + within_s
    while p2p.meetings_in_progress() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p2p.meetings_in_progress() == 0


def test_bad_options_are_errors():
    with pytest.raises(ValueError, match="transport must be one of"):
        fc.CommConfig(transport="nccl")
    with pytest.raises(ValueError, match="p2p_timeout_ms"):
        fc.CommConfig(p2p_timeout_ms=0)
    mesh = make_mesh((2,), ("i",), jax.sharding.AxisType.Explicit)
    x = _put(mesh, jnp.ones((2, 256), jnp.float32))
    cfg = _cfg(8, None, None, 0, 0, "p2p")
    jnp_cfg = dataclass_replace(cfg, backend="jnp")
    f = jax.shard_map(lambda v: fc.psum(v, "i", config=jnp_cfg), mesh=mesh, in_specs=P("i"),
                      out_specs=P())
    with pytest.raises(ValueError, match="backend='jnp'"):
        jax.jit(f).lower(x)


def test_partial_manual_mesh(axis_type):
    """Devices along a mesh axis left automatic would claim the same rank: p2p refuses such a
    shard_map at trace time; auto falls back to xla there."""
    mesh = make_mesh((2, 4), ("a", "b"), axis_type)
    x = jax.device_put(jnp.ones((2, 4, 256), jnp.float32), NamedSharding(mesh, P("a", "b")))

    def run(transport):
        cfg = _cfg(8, None, None, 0, 0, transport)
        body = lambda v: fc.psum(v, "b", config=cfg)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=P(None, "b"), out_specs=P(),
                          axis_names={"b"})
        return jax.jit(f)(x)

    with pytest.raises(ValueError, match="not manual"):
        run("p2p")
    if axis_type == jax.sharding.AxisType.Auto:  # (the codec's platform switch rejects a
        # partly manual shard_map over Explicit axes, whatever the transport)
        assert np.asarray(run("auto")).shape == (2, 1, 256)
