"""The all-reduce's epilogue fused (docs/fused_norm.md) against the unfused ops, on one CPU.

Epilogue: what follows the all-gather phase of a quantized all-reduce in a transformer block:
decode the gathered payload, add the residual, RMSNorm (and optionally quantize the normalised
rows for the next GEMM). Unfused: ``codec.dequantize`` (FFI) -> ``residual + y`` -> the RMSNorm
of ``nn.rms_norm`` (XLA fusions) [-> ``codec.quantize``]. Fused: ``codec.add_rms_norm`` (one FFI
kernel). Per shape, in one run:

* bytes read + written, counted from the compiled program: for every kernel of its entry
  computation (custom calls and XLA fusions; not parameters, tuples, bitcasts), the bytes of
  its operands and results. Per layer = 2 epilogues (after attention, after the MLP).
* CPU time: median and minimum of interleaved calls of both programs (fused / unfused
  alternately, so a shared machine loads both alike), and the ratios unfused / fused. The
  minimum is the least disturbed call of each: on a machine shared with other jobs it is the
  steadier figure.

Run::

    .venv/bin/python -m benchmarks.collectives.fused_norm [--reps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from benchmarks.shared.results import write_page
from benchmarks.shared.runtime import MALLOC_KEEP, reexec_with

if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_flashcomm import codec, nn  # noqa: E402
from models import machine  # noqa: E402

EPS = 1e-5
N_RANKS = 3       # the payload is a sum over 3 ranks' contributions (SmolLM2 at TP=3)
# (label, tokens, hidden, dtype, out_bits, out_group_size)
CASES = [
    ("SmolLM2 bf16", 512, 576, jnp.bfloat16, None, None),
    ("SmolLM2 bf16 +q8", 512, 576, jnp.bfloat16, 8, 64),
    ("SmolLM2 f32", 512, 576, jnp.float32, None, None),
    ("8B-width bf16", 512, 4096, jnp.bfloat16, None, None),
    ("8B-width bf16 +q8", 512, 4096, jnp.bfloat16, 8, 128),
]
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "s8": 1, "s32": 4, "u32": 4, "pred": 1,
         "f64": 8, "s64": 8, "u16": 2, "s16": 2}
_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
        if dtype in _ITEM:
            total += _ITEM[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def _closing(text: str, depth: int) -> int:
    """Index of the parenthesis that brings ``depth`` (open ones before ``text``) to 0."""
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def _split_instruction(line: str):
    """``(name, shape text, opcode, operand names)`` of one HLO instruction line."""
    name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
    if rest.startswith("("):            # tuple shape: up to its matching parenthesis
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 2:]
    else:
        shape, rest = rest.split(" ", 1)
    opcode, args = rest.split("(", 1)
    return name, shape, opcode, re.findall(r"%([\w.\-]+)", args[:_closing(args, 1)])


def counted_bytes(compiled) -> tuple[int, list[tuple[str, int]]]:
    """Bytes read + written by the kernels of a compiled program's entry computation."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY"):].split("\n")[1:]
    shapes, kernels = {}, []
    for line in entry:
        if " = " not in line:
            continue
        name, shape, opcode, operands = _split_instruction(line)
        shapes[name.lstrip("%")] = shape
        if opcode in _SKIP:
            continue
        moved = _shape_bytes(shape) + sum(_shape_bytes(shapes.get(o, "")) for o in operands)
        kernels.append((f"{opcode}:{name.lstrip('%')}", moved))
    return sum(b for _, b in kernels), kernels


def _operands(tokens, hidden, dtype, seed=0):
    rng = np.random.default_rng(seed)
    total = sum(rng.standard_normal((tokens, hidden)) for _ in range(N_RANKS))
    p = codec.quantize(jnp.asarray(total, dtype), bits=8, rotation=1, backend="ffi")
    r = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    w = jnp.asarray(rng.standard_normal(hidden) * 0.1 + 1, dtype)
    return p, r, w


def _programs(out_bits, out_g):
    def unfused(p, r, w):
        h = r + codec.dequantize(p, backend="ffi")
        out = nn.rms_norm(h, w, EPS)
        if out_bits is not None:
            out = codec.quantize(out, bits=out_bits, group_size=out_g, backend="ffi")
        return out, h

    def fused(p, r, w):
        return codec.add_rms_norm(p, r, w, eps=EPS, out_bits=out_bits,
                                  out_group_size=out_g or 128, backend="ffi")

    return jax.jit(unfused), jax.jit(fused)


def _interleaved(fns, args, reps):
    times = [[] for _ in fns]
    for f in fns:
        jax.block_until_ready(f(*args))
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[i].append(time.perf_counter() - t)
    return [(statistics.median(t), min(t)) for t in times]


def run(reps: int) -> dict:
    rows = []
    for label, tokens, hidden, dtype, out_bits, out_g in CASES:
        args = _operands(tokens, hidden, dtype)
        unfused, fused = _programs(out_bits, out_g)
        bu, ku = counted_bytes(unfused.lower(*args).compile())
        bf, kf = counted_bytes(fused.lower(*args).compile())
        (tu, tu_min), (tf, tf_min) = _interleaved((unfused, fused), args, reps)
        rows.append(dict(case=label, tokens=tokens, hidden=hidden,
                         dtype=str(jnp.dtype(dtype)), out_bits=out_bits,
                         unfused_bytes_per_layer=2 * bu, fused_bytes_per_layer=2 * bf,
                         unfused_kernels=len(ku), fused_kernels=len(kf),
                         unfused_us_per_layer=2e6 * tu, fused_us_per_layer=2e6 * tf,
                         speedup=tu / tf, unfused_min_us_per_layer=2e6 * tu_min,
                         fused_min_us_per_layer=2e6 * tf_min, speedup_min=tu_min / tf_min))
    return dict(machine=machine.describe(), isa=codec.cpu_isa(), reps=reps,
                command=".venv/bin/python -m benchmarks.collectives.fused_norm", rows=rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(machine.first_line())
    print(f"codec ISA build: {codec.cpu_isa()}; {args.reps} interleaved calls, medians and "
          f"minima; per layer = 2 epilogues")
    result = run(args.reps)
    print(f"{'case':20s} {'kernels u/f':>11s} {'MB/layer unfused':>17s} {'fused':>8s} "
          f"{'ratio':>6s} {'us/layer unfused':>17s} {'fused':>8s} {'speedup':>8s} "
          f"{'min: unfused':>12s} {'fused':>6s} {'speedup':>8s}")
    for r in result["rows"]:
        print(f"{r['case']:20s} {r['unfused_kernels']:>5d}/{r['fused_kernels']:<5d} "
              f"{r['unfused_bytes_per_layer'] / 1e6:17.2f} {r['fused_bytes_per_layer'] / 1e6:8.2f} "
              f"{r['unfused_bytes_per_layer'] / r['fused_bytes_per_layer']:6.2f} "
              f"{r['unfused_us_per_layer']:17.0f} {r['fused_us_per_layer']:8.0f} "
              f"{r['speedup']:7.2f}x {r['unfused_min_us_per_layer']:12.0f} "
              f"{r['fused_min_us_per_layer']:6.0f} {r['speedup_min']:7.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        write_page(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
