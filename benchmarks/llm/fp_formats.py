"""FP8 and FP4 group formats simulated in ``jnp`` (numerics only: no kernel runs): FP8 E4M3
values with a bf16 scale per group, MXFP4 / MXFP8 (E2M1 / E4M3 values, an E8M0 power-of-two
scale per 32, the OCP Microscaling spec), NVFP4 (E2M1 values, an E4M3 scale per 16 under an f32
scale per message), optionally after a Hadamard rotation or with spikes kept in bf16; and the
two-phase all-reduce of ``benchmarks.llm.format_probe`` with a format in each phase."""

from __future__ import annotations

import dataclasses

#: Values per group of the spike selection (the codec's default group size).
SPIKE_GROUP = 128
#: E2M1 and E4M3 limits: the largest finite value, and the exponent of the largest power of
#: two an element can hold (OCP MX v1.0, section 6.3: shared scale 2^(floor(log2 amax) - emax)).
E2M1_MAX, E2M1_EMAX = 6.0, 2
E4M3_MAX, E4M3_EMAX = 448.0, 8


@dataclasses.dataclass(frozen=True)
class Format:
    """One phase's simulated format: ``element`` ("e2m1" or "e4m3"), ``scale`` ("e8m0": a power
    of two; "e4m3": an E4M3 scale under an f32 per-message scale, NVFP4's two levels; "bf16":
    amax / element max rounded up to bf16), values per scale ``block``, and a Hadamard rotation
    of ``hadamard`` values (0: none)."""
    name: str
    element: str
    scale: str
    block: int
    hadamard: int = 0
    spikes: int = 0  # values per SPIKE_GROUP kept in bf16 with a 1-byte position

    @property
    def bytes_per_value(self) -> float:
        code = 0.5 if self.element == "e2m1" else 1.0
        return (code + {"e8m0": 1, "e4m3": 1, "bf16": 2}[self.scale] / self.block
                + 3 * self.spikes / SPIKE_GROUP)


FORMATS = {f.name: f for f in (
    Format("fp8", "e4m3", "bf16", 128),
    Format("mxfp8", "e4m3", "e8m0", 32),
    Format("mxfp4", "e2m1", "e8m0", 32),
    Format("mxfp4+h32", "e2m1", "e8m0", 32, 32),
    Format("nvfp4", "e2m1", "e4m3", 16),
    Format("nvfp4+h16", "e2m1", "e4m3", 16, 16),
    Format("nvfp4+h128", "e2m1", "e4m3", 16, 128),
    Format("nvfp4+spike", "e2m1", "e4m3", 16, 0, 1),
    Format("nvfp4+2spikes", "e2m1", "e4m3", 16, 0, 2),
    Format("mxfp4+spike", "e2m1", "e8m0", 32, 0, 1),
)}

def hadamard_matrix(n: int):
    """The orthonormal Walsh-Hadamard matrix of order ``n`` (a power of two), Sylvester's."""
    import numpy as np

    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _cast(x, element: str):
    """``x`` rounded to the nearest element value (ties to even), saturated at its largest."""
    import jax.numpy as jnp

    top, dtype = ((E2M1_MAX, jnp.float4_e2m1fn) if element == "e2m1"
                  else (E4M3_MAX, jnp.float8_e4m3fn))
    return jnp.clip(x, -top, top).astype(dtype).astype(jnp.float32)


def fake_quantize(x, fmt: Format):
    """``x`` (f32, any shape) quantized to ``fmt`` and decoded back, flattened into groups of
    ``fmt.block`` values (zero-padded at the end), as the codec groups a message."""
    import jax.numpy as jnp

    flat = jnp.ravel(x).astype(jnp.float32)
    unit = max(fmt.block, fmt.hadamard, SPIKE_GROUP if fmt.spikes else 1)
    pad = (-flat.size) % unit
    v = jnp.pad(flat, (0, pad))
    kept = None
    if fmt.spikes:  # each group's largest magnitudes travel apart, in bf16
        groups = v.reshape(-1, SPIKE_GROUP)
        top = jnp.argsort(-jnp.abs(groups), axis=1)[:, :fmt.spikes]
        mask = jnp.zeros(groups.shape, bool).at[jnp.arange(groups.shape[0])[:, None], top].set(True)
        kept = jnp.where(mask, groups.astype(jnp.bfloat16).astype(jnp.float32), 0.0).reshape(-1)
        v = jnp.where(mask, 0.0, groups).reshape(-1)
    if fmt.hadamard:
        h = jnp.asarray(hadamard_matrix(fmt.hadamard))
        v = (v.reshape(-1, fmt.hadamard) @ h).reshape(-1)
    g = v.reshape(-1, fmt.block)
    amax = jnp.max(jnp.abs(g), axis=1, keepdims=True)
    top, emax = (E2M1_MAX, E2M1_EMAX) if fmt.element == "e2m1" else (E4M3_MAX, E4M3_EMAX)
    if fmt.scale == "e8m0":
        exp = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - emax
        scale = jnp.exp2(jnp.clip(exp, -127, 127))
    elif fmt.scale == "e4m3":  # NVFP4: an f32 scale per message, an E4M3 one per block
        tensor = jnp.max(amax) / (E4M3_MAX * top)
        tensor = jnp.where(tensor > 0, tensor, 1.0)
        scale = _cast(amax / top / tensor, "e4m3") * tensor
    else:  # bf16, rounded up so that amax / scale <= top
        s = (amax / top).astype(jnp.bfloat16)
        s = jnp.where(s.astype(jnp.float32) * top < amax, jnp.nextafter(s, jnp.inf), s)
        scale = s.astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.where(scale > 0, _cast(g / safe, fmt.element) * scale, 0.0).reshape(-1)
    if fmt.hadamard:
        q = (q.reshape(-1, fmt.hadamard) @ h.T).reshape(-1)
    if kept is not None:
        q = q + kept  # a spike's own code is 0 (it was zeroed before the quantization)
    return q[:flat.size].reshape(x.shape)


def simulated_psum(x, axis_name: str, rs: Format, ag: Format):
    """The two-phase quantized all-reduce of ``x`` over ``axis_name``, simulated (module
    docstring); inside ``shard_map``, replicated result of ``x``'s dtype."""
    import jax.numpy as jnp
    from jax import lax

    total = lax.psum(fake_quantize(x.astype(jnp.float32), rs), axis_name)
    return fake_quantize(total, ag).astype(x.dtype)


def simulated_comm(rs: Format, ag: Format, axis_name: str = "tp", channel_scale=None,
                   channel_order=None):
    """A ``TPComm("exact")`` whose all-reduces are :func:`simulated_psum`, of the message
    divided by ``channel_scale`` (one per value of its last axis) and multiplied back after,
    and with its last axis permuted by ``channel_order`` (position i takes channel
    ``channel_order[i]``) and permuted back after."""
    import jax.numpy as jnp
    import numpy as np

    from jax_flashcomm.nn import TPComm

    scale = None if channel_scale is None else jnp.asarray(channel_scale, jnp.float32)
    order = None if channel_order is None else jnp.asarray(channel_order)
    back = None if channel_order is None else jnp.asarray(np.argsort(channel_order))

    class SimulatedFormatComm(TPComm):
        def all_reduce(self, x):
            v = x.astype(jnp.float32)
            if scale is not None:
                v = v / scale
            if order is not None:
                v = v[..., order]
            y = simulated_psum(v, self.axis_name, rs, ag).astype(jnp.float32)
            if back is not None:
                y = y[..., back]
            if scale is not None:
                y = y * scale
            return y.astype(x.dtype)

    return SimulatedFormatComm("exact", axis_name)
