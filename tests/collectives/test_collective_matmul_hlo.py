"""The compiled HLO of the rings: what is sent, and what may run concurrently with what.

Checked on the module XLA:CPU compiles (after fusion and scheduling):
* the number of collective-permutes (N-1 per ring, 2(N-1) bidirectional), and no all-gather,
  reduce-scatter, all-reduce or all-to-all anywhere (forward and backward);
* every collective-permute can overlap a dot: there is a matching of permutes to distinct dots
  such that neither depends on the other. In particular no step's dot depends on the permute
  issued in the same step (that permute is matched to it);
* all-gather-matmul: the k-th dot depends on exactly k permutes (local chunk first, then one
  chunk per step); matmul-reduce-scatter: no dot depends on any permute, so after the last
  permute there is only an add (no tail).
"""

import re

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm import all_gather_matmul, matmul_reduce_scatter

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def _parse(hlo: str):
    """{computation: {instruction: (opcode, operands, called computations, result type)}}."""
    comps, cur = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            cur = comps.setdefault(("ENTRY " if line.startswith("ENTRY") else "") + head[1], {})
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\((.*)$", line)
        if cur is None or not m:
            continue
        name, rtype, opcode, rest = m.groups()
        depth, i = 1, 0
        while depth and i < len(rest):  # operands: up to the matching parenthesis
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        operands = re.findall(r"%([\w.\-]+)", rest[: i - 1])
        called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", rest[i:])
        cur[name] = (opcode, operands, called, rtype)
    return comps


def _analyse(hlo: str):
    comps = _parse(hlo)
    (entry,) = [c for name, c in comps.items() if name.startswith("ENTRY ")]

    def has_dot(comp_name, seen=()):
        for opcode, _, called, _ in comps.get(comp_name, {}).values():
            if opcode in ("dot", "convolution"):
                return True
            if any(c not in seen and has_dot(c, seen + (c,)) for c in called):
                return True
        return False

    def is_dot(inst):
        opcode, _, called, _ = entry[inst]
        return opcode in ("dot", "convolution") or (
            opcode == "fusion" and any(has_dot(c) for c in called))

    ancestors = {}

    def anc(inst):
        if inst not in ancestors:
            out = set()
            for op in entry[inst][1]:
                if op in entry:
                    out |= {op} | anc(op)
            ancestors[inst] = out
        return ancestors[inst]

    for inst in entry:
        anc(inst)
    permutes = [i for i, v in entry.items() if v[0] in ("collective-permute",
                                                        "collective-permute-start")]
    dots = [i for i in entry if is_dot(i)]
    others = [v[0] for c in comps.values() for v in c.values()
              if any(v[0].startswith(k) for k in COLLECTIVES)]
    return entry, ancestors, permutes, dots, others


def _overlap_matching(ancestors, permutes, dots) -> dict:
    """A maximum matching permute -> dot with neither depending on the other."""
    free = {p: [d for d in dots if p not in ancestors[d] and d not in ancestors[p]]
            for p in permutes}
    match = {}  # dot -> permute

    def augment(p, seen):
        for d in free[p]:
            if d not in seen:
                seen.add(d)
                if d not in match or augment(match[d], seen):
                    match[d] = p
                    return True
        return False

    for p in permutes:
        augment(p, set())
    return {p: d for d, p in match.items()}


def _compiled(fn, mesh, x, w, in_specs, out_spec, grad=False):
    """The compiled module of fn, or of (value, dx, dw) for a cotangent argument if grad."""
    sm = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)

    def value_and_vjp(a, b, ct):
        y, vjp = jax.vjp(sm, a, b)
        return (y,) + vjp(ct)

    with jax.set_mesh(mesh):
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs)]
        if not grad:
            return jax.jit(sm).lower(*args).compile().as_text()
        ct = jax.eval_shape(sm, *args)
        ct = jax.ShapeDtypeStruct(ct.shape, ct.dtype, sharding=NamedSharding(mesh, out_spec))
        return jax.jit(value_and_vjp).lower(*args, ct).compile().as_text()


def _case(op, n, bidirectional, **kw):
    if op == "ag":
        x, w = np.ones((n * 8, 32), np.float32), np.ones((32, n * 16), np.float32)
        specs = (P("i", None), P(None, "i")), P(None, "i")
        fn = lambda a, b: all_gather_matmul(a, b, "i", bidirectional=bidirectional, **kw)  # noqa
    else:
        x, w = np.ones((n * 8, n * 16), np.float32), np.ones((n * 16, 32), np.float32)
        specs = (P(None, "i"), P("i", None)), P("i", None)
        fn = lambda a, b: matmul_reduce_scatter(a, b, "i", bidirectional=bidirectional)  # noqa
    return fn, x, w, specs


@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bidi"])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_forward_schedule_allows_overlap(mesh_factory, op, n, bidirectional):
    mesh = mesh_factory((n,), ("i",))
    fn, x, w, (in_specs, out_spec) = _case(op, n, bidirectional)
    _, ancestors, permutes, dots, others = _analyse(
        _compiled(fn, mesh, x, w, in_specs, out_spec))
    assert others == [], f"unexpected collectives {others}"
    rings = 2 if bidirectional else 1
    assert len(permutes) == rings * (n - 1)
    match = _overlap_matching(ancestors, permutes, dots)
    assert len(match) == len(permutes), f"permutes with no dot to overlap: {set(permutes) - set(match)}"
    depth = sorted(len(ancestors[d] & set(permutes)) for d in dots)
    if op == "ag":  # local chunk first, then the chunk that k permutes brought here
        want = [0] + [k for k in range(1, n) for _ in range(rings)]
        assert depth == want
    else:  # partial products never wait on the network: the last step is only an add
        assert depth == [0] * len(dots) and len(dots) == (n if not bidirectional else 2 * n - 1)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_backward_is_the_other_ring(mesh_factory, op):
    """value + vjp compile to the forward ring plus the transposed ring: 2(N-1) permutes, no
    all-gather/reduce-scatter, every permute overlappable, 2N + 1 dots (N per ring, one for dw
    from the gathered chunks)."""
    n = 4
    mesh = mesh_factory((n,), ("i",))
    fn, x, w, (in_specs, out_spec) = _case(op, n, False)
    _, ancestors, permutes, dots, others = _analyse(
        _compiled(fn, mesh, x, w, in_specs, out_spec, grad=True))
    assert others == [], f"unexpected collectives {others}"
    assert len(permutes) == 2 * (n - 1)
    assert len(dots) == 2 * n + 1
    assert len(_overlap_matching(ancestors, permutes, dots)) == len(permutes)


def test_quantized_sends_one_uint8_buffer_per_step(mesh_factory):
    n = 4
    mesh = mesh_factory((n,), ("i",))
    fn, x, w, (in_specs, out_spec) = _case("ag", n, False, bits=4, group_size=32, spikes=0,
                                                min_bytes=0)
    entry, ancestors, permutes, dots, others = _analyse(
        _compiled(fn, mesh, x, w, in_specs, out_spec))
    assert others == [] and len(permutes) == n - 1
    # 8 x 32 f32 = 1024 bytes -> 256 / 32 = 8 groups: 128 bytes of codes + 8 * 4 of scale/zero
    assert {entry[p][3].split("{")[0] for p in permutes} == {"u8[160]"}
    assert len(_overlap_matching(ancestors, permutes, dots)) == len(permutes)


def test_detector_sees_the_unfused_collectives(mesh_factory):
    """The reference pairs compile to all-gather / reduce-scatter and no permute, so the
    assertions above can fail."""
    mesh = mesh_factory((4,), ("i",))
    for op, ref in (("ag", lambda a, b: lax.all_gather(a, "i", tiled=True) @ b),
                    ("rs", lambda a, b: lax.psum_scatter(a @ b, "i", tiled=True))):
        _, x, w, (in_specs, out_spec) = _case(op, 4, False)
        _, _, permutes, dots, others = _analyse(_compiled(ref, mesh, x, w, in_specs, out_spec))
        assert permutes == [] and len(dots) == 1
        assert others and all(o.startswith("all-gather" if op == "ag" else "reduce-scatter")
                              or o.startswith("all-reduce") for o in others), others
