"""Bytes on the wire, read from the compiled HLO: per all-reduced bf16 element at G=128,
jax_flashcomm.psum at int8 moves <= 0.52x and at int4 <= 0.28x of lax.psum, counting lax.psum
as a ring all-reduce (2(N-1)/N of its bf16 operand per device). These are the xla transport's
collectives (transport="xla"); the p2p transport reads the same payloads from its peers'
buffers (tests/transport/test_transport.py holds it to the same bits)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from tests.support.wire_bytes import wire_bytes


@pytest.mark.parametrize("n", [4, 8])
def test_wire_bytes_per_element(n):
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    elems = n * 128 * 64  # a multiple of N*G: no padding, the format's steady state
    x = jax.device_put(jnp.ones((n, elems), jnp.bfloat16), NamedSharding(mesh, P("i")))

    def compiled(fn):
        f = jax.jit(jax.shard_map(lambda v: fn(v[0]), mesh=mesh, in_specs=P("i"),
                                  out_specs=P()))
        return f.lower(x).compile().as_text()

    lax_hlo = compiled(lambda v: lax.psum(v, "i"))
    assert "all-reduce" in wire_bytes(lax_hlo, n)
    ring = 2 * (n - 1) / n * elems * 2  # lax.psum as a ring all-reduce of the bf16 operand
    ratios = {}
    for bits, limit in ((8, 0.52), (6, None), (4, 0.28)):
        sent = wire_bytes(compiled(lambda v: fc.psum(v, "i", bits=bits, min_bytes=0, spikes=0,
                                                      transport="xla")), n)
        assert set(sent) == {"all-to-all", "all-gather"}, sent  # exactly the two steps
        total = sum(sent.values())
        ratios[bits] = total / ring
        # the wire format's bytes: two payloads of (G*b/8 + 4) bytes per G values, (N-1)/N each
        expect = 2 * (n - 1) / n * elems * (128 * bits / 8 + 4) / 128
        assert total == pytest.approx(expect, rel=1e-12)
        if limit is not None:
            assert ratios[bits] <= limit, (bits, ratios[bits])
    # the defaults (spikes="auto": one spike per group at <= 6 bits) still meet both targets
    for bits, spikes, limit in ((8, 0, 0.52), (4, 1, 0.28)):
        total = sum(wire_bytes(compiled(lambda v: fc.psum(v, "i", bits=bits, min_bytes=0,
                                                          transport="xla")), n).values())
        assert total == pytest.approx(2 * (n - 1) / n * elems
                                      * fc.codec.wire_bytes_per_element(bits, 128, spikes))
        ratios[f"{bits} default"] = total / ring
        assert total / ring <= limit, (bits, total / ring)
    print(f"N={n}: wire bytes vs lax.psum ring: " +
          ", ".join(f"int{b} {r:.4f}x" for b, r in ratios.items()))


@pytest.mark.parametrize("bits,spikes", [(4, 1), (4, 4), (8, 2)])
def test_wire_bytes_with_spikes(bits, spikes):
    """Spike reserving adds k * 3 bytes per group of 128 (bf16 value + 1-byte position) to each
    phase's payload, and nothing else: the compiled HLO moves exactly that."""
    n = 4
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    elems = n * 128 * 64
    x = jax.device_put(jnp.ones((n, elems), jnp.bfloat16), NamedSharding(mesh, P("i")))
    f = jax.jit(jax.shard_map(
        lambda v: fc.psum(v[0], "i", bits=bits, min_bytes=0, spikes=spikes, transport="xla"),
        mesh=mesh,
        in_specs=P("i"), out_specs=P()))
    sent = wire_bytes(f.lower(x).compile().as_text(), n)
    assert set(sent) == {"all-to-all", "all-gather"}, sent
    expect = 2 * (n - 1) / n * elems * (128 * bits / 8 + 4 + 3 * spikes) / 128
    assert sum(sent.values()) == pytest.approx(expect, rel=1e-12)
    assert expect == pytest.approx(
        2 * (n - 1) / n * elems * fc.codec.wire_bytes_per_element(bits, 128, spikes))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("bits,spikes", [(8, 0), (4, 0), (4, 2)])
def test_all_gather_wire_bytes(n, bits, spikes):
    """The ring all-gather sends each rank's payload N-1 times (one collective-permute per ring
    step, inside a while loop for N > 2): exactly (N-1) payloads per rank, as one all-gather
    of the payloads would."""
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    elems = n * 128 * 64
    x = jax.device_put(jnp.ones((n, 2, elems // 2), jnp.bfloat16), NamedSharding(mesh, P("i")))
    payload = elems // 128 * (128 * bits // 8 + 4 + 3 * spikes)
    for axis, tiled in ((0, True), (1, True), (0, False)):
        f = jax.jit(jax.shard_map(
            lambda v: fc.all_gather(v[0], "i", axis=axis, tiled=tiled, bits=bits, min_bytes=0,
                                    spikes=spikes, transport="xla")[None],
            mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        hlo = f.lower(x).compile().as_text()
        sent = wire_bytes(hlo, n)
        assert set(sent) == {"collective-permute"}, sent
        assert sent["collective-permute"] == (n - 1) * payload, (axis, tiled, sent)
        if n > 2:
            assert " while(" in hlo  # the count above went through the loop's trip count


@pytest.mark.parametrize("rs_bits,ag_bits,spikes,k1,k2", [
    (4, 8, "auto", 1, 0), (8, 4, "auto", 0, 1), (6, 4, "auto", 1, 1), (4, 8, 2, 2, 2)])
def test_wire_bytes_per_phase_spikes(rs_bits, ag_bits, spikes, k1, k2):
    """spikes="auto" is decided per phase: each phase's collective moves its own payload, the
    all-to-all (rs) one with k1 spikes per group, the all-gather (ag) one with k2."""
    n = 4
    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n])
    elems = n * 128 * 64
    x = jax.device_put(jnp.ones((n, elems), jnp.bfloat16), NamedSharding(mesh, P("i")))
    config = fc.CommConfig(bits=8, rs_bits=rs_bits, ag_bits=ag_bits, spikes=spikes, min_bytes=0,
                           transport="xla")
    assert (config.phase1_spikes, config.phase2_spikes) == (k1, k2)
    f = jax.jit(jax.shard_map(lambda v: fc.psum(v[0], "i", config=config), mesh=mesh,
                              in_specs=P("i"), out_specs=P()))
    sent = wire_bytes(f.lower(x).compile().as_text(), n)
    per_phase = {"all-to-all": (rs_bits, k1), "all-gather": (ag_bits, k2)}
    assert set(sent) == set(per_phase), sent
    for kind, (bits, k) in per_phase.items():
        assert sent[kind] == pytest.approx((n - 1) / n * elems * (128 * bits / 8 + 4 + 3 * k)
                                           / 128, rel=1e-12), kind
