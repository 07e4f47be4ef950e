"""A quick codec throughput check that runs against any version of jax_flashcomm (it uses only
the API every version has), for comparing two builds back to back on one machine.

bf16, 8 MiB, G = 128: quantize, dequantize and the fused dequantize-sum-quantize (8 chunks), FFI
kernels and the jnp twin, at 8, 6 and 4 bits; median of 7 calls. With the kernel builds named on
the command line (``avx2 baseline``; versions with ``codec.cpu_isas()``), one block per build.

Compare the build of another commit (``OLD_COMMIT``) with this one::

    git worktree add /tmp/old OLD_COMMIT && pip wheel --no-deps -w /tmp/oldwheel /tmp/old
    mkdir /tmp/oldpkg && cp -r /tmp/old/jax_flashcomm /tmp/oldpkg/ \\
      && unzip -o /tmp/oldwheel/*.whl 'jax_flashcomm/*.so' -d /tmp/oldpkg
    PYTHONPATH=/tmp/oldpkg:. .venv/bin/python -P -m benchmarks.codec.compare_builds
    .venv/bin/python -m benchmarks.codec.compare_builds avx2 baseline

(``-P``: the current directory is not put first on ``sys.path``, so ``/tmp/oldpkg``'s
jax_flashcomm is the one imported, and ``.`` after it provides ``benchmarks``.)
"""

from __future__ import annotations

import sys

from benchmarks.shared.runtime import MALLOC_KEEP, reexec_with

from benchmarks.shared.timing import median_seconds

if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashcomm import codec  # noqa: E402

REPS = 7


def main():
    isas = sys.argv[1:]
    x = jax.random.normal(jax.random.key(0), (4 * 2**20,), jnp.bfloat16)  # 8 MiB
    blocks = [(isa, "ffi") for isa in isas] or [(None, "ffi")]
    for isa, backend in [*blocks, (None, "jnp")]:
        label = isa or ("installed build" if backend == "ffi" else "jnp twin")
        for bits in (8, 6, 4):
            def run(fn, *args):
                if isa is None:
                    return median_seconds(lambda: fn(*args), REPS)
                with codec.use_cpu_isa(isa):
                    return median_seconds(lambda: fn(*args), REPS)
            q = jax.jit(lambda a: codec.quantize(a, bits=bits, backend=backend))
            d = jax.jit(lambda p: codec.dequantize(p, backend=backend))
            f = jax.jit(lambda p: codec.dequantize_sum_quantize(p, backend=backend))
            p = q(x)
            chunked = codec.quantize(x, bits=bits, num_chunks=8).split_groups(8)
            tq, td, tf = run(q, x), run(d, p), run(f, chunked)
            print(f"{label:>15} {bits} bits {backend}: quantize {x.nbytes / tq / 1e9:5.2f} "
                  f"dequantize {x.nbytes / td / 1e9:5.2f} fused {x.nbytes / tf / 1e9:5.2f} GB/s",
                  flush=True)


if __name__ == "__main__":
    main()
