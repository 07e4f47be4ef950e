"""jax_flashcomm demo: quantized all-reduce and a ring collective matmul on 8 CPU devices.

Runs a tensor-parallel style step on a mesh of 8 (virtual CPU) devices and compares each
jax_flashcomm collective with its exact ``jax.lax`` counterpart: the error, the error bound the
codec derives from its stored scales, and the bytes each one puts on the wire.

    .venv/bin/python examples/demo.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def main():
    n = 8
    mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
    print(f"devices: {n} x {jax.devices()[0].platform}; codec kernels: "
          f"{'C++ XLA FFI' if kernels.available('cpu') else 'pure-jnp twin'}")

    # 1. The codec on its own: an activation tensor with a few outlier channels.
    key = jax.random.key(0)
    x = jax.random.normal(key, (256, 4096), jnp.float32)
    x = x.at[:, ::512].multiply(30.0).astype(jnp.bfloat16)
    print("\ncodec round trip, bf16 (256, 4096), G=128:")
    for bits in (8, 6, 4):
        payload = codec.quantize(x, bits=bits)
        y = codec.dequantize(payload)
        err = jnp.abs(y.astype(jnp.float32) - x.astype(jnp.float32))
        within = bool(jnp.all(err <= codec.error_bound(payload)))
        print(f"  int{bits}: {payload.nbytes / x.nbytes:.3f} of the bf16 bytes, "
              f"rel. RMS error {rel_rms(y, x):.2e}, max error within stored bound: {within}")

    # 2. Quantized psum vs lax.psum: each device holds a partial sum (as after a row-parallel
    #    matmul) and all-reduces it.
    partials = jax.random.normal(jax.random.key(1), (n, 512, 4096), jnp.bfloat16)
    partials = jax.device_put(partials, NamedSharding(mesh, P("tp")))
    exact = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], "tp"), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P()))(partials)
    print(f"\nall-reduce of bf16 (512, 4096) over {n} devices:")
    for bits in (8, 4):
        f = jax.jit(jax.shard_map(lambda v: fc.psum(v[0], "tp", bits=bits), mesh=mesh,
                                  in_specs=P("tp"), out_specs=P()))
        y = f(partials)
        hlo = f.lower(partials).compile().as_text()
        collectives = sorted({op for op in ("all-to-all", "all-gather", "all-reduce")
                              if f" {op}(" in hlo or f"{op}-start(" in hlo})
        wire = codec.wire_bytes_per_element(bits, 128) / 2.0
        print(f"  fc.psum int{bits}: rel. RMS error vs lax.psum {rel_rms(y, exact):.2e}; "
              f"wire bytes {wire:.3f} of a bf16 ring all-reduce; HLO collectives {collectives}")

    # 3. Ring-decomposed all-gather -> matmul (exact): x sharded by rows, w by columns.
    xs = jax.random.normal(jax.random.key(2), (n * 128, 1024), jnp.float32)
    ws = jax.random.normal(jax.random.key(3), (1024, n * 256), jnp.float32)
    xs = jax.device_put(xs, NamedSharding(mesh, P("tp", None)))
    ws = jax.device_put(ws, NamedSharding(mesh, P(None, "tp")))
    spec_in, spec_out = (P("tp", None), P(None, "tp")), P(None, "tp")
    ring = jax.jit(jax.shard_map(lambda a, b: fc.all_gather_matmul(a, b, "tp"), mesh=mesh,
                                 in_specs=spec_in, out_specs=spec_out))
    ref = jax.jit(jax.shard_map(lambda a, b: lax.all_gather(a, "tp", tiled=True) @ b,
                                mesh=mesh, in_specs=spec_in, out_specs=spec_out))
    hlo = ring.lower(xs, ws).compile().as_text()
    permutes = hlo.count("collective-permute-start(") or hlo.count("collective-permute(")
    print(f"\nall_gather_matmul (ring, {permutes} "
          f"permutes, no all-gather: {' all-gather(' not in hlo}): "
          f"max |ring - unfused| = {float(jnp.max(jnp.abs(ring(xs, ws) - ref(xs, ws)))):.2e}")


if __name__ == "__main__":
    main()
