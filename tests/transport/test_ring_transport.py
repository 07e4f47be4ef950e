"""The p2p ring steps (start / done FFI calls) give the xla transport's bits: all_gather_matmul
(plain, bidirectional, quantized through the jnp and the FFI codec), matmul_reduce_scatter
(plain, bidirectional) and tp_attention on 2, 4 and 8 devices, 1-D, 2-D and 3-D meshes, one
axis, several, tuple orders; values and gradients. 1000 calls in a row; a missing peer is a
Python exception within the timeout; XLA sees start -> dot -> done as data dependences."""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import tp_attention
from jax_flashcomm.transport import ring_steps

from tests.support.meshes import make_mesh

# (mesh shape, names, ring axes, gradients of): values of every op everywhere; gradients of
# every op on rings of 2 and 4 (a tuple, 3-D), of the one-way ops on the ring of 8 (a tuple,
# 2-D), which keeps the test's compile time in bounds.
ONE_WAY = ("ag", "ag_int8", "rs", "attn")
MESHES = (
    ((2,), ("i",), ("i",), "all"),
    ((4,), ("i",), ("i",), None),
    ((8,), ("i",), ("i",), None),
    ((2, 4), ("a", "b"), ("a",), None),
    ((2, 4), ("a", "b"), ("b",), None),
    ((2, 4), ("a", "b"), ("b", "a"), ONE_WAY),
    ((2, 2, 2), ("a", "b", "c"), ("c", "a"), "all"),
)
M, K, N = 6, 32, 8  # rows per rank (odd halves for the bidirectional rings), contraction, cols
HEADS, HEAD_DIM, D_MODEL, SEQ = 2, 4, 16, 4


def _ops(ax, n, transport):
    """name -> f(x, w) on local shards, every ring variant."""
    t = dict(transport=transport, p2p_timeout_ms=30_000)
    return {
        "ag": lambda x, w: fc.all_gather_matmul(x, w, ax, **t),
        "ag_bidi": lambda x, w: fc.all_gather_matmul(x, w, ax, bidirectional=True, **t),
        "ag_int8": lambda x, w: fc.all_gather_matmul(x, w, ax, bits=8, group_size=32, rotation=0,
                                                  min_bytes=0, **t),
        "ag_int4_ffi_bidi": lambda x, w: fc.all_gather_matmul(
            x, w, ax, bits=4, group_size=32, backend="ffi", rotation=1, spikes=1,
            bidirectional=True, **t),
        "rs": lambda x, w: fc.matmul_reduce_scatter(jnp.tile(x, (n, 1)), w, ax, **t),
        "rs_bidi": lambda x, w: fc.matmul_reduce_scatter(jnp.tile(x, (n, 1)), w, ax,
                                                        bidirectional=True, **t),
    }


def _attention(ax, transport, bidirectional):
    def f(x, w):
        xs = x[: SEQ].reshape(1, SEQ, -1)[..., :D_MODEL]
        w_qkv = jnp.tile(w[:D_MODEL, :], (1, 3 * HEADS * HEAD_DIM // N))
        w_o = w[: HEADS * HEAD_DIM, :].repeat(2, axis=1)
        return tp_attention(xs, w_qkv, w_o, ax, num_heads=HEADS,
                            bidirectional=bidirectional, transport=transport)
    return f


@functools.lru_cache(maxsize=None)
def _program(mesh, axes, transport, grads="all"):
    """Every op's value and the gradients w.r.t. x and w of the ops named in ``grads`` ("all",
    a tuple of names, or None) on one transport, one jitted program."""
    names = mesh.axis_names
    ax = axes if len(axes) > 1 else axes[0]
    n = int(np.prod([mesh.shape[a] for a in axes]))
    fns = dict(_ops(ax, n, transport))
    fns["attn"] = _attention(ax, transport, False)
    fns["attn_bidi"] = _attention(ax, transport, True)

    def body(xw):
        x = xw[0, :M, :K]
        w = xw[0, :K, K:K + N]
        out = []
        for name, f in fns.items():
            out.append(f(x, w))
            if grads == "all" or (grads and name in grads):
                loss = lambda x_, w_: jnp.sum(jnp.sin(f(x_, w_)) * 1.5)  # noqa: E731, B023
                out += jax.grad(loss, argnums=(0, 1))(x, w)
        return tuple(o[None] for o in out)

    n_grads = len(fns) if grads == "all" else len([k for k in fns if grads and k in grads])
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                 out_specs=(P(names),) * (len(fns) + 2 * n_grads)))


def _operands(mesh):
    xw = jax.random.normal(jax.random.key(7), (mesh.size, K, K + N), jnp.float32)
    return jax.device_put(xw, NamedSharding(mesh, P(mesh.axis_names)))


@pytest.mark.parametrize("mesh_shape,names,axes,grads", MESHES,
                         ids=["x".join(map(str, m)) + "-" + "".join(a) + ("-grad" if g else "")
                              for m, _, a, g in MESHES])
def test_p2p_ring_bit_identical_to_xla(mesh_shape, names, axes, grads):
    mesh = make_mesh(mesh_shape, names, jax.sharding.AxisType.Explicit)
    xw = _operands(mesh)
    xla = [np.asarray(o) for o in _program(mesh, axes, "xla", grads)(xw)]
    p2p_ = [np.asarray(o) for o in _program(mesh, axes, "p2p", grads)(xw)]
    for i, (a, b) in enumerate(zip(xla, p2p_, strict=True)):
        assert a.shape == b.shape and np.abs(a).max() > 0, i
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i
    _no_steps_left()


def test_p2p_ring_auto_mesh():
    """The same on Auto axes (the conftest's other axis type), one mesh."""
    mesh = make_mesh((2,), ("i",), jax.sharding.AxisType.Auto)
    xw = _operands(mesh)
    xla = [np.asarray(o) for o in _program(mesh, ("i",), "xla")(xw)]
    p2p_ = [np.asarray(o) for o in _program(mesh, ("i",), "p2p")(xw)]
    assert all(np.array_equal(a, b) for a, b in zip(xla, p2p_, strict=True))


def _hlo(mesh, op, transport, bidirectional):
    t = dict(transport=transport, bidirectional=bidirectional)
    if op == "ag":
        body = lambda x, w: fc.all_gather_matmul(x, w, "i", **t)  # noqa: E731
        specs, shapes = (P("i"), P(None, "i")), ((4 * M, K), (K, 4 * N))
    else:
        body = lambda x, w: fc.matmul_reduce_scatter(x, w, "i", **t)  # noqa: E731
        specs, shapes = (P(None, "i"), P("i")), ((4 * M, 4 * K), (4 * K, N))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("i")))
    args = [jax.device_put(jnp.ones(s), NamedSharding(mesh, p)) for s, p in zip(shapes, specs)]
    return f.lower(*args).compile().as_text()


def _graph(text):
    """name -> (opcode text, operand names, site attribute) of every HLO instruction."""
    nodes = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?\b([\w\-]+)\(([^\n]*)$", text,
                         re.M):
        name, opcode, rest = m.groups()
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        target = re.search(r'custom_call_target="(\w+)"', rest)
        site = re.search(r"site = (\d+)", rest)
        nodes[name] = (target.group(1) if target else opcode, operands,
                       int(site.group(1)) if site else None)
    return nodes


def _ancestors(nodes, name, seen=None):
    seen = set() if seen is None else seen
    for o in nodes.get(name, (None, []))[1]:
        if o not in seen:
            seen.add(o)
            _ancestors(nodes, o, seen)
    return seen


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_start_dot_done_are_data_dependent(op, bidirectional):
    """In the compiled module every step is start -> dot -> done by data: the done's `after`
    operand (the step's dot, or the other direction's done passing it on) depends on the
    start of the same step, and the done takes that start's receive buffer; so XLA can
    neither drop the pair nor run the dot outside it. No collective-permute is left."""
    mesh = make_mesh((4,), ("i",), jax.sharding.AxisType.Explicit)
    text = _hlo(mesh, op, "p2p", bidirectional)
    assert "collective-permute" not in text
    assert "collective-permute" in _hlo(mesh, op, "xla", bidirectional)
    nodes = _graph(text)
    starts = {site: name for name, (kind, _, site) in nodes.items()
              if kind == "flashcomm_p2p_ring_start"}
    dones = [(name, ops, site) for name, (kind, ops, site) in nodes.items()
             if kind == "flashcomm_p2p_ring_done"]
    assert len(dones) == len(starts) == 3 * (2 if bidirectional else 1)
    for name, operands, site in dones:
        recv, _sent, after = operands[:3]
        assert starts[site] in _ancestors(nodes, recv), name
        assert starts[site] in _ancestors(nodes, after) | {after}, name
        dots = [a for a in _ancestors(nodes, after) | {after}
                if nodes.get(a, ("",))[0] in ("fusion", "dot")]
        assert any(starts[site] in _ancestors(nodes, d) for d in dots), name


def test_thousand_calls():
    """1000 ring matmuls in a row in one program (4 devices, 3 steps each, each result feeding
    the next call), equal to xla's; nothing left in progress."""
    mesh = make_mesh((4,), ("i",), jax.sharding.AxisType.Explicit)

    def looped(transport):
        def body(x, w):
            def step(_, y):
                out = fc.matmul_reduce_scatter(jnp.tile(y, (4, 1)), w, "i", transport=transport,
                                               bidirectional=True)
                return jnp.tanh(out[:, :K] if out.shape[1] >= K else y + out.sum())

            return lax.fori_loop(0, 1000, step, x)

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")),
                                  out_specs=P("i")))
        x = jax.random.normal(jax.random.key(8), (4 * M, K))
        w = jax.random.normal(jax.random.key(9), (4 * K, K)) / 8
        return np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("i"))),
                            jax.device_put(w, NamedSharding(mesh, P("i")))))

    assert np.array_equal(looped("xla"), looped("p2p"))
    _no_steps_left()


def test_missing_peer_raises_within_timeout():
    """Rank 0 skips the ring (a branch on its index): the others fail after the timeout with
    an error naming it, as a Python exception; nothing stays in progress."""
    mesh = make_mesh((4,), ("i",), jax.sharding.AxisType.Explicit)

    def body(x, w):
        ring_mm = lambda v: fc.all_gather_matmul(v, w, "i", transport="p2p",  # noqa: E731
                                                 p2p_timeout_ms=1500)
        skip = lambda v: lax.pcast(jnp.zeros((4 * M, N)), "i", to="varying")  # noqa: E731
        return lax.cond(lax.axis_index("i") == 0, skip, ring_mm, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P(None, "i")),
                              out_specs=P(None, "i")))
    x = jax.device_put(jnp.ones((4 * M, K)), NamedSharding(mesh, P("i")))
    w = jax.device_put(jnp.ones((K, 4 * N)), NamedSharding(mesh, P(None, "i")))
    start = time.monotonic()
    with pytest.raises(Exception, match=r"timed out.*missing: rank 0"):
        np.asarray(f(x, w))
    assert time.monotonic() - start < 1.5 + 10
    _no_steps_left()


def test_bad_options_are_errors():
    mesh = make_mesh((2,), ("i",), jax.sharding.AxisType.Explicit)
    x = jax.device_put(jnp.ones((2 * M, K)), NamedSharding(mesh, P("i")))
    w = jax.device_put(jnp.ones((K, 2 * N)), NamedSharding(mesh, P(None, "i")))

    def lower(**kw):
        f = jax.shard_map(lambda x, w: fc.all_gather_matmul(x, w, "i", **kw), mesh=mesh,
                          in_specs=(P("i"), P(None, "i")), out_specs=P(None, "i"))
        return jax.jit(f).lower(x, w)

    with pytest.raises(ValueError, match="transport must be one of"):
        lower(transport="nccl")
    with pytest.raises(ValueError, match="p2p_timeout_ms must be a positive int"):
        lower(transport="p2p", p2p_timeout_ms=0)
    with pytest.raises(ValueError, match="bytes_per_s must be positive"):
        with ring_steps.link_emulation(0):
            pass


def test_link_emulation_paces_and_records():
    """A paced link takes at least bytes / rate per move, and the timeline records every move
    (sender -> receiver, bytes) and every rank's start and wait."""
    mesh = make_mesh((2,), ("i",), jax.sharding.AxisType.Explicit)
    rows, k = 256, 256  # 256 KiB chunks at 25 MB/s: >= 10.5 ms per move
    rate = 25e6
    f = jax.jit(jax.shard_map(
        lambda x, w: fc.all_gather_matmul(x, w, "i", transport="p2p"), mesh=mesh,
        in_specs=(P("i"), P(None, "i")), out_specs=P(None, "i")))
    x = jax.device_put(jnp.ones((2 * rows, k)), NamedSharding(mesh, P("i")))
    w = jax.device_put(jnp.ones((k, 2 * N)), NamedSharding(mesh, P(None, "i")))
    with ring_steps.link_emulation(rate):  # read when traced: the first call is inside
        jax.block_until_ready(f(x, w))
    with ring_steps.recording() as events:
        jax.block_until_ready(f(x, w))
    moves = [e for e in events if e["kind"] == "move"]
    assert sorted((e["peer"], e["rank"]) for e in moves) == [(0, 1), (1, 0)]
    for e in moves:
        assert e["bytes"] == rows * k * 4
        assert e["end_us"] - e["begin_us"] >= 0.95 * e["bytes"] / rate * 1e6
    assert sorted(e["rank"] for e in events if e["kind"] == "start") == [0, 1]
    assert sorted(e["rank"] for e in events if e["kind"] == "wait") == [0, 1]


def _no_steps_left(within_s: float = 5.0):
    deadline = time.monotonic() + within_s
    while ring_steps.steps_in_progress() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ring_steps.steps_in_progress() == 0
