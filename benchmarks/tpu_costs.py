"""The cost model's predicted speedups of the quantized all-reduce on TPU v5e, v5p and v6e.

A Llama-70B-shaped all-reduce (hidden 8192, bf16, tensor parallel over 8 chips: one all-reduce
of ``tokens x 8192`` bf16 per attention and per MLP block) priced with the TPU profiles of
:mod:`jax_flashcomm.costs` (ICI and HBM bandwidth from Google Cloud's public pages; the
latencies and the codec's share of HBM bandwidth are assumptions, docs/tpu.md), against the bf16
ring all-reduce over the same ICI ring. Nothing here ran on a TPU: these are predictions, printed
beside EQuARX's measured figures (arXiv 2506.17615: int8 all-reduce inside XLA on TPU, 1.8x over
the bf16 all-reduce; 1.25x prefill on Gemma-3-27B).

Re-run (a second, no TPU)::

    .venv/bin/python -m benchmarks.tpu_costs

``--measure`` also times, on the devices present, the pallas transport's kernels against lax
(the fused all-gather-matmul ring against ``lax.all_gather(x) @ w``, the int8 ``psum`` against
``lax.psum``) and checks each result; on a CPU backend the kernels run interpreted, so only a
TPU's figures mean anything.
"""

from __future__ import annotations

import argparse

from jax_flashcomm.costs import BF16, TPUS, exact_allreduce, flash_allreduce

HIDDEN = 8192                   # Llama-70B's model dimension
TOKENS = (1, 32, 512, 2048, 8192)
EQUARX_ALLREDUCE_SPEEDUP = 1.8  # EQuARX, int8 vs bf16 all-reduce on TPU (measured there)
EQUARX_PREFILL_SPEEDUP = 1.25   # EQuARX, Gemma-3-27B prefill (measured there)


def speedup(tpu, tokens: int, n: int, bits: int, spikes: int = 0) -> tuple[float, float, float]:
    """``(bf16 seconds, quantized seconds, speedup)`` of one all-reduce of ``tokens x HIDDEN``."""
    size = tokens * HIDDEN * BF16
    exact = exact_allreduce(size, n, tpu.link, "ring")["total_s"]
    quant = flash_allreduce(size, n, tpu.link, tpu.codec_pass_s, bits, spikes=spikes)["total_s"]
    return exact, quant, exact / quant


def table(n: int = 8) -> list[dict]:
    """One row per TPU generation, format and token count."""
    rows = []
    for name, tpu in TPUS.items():
        for bits, spikes in ((8, 0), (4, 1)):
            for tokens in TOKENS:
                exact, quant, ratio = speedup(tpu, tokens, n, bits, spikes)
                rows.append(dict(tpu=name, bits=bits, spikes=spikes, tokens=tokens,
                                 bf16_us=exact * 1e6, quantized_us=quant * 1e6, speedup=ratio))
    return rows


def _time(f, *args, reps: int = 10) -> float:
    """Median seconds of ``f(*args)`` (compiled, warmed up)."""
    import statistics
    import time

    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(tokens: int = 2048) -> None:
    """Time and check the pallas kernels against lax on every device present."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc
    from jax_flashcomm.transport import pallas_rings

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (n * tokens // n, HIDDEN),
                                         jnp.bfloat16), NamedSharding(mesh, P("x")))
    w = jax.device_put(jax.random.normal(jax.random.key(1), (HIDDEN, n * 1024), jnp.bfloat16),
                       NamedSharding(mesh, P(None, "x")))
    spec = dict(mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P("x"), check_vma=False)
    cases = {
        "all_gather_matmul fused": lambda a, b: pallas_rings.all_gather_matmul(a, b, "x"),
        "all_gather_matmul lax": lambda a, b: lax.all_gather(a, "x", tiled=True) @ b,
        "psum int8 pallas": lambda a, b: fc.psum(a, "x", bits=8, min_bytes=0,
                                                 transport="pallas"),
        "psum lax": lambda a, b: lax.psum(a, "x"),
    }
    results = {}
    for name, fn in cases.items():
        f = jax.jit(jax.shard_map(fn, **spec))
        try:
            results[name] = np.asarray(f(x, w), np.float32)
            print(f"{name:26} {_time(f, x, w) * 1e6:10.1f} us")
        except Exception as e:  # a kernel Mosaic does not compile here: say which and why
            print(f"{name:26} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    pairs = (("all_gather_matmul fused", "all_gather_matmul lax"), ("psum int8 pallas", "psum lax"))
    for a, b in pairs:
        if a in results and b in results:
            err = np.max(np.abs(results[a] - results[b])) / (np.max(np.abs(results[b])) or 1)
            print(f"{a} vs {b}: max relative difference {err:.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8, help="tensor-parallel chips (default 8)")
    parser.add_argument("--measure", action="store_true",
                        help="also time and check the kernels on the devices present")
    args = parser.parse_args(argv)
    print(f"Llama-70B all-reduce (tokens x {HIDDEN} bf16), TP={args.ranks}; predicted, not run")
    print(f"{'tpu':5} {'format':10} {'tokens':>7} {'bf16 us':>10} {'quant us':>10} {'speedup':>8}")
    for r in table(args.ranks):
        fmt = f"int{r['bits']}" + (f"+{r['spikes']}sp" if r["spikes"] else "")
        print(f"{r['tpu']:5} {fmt:10} {r['tokens']:>7} {r['bf16_us']:>10.1f} "
              f"{r['quantized_us']:>10.1f} {r['speedup']:>7.2f}x")
    print(f"EQuARX (measured on TPU): int8 all-reduce {EQUARX_ALLREDUCE_SPEEDUP}x over bf16, "
          f"Gemma-3-27B prefill {EQUARX_PREFILL_SPEEDUP}x")
    if args.measure:
        measure()


if __name__ == "__main__":
    main()
