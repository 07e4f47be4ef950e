"""Outlier-robust quantized all-reduce: relative error per codec option, measured.

Data (per rank: ``T`` tokens x ``C = 4096`` channels, ``N = 4`` ranks, one row-major operand):

* ``gauss``: N(0, 1) values;
* ``heavy``: Student-t with 3 degrees of freedom (heavy tails, unit scale);
* ``gauss+outliers`` / ``heavy+outliers``: the same, with 8 fixed channels (the same channels on
  every rank, as in pretrained transformers) multiplied by fixed factors spread over 20..100;
* ``offset``: 3 + N(0, 1): every group has a common offset of 3 standard deviations (a
  counter-case for rotation: the transform turns a group's mean into spread).

Options (same group size G, same bits in both phases):

* ``plain``: per-group min/max (the shipped format);
* ``hadamard`` / ``signed_hadamard``: codec ``rotation=1`` / ``2`` (docs/format.md, "Rotation");
  same wire bytes as plain;
* ``spikes{k}``: codec ``spikes=k`` (docs/format.md, "Spike reserving"): per group the k
  largest |x| travel as bf16 values plus 1-byte positions (``G <= 256``) or 2-byte ones, are
  excluded from min/max and overwrite their decoded slots, in both phases;
* ``signed_hadamard+spikes1``: both (spikes selected in the rotated domain).

The all-reduce is the two-step algorithm of ``jax_flashcomm.psum`` run with the codec ops on one
device (quantize each rank's operand in N chunks, f32 sum of the N decoded chunks in rank order
and re-quantization, decode); ``--check`` verifies that this equals ``jax_flashcomm.psum`` on 4
virtual devices bit for bit. Error: ``||y - sum_r x_r||_2 / ||sum_r x_r||_2`` over the whole
operand (relative RMS). Bytes per element: what one phase's payload carries per element.

Also: CPU codec time with and without rotation (FFI kernels, bf16 operand, G = 128).

Re-run::

    .venv/bin/python -m benchmarks.codec.outliers    # -> docs/results/outliers.{json,md}
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.shared.results import RESULTS, write_page  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import spec  # noqa: E402

N_RANKS = 4
CHANNELS = 4096
OUTLIER_CHANNELS = np.array([11, 523, 1100, 1999, 2048, 2900, 3333, 4000])
OUTLIER_FACTORS = np.linspace(20.0, 100.0, len(OUTLIER_CHANNELS))
OFFSET = 3.0
OPTIONS = ("plain", "hadamard", "signed_hadamard", "spikes1", "spikes4",
           "signed_hadamard+spikes1")
#: option -> codec (rotation, spikes)
CODEC_OPTIONS = {"plain": (0, 0), "hadamard": (1, 0), "signed_hadamard": (2, 0),
                 "spikes1": (0, 1), "spikes4": (0, 4), "signed_hadamard+spikes1": (2, 1)}


def make_data(kind: str, tokens: int, seed: int = 0) -> np.ndarray:
    """(N, tokens, C) f32: one operand per rank."""
    rng = np.random.default_rng(seed)
    shape = (N_RANKS, tokens, CHANNELS)
    if kind.startswith("gauss"):
        x = rng.standard_normal(shape)
    elif kind.startswith("offset"):
        x = OFFSET + rng.standard_normal(shape)
    else:
        x = rng.standard_t(3, shape)
    if kind.endswith("outliers"):
        x[..., OUTLIER_CHANNELS] *= OUTLIER_FACTORS
    return x.astype(np.float32)


def bytes_per_element(option: str, bits: int, g: int) -> float:
    return spec.wire_bytes_per_element(bits, g, CODEC_OPTIONS[option][1])


# --- the two-step all-reduce with the codec ops ---------------------------------------------

def psum_codec(x, bits: int, g: int, rotation: int, spikes: int, backend: str):
    """x (N, ...) -> the two-step all-reduce sum (what each rank gets), via the codec ops."""
    n = x.shape[0]
    payloads = [codec.quantize(x[r], bits=bits, group_size=g, num_chunks=n, rotation=rotation,
                               spikes=spikes, backend=backend).split_groups(n)
                for r in range(n)]
    gathered = []
    for i in range(n):  # rank i receives chunk i of every rank
        recv = jax.tree.map(lambda *a: jnp.stack([v[i] for v in a]), *payloads)
        gathered.append(codec.dequantize_sum_quantize(recv, bits=bits, backend=backend))
    full = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *gathered)
        # the operand's shape, as psum's phase-2 payload
    full = full.__class__(full.codes, full.scale, full.zero, bits=bits, group_size=g,
                          shape=x.shape[1:], dtype=x.dtype, rotation=rotation, spikes=spikes)
    return codec.dequantize(full, backend=backend)


def run_option(option, x, bits, g, backend):
    rotation, spikes = CODEC_OPTIONS[option]
    return psum_codec(x, bits, g, rotation, spikes, backend)


def rel_rms(y, x) -> float:
    true = np.asarray(x, np.float64).sum(0)
    return float(np.linalg.norm(np.asarray(y, np.float64) - true) / np.linalg.norm(true))


# --- check against jax_flashcomm.psum ---------------------------------------------------------

def check_against_psum(x, bits, g, rotation, spikes):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc

    mesh = jax.make_mesh((N_RANKS,), ("i",))
    f = jax.jit(jax.shard_map(
        lambda v: fc.psum(v[0], "i", bits=bits, group_size=g, min_bytes=0,
                          rotation=rotation, spikes=spikes)[None],
        mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    y = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("i")))))
    mine = np.asarray(jax.jit(lambda v: psum_codec(v, bits, g, rotation, spikes, "auto"))(x))
    for r in range(N_RANKS):
        np.testing.assert_array_equal(y[r].view(np.uint32), mine.view(np.uint32))


# --- codec time with rotation -----------------------------------------------------------------

def _time(fn, arg, reps):
    jax.block_until_ready(fn(arg))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def throughput(reps: int, elems: int):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(elems), jnp.bfloat16)
    rows = []
    for bits in (8, 4):
        for rot in (0, 1, 2):
            q = jax.jit(lambda v: codec.quantize(v, bits=bits, rotation=rot, backend="ffi"))
            p = q(x)
            d = jax.jit(lambda pp: codec.dequantize(pp, backend="ffi"))
            pc = codec.quantize(x, bits=bits, num_chunks=8, rotation=rot,
                                backend="ffi").split_groups(8)
            s = jax.jit(lambda pp: codec.dequantize_sum(pp, backend="ffi"))
            rows.append(dict(bits=bits, rotation=rot, quantize_s=_time(q, x, reps),
                             dequantize_s=_time(d, p, reps), dequantize_sum8_s=_time(s, pc, reps),
                             elements=elems))
    return rows


def markdown(results) -> str:
    """The docs/outliers.md table: rel_rms (bytes/element) per option."""
    head = "| data | G | bits | " + " | ".join(OPTIONS) + " |"
    lines = [head, "|" + "---|" * (3 + len(OPTIONS))]
    keys = sorted({(r["data"], r["group_size"], r["bits"]) for r in results},
                  key=lambda k: (list(dict.fromkeys(r["data"] for r in results)).index(k[0]),
                                 k[1], -k[2]))
    for kind, g, bits in keys:
        row = {r["option"]: r for r in results
               if (r["data"], r["group_size"], r["bits"]) == (kind, g, bits)}
        best = min(row.values(), key=lambda r: r["rel_rms"])["option"]
        cells = []
        for o in OPTIONS:
            c = f"{row[o]['rel_rms']:.2e} ({row[o]['bytes_per_element']:.3f})"
            cells.append(f"**{c}**" if o == best else c)
        lines.append(f"| {kind} | {g} | {bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check", action="store_true", default=True)
    ap.add_argument("--out", default=str(RESULTS / "outliers.json"))
    args = ap.parse_args()
    tokens = 16 if args.quick else args.tokens
    kinds = ("gauss", "heavy", "gauss+outliers", "heavy+outliers", "offset")
    data = {k: make_data(k, tokens, seed=i) for i, k in enumerate(kinds)}
    if args.check:
        for rot, k in ((0, 0), (2, 0), (0, 1), (2, 1)):
            check_against_psum(data["gauss+outliers"], 4, 128, rot, k)
        print("check: codec-op simulation == jax_flashcomm.psum (4 devices) bit for bit")
    backend = "ffi" if codec.kernels.available("cpu") else "jnp"
    results = []
    for kind in kinds:
        x = jnp.asarray(data[kind])
        for g in (32, 128, 512):
            for bits in (8, 6, 4, 3):
                for opt in OPTIONS:
                    y = jax.jit(lambda v: run_option(opt, v, bits, g, backend))(x)
                    results.append(dict(data=kind, option=opt, bits=bits, group_size=g,
                                        rel_rms=rel_rms(y, data[kind]),
                                        bytes_per_element=bytes_per_element(opt, bits, g)))
                row = [r for r in results if r["data"] == kind and r["bits"] == bits
                       and r["group_size"] == g]
                print(f"{kind:16s} G={g:3d} b={bits}: " + "  ".join(
                    f"{r['option']}={r['rel_rms']:.3e}({r['bytes_per_element']:.3f}B)"
                    for r in row), flush=True)
    tp = throughput(5 if args.quick else args.reps, (1 << 20) if args.quick else (1 << 24))
    for r in tp:
        print(f"codec bits={r['bits']} rotation={r['rotation']}: quantize "
              f"{r['quantize_s'] * 1e3:.2f} ms, dequantize {r['dequantize_s'] * 1e3:.2f} ms, "
              f"dequantize_sum(8) {r['dequantize_sum8_s'] * 1e3:.2f} ms "
              f"({r['elements']} bf16 elements)")
    out = dict(machine=platform.processor() or platform.machine(), n_ranks=N_RANKS,
               channels=CHANNELS, tokens=tokens, outlier_channels=OUTLIER_CHANNELS.tolist(),
               outlier_factors=OUTLIER_FACTORS.tolist(), backend=backend, results=results,
               throughput=tp, jax=jax.__version__)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(markdown(results))
    write_page(args.out, out, tables=markdown(results))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
