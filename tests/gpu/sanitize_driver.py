"""The GPU half of the GPU tests' programs, for compute-sanitizer (benchmarks/native/gpu_sanitize.sh).

Runs every configuration of the codec, floating-point format, fused-norm and gather tests on
the GPU only: the comparison with the CPU kernels is the tests' job (pytest under the
sanitizer crashed, see docs/cuda.md). Prints one line per part with the programs it ran.

    <python> -m tests.gpu.sanitize_driver [codec] [fp] [norm] [gather]   (default: all four)
"""

from __future__ import annotations

import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tests.gpu import test_gpu_codec as codec_t
from tests.gpu import test_gpu_fp_formats as fp_t
from tests.gpu import test_gpu_fused_norm as norm_t
from tests.gpu import test_gpu_gather as gather_t
from tests.gpu.gpu_support import gpu_devices, on


def _run(f, *args) -> None:
    jax.block_until_ready(f(*args))


def codec(gpu) -> int:
    n = 0
    for dtype, rotation, spikes in itertools.product(codec_t.DTYPES, codec_t.ROTATIONS,
                                                     codec_t.SPIKES):
        groups = codec_t.ROTATED_GROUPS if rotation else codec_t.PLAIN_GROUPS
        kinds = codec_t._kinds(dtype)
        xs = tuple(codec_t._operand(dtype, g, kinds, seed=1000 * g + 10 * rotation + spikes)
                   for g in groups)
        _run(codec_t._program(groups, rotation, spikes), on(gpu, xs))
        n += 1
    return n


def fp(gpu) -> int:
    n = 0
    for dtype, fmt, spikes, rotation in itertools.product(
            (jnp.float32, jnp.bfloat16, jnp.float16), fp_t.FORMATS, (0, 1, 3), (0, 2)):
        xs = tuple(fp_t._operand(dtype, g, seed=g + spikes) for g in fp_t.GROUPS)
        _run(fp_t._program(fmt, spikes, rotation), on(gpu, xs))
        n += 1
    return n


def norm(gpu) -> int:
    n = 0
    for dtype, wdtype, (shape, rotation, spikes) in itertools.product(
            (jnp.float32, jnp.bfloat16, jnp.float16), (jnp.float32, jnp.bfloat16),
            norm_t.CASES):
        _run(norm_t._fused, *on(gpu, norm_t._operands(shape, dtype, wdtype, rotation, spikes)))
        n += 1
    return n


def gather(gpu) -> int:
    n = 0
    for (group_size, rotation, spikes), out_dtype in itertools.product(gather_t.CASES,
                                                                       gather_t.DTYPES):
        rng = np.random.default_rng(group_size + 10 * rotation + spikes)
        count = min(gather_t.OUT_SIZE - 40, 3 * group_size + 5)
        src = gather_t.structured(rng, -(-count // group_size), group_size, jnp.bfloat16)
        out = jnp.asarray(rng.standard_normal(gather_t.OUT_SIZE) * 100, out_dtype)
        offsets = jnp.asarray([0, gather_t.OUT_SIZE - count], jnp.int32)
        _run(gather_t._program(group_size, rotation, spikes, count), *on(gpu, (src, out, offsets)))
        n += 1
    return n


PARTS = {"codec": codec, "fp": fp, "norm": norm, "gather": gather}


def main(argv: list[str]) -> int:
    gpus = gpu_devices()
    if not gpus:
        print("no GPU: nothing to run")
        return 2
    unknown = [a for a in argv if a not in PARTS]
    if unknown:
        print(f"unknown parts {unknown}; choose from {sorted(PARTS)}")
        return 2
    for name in argv or list(PARTS):
        t0 = time.perf_counter()
        n = PARTS[name](gpus[0])
        print(f"{name}: {n} programs ran on {gpus[0].device_kind}, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
