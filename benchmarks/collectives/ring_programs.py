"""The programs of ``benchmarks.collectives.matmul_overlap_p2p``, per ring op: the ring matmul
on the p2p transport (and the xla one), the same dots alone, the same moves alone, and the moves
then the dots (unfused); each ``loops`` calls in one program.

Imports jax: import it after the benchmark has set ``XLA_FLAGS``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import transport
from jax_flashcomm.config import auto_rotation, auto_spikes
from jax_flashcomm.transport import ring_steps, wire


def looped(op, out_shape, loops):
    """L calls of ``op(x, w)`` in a fori_loop, each iteration's x depending on the last result
    (so no call is hoisted out of the loop or overlapped with the next)."""
    def f(x, w):
        def body(_, c):
            x, _ = c
            out = op(x, w)
            return x + 0.0 * out[: x.shape[0], : x.shape[1]].sum(), out

        out = lax.pcast(jnp.zeros(out_shape, x.dtype), "i", to="varying")
        return lax.fori_loop(0, loops, body, (x, out))[1]
    return f


def gather(p, steps, shift=1):
    """``p`` and the ``steps`` chunks that follow it round the ring, moved one after the other
    over p2p (each move starts from the chunk the last one brought); the local chunk comes back
    through the last done, so whatever reads it waits for every move."""
    link = transport.by_name("p2p").ring_link(ring_steps.spec("p2p", 60_000), "i", {})
    chunks, local = [], p
    for _ in range(steps):
        sent, pending = link.begin(p, shift)
        p, local = link.finish(pending, local)
        chunks.append(p)
    return [local] + chunks


def two_way(p, steps):
    """Bidirectional: the halves of ``p`` go opposite ways round the ring."""
    h = p.shape[0] // 2
    return [jnp.concatenate([a, b]) for a, b in
            zip(gather(p[:h], steps, 1), gather(p[h:], steps, -1), strict=True)]


def put(value, sharding):
    """``value`` (the same on every process) placed with ``sharding``."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class RingPrograms:
    """The programs of one op of ``OPS`` (``ag``, ``ag_bidi``, ``ag_int8``, ``rs``, ``rs_bidi``)
    on ``mesh`` (axis ``"i"``), per rank ``shape = (M, K, NCOL)``."""

    def __init__(self, op: str, mesh, loops: int, shape):
        self.mesh, self.loops, self.n = mesh, loops, mesh.size
        self.m, self.k, self.ncol = shape
        self.ag, self.bidi = op.startswith("ag"), op.endswith("bidi")
        self.bits = 8 if op == "ag_int8" else None
        # The int8 ring's codec options, given to the ring and to the baselines alike: the
        # defaults "auto" resolves to at 8 bits (Hadamard rotation, no spikes).
        self.quant = dict(bits=8, group_size=128, rotation=auto_rotation((8,), 128),
                          spikes=auto_spikes(8, 128))
        n, m, k, ncol = self.n, self.m, self.k, self.ncol
        if self.ag:
            self.xs, self.ws, self.in_specs = (n * m, k), (k, n * ncol), (P("i"), P(None, "i"))
            self.out_local = (n * m, ncol)
        else:
            self.xs, self.ws, self.in_specs = (n * m, n * k), (n * k, ncol), (P(None, "i"), P("i"))
            self.out_local = (m, ncol)

    def sm(self, body):
        return jax.jit(jax.shard_map(looped(body, self.out_local, self.loops), mesh=self.mesh,
                                     in_specs=self.in_specs, out_specs=P("i")))

    def ring_op(self, transport):
        # int8: min_bytes=0, the quantized ring at any size; else bits=None, the exact ring
        # (neither left to the automatic choice)
        if self.ag:
            options = {**self.quant, "min_bytes": 0} if self.bits else {"bits": None}
            return lambda x, w: fc.all_gather_matmul(x, w, "i", bidirectional=self.bidi,
                                                     transport=transport, **options)
        return lambda x, w: fc.matmul_reduce_scatter(x, w, "i", bidirectional=self.bidi,
                                                     bits=None, transport=transport)

    def payload(self, x):
        """What one step moves: the chunk (or its codec payload), or a block."""
        if self.bits:
            return wire.pack_tree(fc.codec.quantize(x, **self.quant))
        return x if self.ag else jnp.zeros((self.m, self.ncol), x.dtype) + x[0, 0]

    def dots(self, x, w):
        """Every dot of the ring (and codec call), no communication. The codec as the ring
        runs it (backend="auto"): the FFI quantize, the jnp decode."""
        n = self.n
        if self.ag and self.bits:  # quantize once, dequantize every chunk, as the ring does
            q = fc.codec.quantize(x, **self.quant)
            return jnp.concatenate([  # codes + k: n payloads, n dequantizes
                fc.codec.dequantize(dataclasses.replace(q, codes=q.codes + jnp.uint8(k)),
                                    dtype=x.dtype, backend="jnp") @ w for k in range(n)])
        if self.ag:
            return jnp.concatenate([(x + k) @ w for k in range(n)])
        return sum(lax.dynamic_slice_in_dim(x, k * self.m, self.m) @ w for k in range(n))

    def moved(self, p):
        return two_way(p, self.n - 1) if self.bidi else gather(p, self.n - 1)

    def comm(self, x, w):
        """The moves of the ring alone."""
        chunks = self.moved(self.payload(x))
        return jnp.zeros(self.out_local, x.dtype) + sum(c.reshape(-1)[0] for c in chunks)

    def unfused_p2p(self, x, w):
        """The same moves, and the dots before (rs) or after (ag) them."""
        if self.ag:
            chunks = self.moved(self.payload(x))
            if self.bits:
                like = fc.codec.quantize(x, **self.quant)
                shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
                chunks = [fc.codec.dequantize(wire.unpack_tree(c, shapes), dtype=x.dtype,
                                              backend="jnp") for c in chunks]
            return jnp.concatenate(chunks) @ w
        m = self.m
        full = x @ w  # one dot, then the reduce-scatter ring of its blocks
        acc = full[:m]
        for k in range(1, self.n):
            acc = self.moved(acc)[-1] + full[k * m:(k + 1) * m]
        return acc

    def unfused_xla(self, x, w):
        if self.ag:
            return lax.all_gather(x, "i", tiled=True) @ w
        return lax.psum_scatter(x @ w, "i", scatter_dimension=0, tiled=True)

    def programs(self) -> dict:
        """``{name: jitted program}``: compute, comm, unfused, ring (p2p); in one process also
        the xla transport's unfused and ring."""
        progs = {"compute": self.sm(self.dots), "comm": self.sm(self.comm),
                 "unfused": self.sm(self.unfused_p2p), "ring": self.sm(self.ring_op("p2p"))}
        if jax.process_count() == 1:
            progs.update({"xla unfused": self.sm(self.unfused_xla),
                          "xla ring": self.sm(self.ring_op("xla"))})
        return progs

    def operands(self):
        """``(x, w)``, placed as the programs take them."""
        key = jax.random.key(0)
        x = put(jax.random.normal(key, self.xs), NamedSharding(self.mesh, self.in_specs[0]))
        w = put(jax.random.normal(key, self.ws) / 32, NamedSharding(self.mesh, self.in_specs[1]))
        return x, w
