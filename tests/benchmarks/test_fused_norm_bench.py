"""benchmarks.collectives.fused_norm counts the bytes of every kernel of a compiled program: the fused
epilogue is one kernel that reads the payload, the residual and the weight and writes the new
residual and the output, exactly; the unfused ops move more."""

import jax.numpy as jnp

from benchmarks.collectives.fused_norm import _operands, _programs, counted_bytes


def test_counted_bytes_of_the_fused_and_unfused_epilogues():
    p, r, w = _operands(32, 576, jnp.bfloat16)
    unfused, fused = _programs(None, None)
    total, kernels = counted_bytes(fused.lower(p, r, w).compile())
    assert [k.split(":")[0] for k, _ in kernels] == ["custom-call"]
    assert total == p.nbytes + r.nbytes + w.nbytes + 2 * r.nbytes
    total_u, kernels_u = counted_bytes(unfused.lower(p, r, w).compile())
    assert len(kernels_u) > 1 and total_u > 2 * total
    q_unfused, q_fused = _programs(8, 64)
    q_total, _ = counted_bytes(q_fused.lower(p, r, w).compile())
    # quantized output: codes (1 B/value) + scale and zero (4 B per group of 64) replace out
    assert q_total == p.nbytes + 2 * r.nbytes + w.nbytes + r.size + 4 * (r.size // 64)
