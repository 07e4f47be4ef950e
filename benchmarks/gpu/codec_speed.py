"""GPU time of the quantize kernels by group size, and of the fused dequantize-sum-quantize, for
one build of the package: the before/after comparison of docs/cuda.md ("Kernel speed").

    .venv/bin/python -m benchmarks.gpu.codec_speed --label new
    # another checkout's build:
    .venv/bin/python -m benchmarks.gpu.codec_speed --root /tmp/old --label old
    # each kernel once (what gpu_check.sh profiles with Nsight Compute):
    .venv/bin/python -m benchmarks.gpu.codec_speed --once --sizes 64

``--root`` imports ``jax_flashcomm`` from that tree (its modules built and copied into its
``jax_flashcomm/``, as ``gpu_check.sh``'s CMake fallback does), bypassing an editable install
of this one. Each figure: bf16 operand, the median of 7 rounds of one jitted program running
the op 20 times (``benchmarks.gpu.check.time_in_program``), beside a copy of the operand.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

MIB = 1 << 20
QUANTIZE_CASES = (("int8", 8, 128), ("int4", 4, 128), ("int8 G=64", 8, 64), ("int8 G=32", 8, 32))


def _import_from(root: str | None):
    if root:
        # A scikit-build-core editable install puts a redirecting finder ahead of sys.path.
        sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
        sys.path.insert(0, str(pathlib.Path(root).resolve()))
    import jax_flashcomm

    if root and not jax_flashcomm.__file__.startswith(str(pathlib.Path(root).resolve())):
        raise SystemExit(f"jax_flashcomm came from {jax_flashcomm.__file__}, not {root}")
    return jax_flashcomm


def measure(label: str, sizes_mib, platform: str) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu.check import time_in_program
    from jax_flashcomm import codec

    device = jax.devices(platform)[0]
    rows = []

    def add(op, config, mib, seconds):
        rows.append({"label": label, "op": op, "config": config, "mib": mib,
                     "seconds": seconds, "gbps": mib * MIB / seconds / 1e9})
        print(f"{label:6s} {op:24s} {config:10s} {mib:4d} MiB {seconds * 1e6:9.1f} us "
              f"{mib * MIB / seconds / 1e9:8.1f} GB/s", flush=True)

    for mib in sizes_mib:
        n = mib * MIB // 2
        x = jax.device_put(jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16), device)
        add("copy", "-", mib, time_in_program(jnp.copy, (x,)))
        for name, bits, g in QUANTIZE_CASES:
            add("quantize", name, mib, time_in_program(
                lambda a, b=bits, g=g: codec.quantize(a, bits=b, group_size=g, backend="ffi"),
                (x,)))
        chunks = jax.jit(lambda a: codec.quantize(a, bits=8, group_size=128, num_chunks=8,
                                                  backend="ffi"))(x).split_groups(8)
        add("dequantize_sum_quantize", "int8", mib, time_in_program(
            lambda q: codec.dequantize_sum_quantize(q, backend="ffi"), (chunks,)))
    return rows


def run_once(sizes_mib, platform: str) -> None:
    """Each codec kernel once, unrolled into no timing loop: the target of a profiler
    (``gpu_check.sh`` runs Nsight Compute on it). Per size: quantize at 8 and 4 bits and 8 bits
    rotated, dequantize of each, the fused dequantize-sum-quantize of 8 chunks."""
    import jax
    import jax.numpy as jnp

    from jax_flashcomm import codec

    device = jax.devices(platform)[0]
    for mib in sizes_mib:
        x = jax.device_put(jax.random.normal(jax.random.key(0), (mib * MIB // 2,),
                                             jnp.bfloat16), device)
        for bits, rotation in ((8, 0), (4, 0), (8, 1)):
            p = jax.jit(lambda a, b=bits, r=rotation: codec.quantize(
                a, bits=b, group_size=128, rotation=r, backend="ffi"))(x)
            jax.block_until_ready(jax.jit(lambda q: codec.dequantize(q, backend="ffi"))(p))
        chunks = jax.jit(lambda a: codec.quantize(a, bits=8, group_size=128, num_chunks=8,
                                                  backend="ffi"))(x).split_groups(8)
        jax.block_until_ready(jax.jit(
            lambda q: codec.dequantize_sum_quantize(q, backend="ffi"))(chunks))
        print(f"ran each codec kernel once on {mib} MiB", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="import jax_flashcomm from this checkout")
    parser.add_argument("--label", default="this build")
    parser.add_argument("--sizes", default="16,256", help="operand sizes in MiB")
    parser.add_argument("--platform", default="gpu", help="jax platform (cpu: a dry run)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--once", action="store_true",
                        help="each kernel once, no timing (a profiler's target)")
    args = parser.parse_args(argv)
    _import_from(args.root)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.once:
        run_once(sizes, args.platform)
        return 0
    rows = measure(args.label, sizes, args.platform)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
