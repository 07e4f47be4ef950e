"""Which type should a group's zero have on the wire? bf16 (shipped) vs fp16 vs f32.

A numpy simulation of the codec's encode and decode (docs/format.md) with the zero stored in
three ways, the scale always bf16 rounded toward +inf:

* ``bf16``: zero = min rounded toward -inf to bf16, clamped to the lowest finite bf16 (shipped);
* ``fp16``: zero = min rounded toward -inf to fp16, clamped to -65504 (fp16 has no finite value
  below it; a min above 65504 rounds down to 65504);
* ``f32``:  zero = min exactly.

Per group of G = 128 values, all in f32 arithmetic with one rounding per operation (numpy does
not contract a*b+c):

    zero      = store(min)                      (the three options above)
    scale     = bf16_round_up(max(f32(max - zero) * f32(1/L), FLT_MIN if max > zero)),  L = 2^b - 1
    inv_scale = f32(1 / scale)                  (0 when scale is 0)
    q         = clamp(round_half_even(f32(x - zero) * inv_scale), 0, L)
    x'        = f32(q * scale + zero)           (q * scale is exact)

This is the codec's arithmetic (ffi/include/flashcomm/codec.h) minus its paths for non-finite
and huge (scale >= 2^120) groups, which these data never reach. The bf16 option is checked
bit for bit against ``jax_flashcomm.codec.quantize`` / ``dequantize`` when jax_flashcomm
imports (``--no-check`` skips that).

Data (each 4096 groups of 128), as f32 operands and as bf16 operands (rounded to nearest):

* gaussian:  N(0, 1);
* offset:    1000 + N(0, s), a narrow range far from zero: s = 0.1 for f32 (values like
  1000.0 .. 1000.5); s = 8 for bf16, whose spacing at 1000 is 4 (s = 0.1 would make every
  group constant);
* outliers:  LLM-like activation rows (hidden 4096): N(0, 1) with 8 fixed outlier channels
  20-100x larger (the massive-activation channels of LLMs);
* near +1e5: 1e5 + N(0, s)   (past fp16's 65504: an fp16 zero saturates at 65504);
* near -1e5: -1e5 + N(0, s)  (an fp16 zero clamps to -65504, above every value);
  s = 1 for f32, s = 2048 for bf16 (spacing 512 there).

Metrics, against the operand itself (before the decoded f32 is cast back to the operand's
dtype, a rounding that is the same for every option):

* rel_rms   = ||x' - x||_2 / ||x||_2 over the data set;
* max_step  = max over elements of |x' - x| / ((max - min) / L), min and max the group's own:
  an ideal quantizer of the group's exact range gives 0.5 (groups with max == min count as 0
  when decoded exactly);
* wire bytes per element = (G * b / 8 + 2 (scale) + zero bytes) / G, and the wire ratio
  against a bf16 ring all-reduce, which moves 2 bytes per element per phase: ratio =
  bytes_per_element / 2.

Run:  .venv/bin/python -m benchmarks.codec.zero_dtype
      -> table on stdout, docs/results/zero_dtype.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.shared.results import RESULTS, write_page

G = 128
N_GROUPS = 4096
HIDDEN = 4096
BITS = (8, 4)
ZERO_TYPES = ("bf16", "fp16", "f32")
ZERO_BYTES = {"bf16": 2, "fp16": 2, "f32": 4}
SCALE_BYTES = 2
BUDGET = 0.52  # int8 wire ratio budget vs a bf16 ring all-reduce

F32 = np.float32
U32 = np.uint32
FLT_MIN = np.finfo(F32).tiny
BF16_LOWEST = U32(0xFF7F)
BF16_NEG_INF = U32(0xFF80)
F16_LOWEST = np.float16(-65504.0)


# ---- exact 16-bit roundings (codec.h's bit manipulations) ----

def bf16_bits_to_f32(b16):
    return (b16.astype(U32) << U32(16)).view(F32)


def bf16_round_down(x):
    """f32 -> bf16 bits, rounded toward -inf."""
    u = np.asarray(x, F32).view(U32)
    t = u & U32(0xFFFF0000)
    bump = ((u >> U32(31)) == 1) & ((u & U32(0xFFFF)) != 0)
    return np.where(bump, t + U32(0x10000), t) >> U32(16)


def bf16_round_up(x):
    """f32 -> bf16 bits, rounded toward +inf."""
    u = np.asarray(x, F32).view(U32)
    t = u & U32(0xFFFF0000)
    bump = ((u >> U32(31)) == 0) & ((u & U32(0xFFFF)) != 0)
    return np.where(bump, t + U32(0x10000), t) >> U32(16)


def bf16_round_nearest(x):
    """f32 -> bf16 (as f32), round to nearest even (finite input): the operand cast."""
    u = np.asarray(x, F32).view(U32)
    return ((u + U32(0x7FFF) + ((u >> U32(16)) & U32(1))) & U32(0xFFFF0000)).view(F32)


def f16_round_down(x):
    """f32 -> fp16 rounded toward -inf, clamped to the lowest finite fp16 (-65504).

    numpy's f32 -> f16 conversion rounds to nearest even (overflow to inf); where that went
    up, step one fp16 ulp down. A min past -65504 would need -inf: clamp, as the bf16 zero does.
    """
    x = np.asarray(x, F32)
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    up = h.astype(F32) > x
    h = np.where(up, np.nextafter(h, np.float16(-np.inf)), h)
    h = np.where(np.isneginf(h), F16_LOWEST, h)
    return h


def store_zero(lo, zero_type):
    """The stored zero (decoded to f32) for group minima ``lo``."""
    if zero_type == "bf16":
        b = bf16_round_down(lo)
        b = np.where(b == BF16_NEG_INF, BF16_LOWEST, b)
        return bf16_bits_to_f32(b)
    if zero_type == "fp16":
        return f16_round_down(lo).astype(F32)
    if zero_type == "f32":
        return np.asarray(lo, F32)
    raise ValueError(zero_type)


# ---- the codec, f32 throughout ----

def quantize(x, bits, zero_type):
    """x (groups, G) f32 -> (q uint32 (groups, G), scale f32, zero f32, scale bf16 bits)."""
    levels = F32((1 << bits) - 1)
    inv_levels = F32(1) / levels  # what XLA makes of a division by a constant
    lo = x.min(axis=1)
    hi = x.max(axis=1)
    lo = np.where(lo == 0, F32(0), lo)  # canonical +0
    hi = np.where(hi == 0, F32(0), hi)
    zero = store_zero(lo, zero_type)
    rng = (hi - zero).astype(F32)
    scale = (rng * inv_levels).astype(F32)
    scale = np.where((rng > 0) & ~(scale >= FLT_MIN), FLT_MIN, scale).astype(F32)
    scale_bits = bf16_round_up(scale)
    scale = bf16_bits_to_f32(scale_bits)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, F32(1) / np.where(scale > 0, scale, F32(1)), F32(0)).astype(F32)
    t = ((x - zero[:, None]).astype(F32) * inv[:, None]).astype(F32)
    t = np.where(t > 0, t, F32(0))
    t = np.where(t < levels, t, levels)
    q = np.rint(t).astype(U32)  # round half to even
    return q, scale, zero, scale_bits


def dequantize(q, scale, zero):
    prod = (q.astype(F32) * scale[:, None]).astype(F32)  # exact: 8-bit code x 8-bit mantissa
    return (prod + zero[:, None]).astype(F32)


# ---- data ----

def make_data(name, operand, rng):
    """(N_GROUPS, G) operand values (f32 arrays; bf16 operands are rounded to bf16)."""
    n = N_GROUPS * G
    wide = operand == "bf16"  # spreads that survive rounding to bf16
    if name == "gaussian":
        v = rng.standard_normal(n)
    elif name == "offset":
        v = 1000.0 + (8.0 if wide else 0.1) * rng.standard_normal(n)
    elif name == "outliers":
        rows = n // HIDDEN
        v = rng.standard_normal((rows, HIDDEN))
        channels = rng.choice(HIDDEN, size=8, replace=False)
        mult = rng.uniform(20.0, 100.0, size=8) * rng.choice([-1.0, 1.0], size=8)
        v[:, channels] = np.abs(v[:, channels]) * mult + 0.1 * mult * rng.standard_normal(
            (rows, 8))
        v = v.reshape(-1)
    elif name == "near_pos_1e5":
        v = 1e5 + (2048.0 if wide else 1.0) * rng.standard_normal(n)
    elif name == "near_neg_1e5":
        v = -1e5 + (2048.0 if wide else 1.0) * rng.standard_normal(n)
    else:
        raise ValueError(name)
    v = v.astype(F32).reshape(N_GROUPS, G)
    return bf16_round_nearest(v) if operand == "bf16" else v


DATASETS = ("gaussian", "offset", "outliers", "near_pos_1e5", "near_neg_1e5")


def metrics(x, y, bits):
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    err = np.abs(y64 - x64)
    rel_rms = float(np.sqrt(np.sum(err ** 2)) / np.sqrt(np.sum(x64 ** 2)))
    step = (x64.max(axis=1) - x64.min(axis=1)) / ((1 << bits) - 1)
    gmax = err.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(step > 0, gmax / np.where(step > 0, step, 1.0),
                         np.where(gmax == 0, 0.0, np.inf))
    return rel_rms, float(ratio.max()), float(ratio.mean())


def wire(bits, zero_type):
    per_elem = (G * bits / 8 + SCALE_BYTES + ZERO_BYTES[zero_type]) / G
    return per_elem, per_elem / 2


# ---- cross-check of the bf16 option against the shipped codec ----

def check_against_codec(x, bits, operand):
    """Codes, scales, zeros and decoded values of the bf16 option == jax_flashcomm's."""
    import jax.numpy as jnp

    from jax_flashcomm import codec

    q, scale, zero, scale_bits = quantize(x, bits, "bf16")
    ok = True
    for backend in ("jnp", "ffi"):
        try:
            xj = jnp.asarray(x) if operand == "f32" else jnp.asarray(x).astype(jnp.bfloat16)
            p = codec.quantize(xj, bits=bits, group_size=G, backend=backend)
        except Exception as e:  # the FFI kernels may not be built
            print(f"  check ({backend}): skipped: {e}")
            continue
        codes = np.asarray(p.codes)
        if bits == 8:
            q_codec = codes.astype(U32)
        else:  # LSB-first bit stream, per block of 8 codes
            bits_le = np.unpackbits(codes, axis=1, bitorder="little")
            q_codec = (bits_le.reshape(x.shape[0], G, bits).astype(U32)
                       << np.arange(bits, dtype=U32)).sum(axis=2).astype(U32)
        scale16 = np.asarray(p.scale).view(np.uint16)
        zero32 = np.asarray(p.zero).astype(np.float32)
        same = (np.array_equal(q_codec, q)
                and np.array_equal(scale16, scale_bits.astype(np.uint16))
                and np.array_equal(zero32.view(U32), zero.view(U32)))
        y = np.asarray(codec.dequantize(p, dtype=jnp.float32, backend=backend)).reshape(x.shape)
        same = same and np.array_equal(y.view(U32), dequantize(q, scale, zero).view(U32))
        ok = ok and same
        if not same:
            print(f"  check {operand} bits={bits} vs codec ({backend}): DIFFERENT")
    return ok


def machine():
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()}-core {model}, no GPU; python {sys.version.split()[0]}, "
            f"numpy {np.__version__}")


def measure(check: bool):
    """Every row (data set, operand, bits, zero type), and whether the bf16 option matched
    jax_flashcomm's codec bit for bit (None: not checked)."""
    rng = np.random.default_rng(0)
    results = []
    checked = None
    for name in DATASETS:
        for dtype in ("f32", "bf16"):
            x = make_data(name, dtype, rng)
            for bits in BITS:
                for zt in ZERO_TYPES:
                    q, scale, zero, _ = quantize(x, bits, zt)
                    y = dequantize(q, scale, zero)
                    rel_rms, max_step, mean_step = metrics(x, y, bits)
                    bpe, ratio = wire(bits, zt)
                    results.append(dict(dataset=name, operand=dtype, bits=bits, zero=zt,
                                        rel_rms=rel_rms, max_err_over_step=max_step,
                                        mean_group_max_err_over_step=mean_step,
                                        bytes_per_element=bpe, wire_ratio_vs_bf16=ratio))
                if check:
                    try:
                        import jax_flashcomm  # noqa: F401
                    except ImportError as e:
                        print(f"  check skipped: {e}")
                    else:
                        ok = check_against_codec(x, bits, dtype)
                        checked = ok if checked is None else (checked and ok)
    return results, checked


def print_tables(results) -> list:
    """The error table and the wire table on stdout; returns the wire rows."""
    print(f"\nzero storage type, G={G}, {N_GROUPS} groups per data set; scale bf16 (round up).")
    print("rel_rms = ||x'-x|| / ||x||;  max/step = max |x'-x| / ((max-min)/(2^b-1)) "
          "(ideal 0.5)\n")
    head = f"{'data':<13}{'operand':<8}{'bits':>4}  " + "".join(
        f"{zt + ' rel_rms':>14}{zt + ' max/step':>15}" for zt in ZERO_TYPES)
    print(head)
    print("-" * len(head))
    for name in DATASETS:
        for dtype in ("f32", "bf16"):
            for bits in BITS:
                row = {r["zero"]: r for r in results
                       if r["dataset"] == name and r["operand"] == dtype and r["bits"] == bits}
                cells = "".join(f"{row[zt]['rel_rms']:>14.3e}{row[zt]['max_err_over_step']:>15.3g}"
                                for zt in ZERO_TYPES)
                print(f"{name:<13}{dtype:<8}{bits:>4}  {cells}")
    print("\nwire bytes per element and ratio vs a bf16 ring all-reduce (2 bytes/element):")
    print(f"{'bits':>4}  "
          + "".join(f"{zt + ' B/elem':>13}{zt + ' ratio':>12}" for zt in ZERO_TYPES))
    wire_rows = []
    for bits in BITS:
        cells = ""
        for zt in ZERO_TYPES:
            bpe, ratio = wire(bits, zt)
            cells += f"{bpe:>13.4f}{ratio:>11.4f}x"
            wire_rows.append(dict(bits=bits, zero=zt, bytes_per_element=bpe,
                                  wire_ratio_vs_bf16=ratio))
        print(f"{bits:>4}  {cells}")
    return wire_rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-check", action="store_true",
                    help="skip the bit-for-bit check of the bf16 option against jax_flashcomm")
    ap.add_argument("--out", default=str(RESULTS / "zero_dtype.json"))
    args = ap.parse_args()

    t0 = time.time()
    results, checked = measure(not args.no_check)
    wire_rows = print_tables(results)
    f32_int8 = wire(8, "f32")[1]
    bf16_int8 = wire(8, "bf16")[1]
    verdict = lambda r: "over" if r > BUDGET else "within"  # noqa: E731
    print(f"\nint8 budget {BUDGET}x: f32 zero {f32_int8:.4f}x ({verdict(f32_int8)}),"
          f" 16-bit zero {bf16_int8:.4f}x ({verdict(bf16_int8)})")
    if checked is not None:
        print("bf16 option vs jax_flashcomm.codec (jnp and ffi backends, every data set): "
              + ("bit-identical codes, scales, zeros and decoded values" if checked
                 else "DIFFERENT"))
    elapsed = time.time() - t0
    print(f"elapsed {elapsed:.1f} s")

    out = dict(
        command=".venv/bin/python -m benchmarks.codec.zero_dtype",
        machine=machine(),
        group_size=G, groups_per_dataset=N_GROUPS, scale="bf16 rounded toward +inf",
        budget_int8_ratio=BUDGET, checked_against_codec=checked,
        results=results, wire=wire_rows, elapsed_s=round(elapsed, 2))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    write_page(args.out, out)
    print(f"wrote {args.out} and its page")
    if checked is False:
        sys.exit("the bf16 option differs from jax_flashcomm's codec")


if __name__ == "__main__":
    main()
