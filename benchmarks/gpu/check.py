"""The GPU check's measurements and report (``bash benchmarks/gpu_check.sh`` runs it).

On a machine with a GPU it measures, on the first GPU:

* each CUDA codec kernel (quantize, dequantize, dequantize_sum and dequantize_sum_quantize of
  8 chunks, dequantize_into) on bf16 operands of 16 and 256 MiB, G = 128, at 8 and 4 bits,
  with 4-bit spikes (1 per group) and 8-bit Hadamard rotation, against a device-to-device
  copy of the same bytes in the same run. Bytes are the operand's (bf16 in for quantize, bf16
  out for the decodes; for the fused ops the bf16 bytes of the 8 chunks summed). Each figure
  is the median over 7 rounds of one jitted program that runs the op 20 times (on 20 operands
  XLA cannot merge; dequantize_into chained in place), divided by 20: the GPU's time per call,
  not the host's dispatch (one dispatch of a 2 MiB op costs more than the op on an H200);
* with two or more GPUs, the quantized psum (8 and 4 bits, transports xla and p2p) against
  ``lax.psum`` on a mesh of 2, 4 or 8 GPUs, bf16, 16 and 64 MiB per rank, the same way.

Without a GPU it measures nothing and says so. Either way it writes ``--json`` (machine, build,
test results from pytest's ``--junitxml``, measurements) and the markdown tables between
``<!-- gpu_check:begin -->`` and ``<!-- gpu_check:end -->`` in ``--markdown`` (a rerun replaces
them), with "not run" where there was no GPU.

    .venv/bin/python -m benchmarks.gpu.check --junit gpu_tests.xml --build "ok (pip, 95 s)" \\
        --json docs/results/cuda_check.json --markdown docs/cuda.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from benchmarks.shared.results import REPO as ROOT
from benchmarks.shared.results import write_page

BEGIN, END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
MIB = 1 << 20
ROUNDS, CALLS = 7, 20
NOT_RUN = "not run"


# --- machine ---------------------------------------------------------------------------------

def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _ffi_version(include_dir) -> str | None:
    try:
        text = (pathlib.Path(include_dir) / "xla/ffi/api/c_api.h").read_text()
    except OSError:
        return None
    major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
    minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
    return f"{major.group(1)}.{minor.group(1)}" if major and minor else None


def machine() -> dict:
    import jax
    import jaxlib

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    plugins = sorted({f"{d.metadata['Name']} {d.version}" for d in _distributions()
                      if d.metadata["Name"].lower().startswith(("jax-cuda", "jax_cuda"))})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "cuda_plugins": plugins,
        "gpus": [str(getattr(d, "device_kind", d)) for d in gpus],
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,"
                            "memory.total", "--format=csv,noheader"]).splitlines(),
        "nvcc": (_run([os.environ.get("CUDACXX", "nvcc"), "--version"]).splitlines() or [""])[-1],
        "ffi_api_vendored": _ffi_version(ROOT / "third_party/xla_ffi/include"),
        "ffi_api_jaxlib": _ffi_version(jax.ffi.include_dir()),
        "cpu": platform.processor() or platform.machine(),
    }


def _distributions():
    from importlib import metadata

    return list(metadata.distributions())


# --- tests (the junit XML of pytest) ----------------------------------------------------------

def tests_from_junit(path) -> dict:
    if not path or not pathlib.Path(path).exists():
        return {"status": NOT_RUN, "passed": 0, "failed": 0, "skipped": 0, "skips": {},
                "failures": []}
    root = ET.parse(path).getroot()
    passed = failed = skipped = 0
    skips: dict[str, int] = {}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed += 1
            failures.append(f"{name}: {(bad.get('message') or '')[:300]}")
        elif skip is not None:
            skipped += 1
            reason = (skip.get("message") or "").removeprefix("Skipped: ")
            skips[reason] = skips.get(reason, 0) + 1
        else:
            passed += 1
    return {"status": "failed" if failed else "ok", "passed": passed, "failed": failed,
            "skipped": skipped, "skips": skips, "failures": failures}


# --- timing ----------------------------------------------------------------------------------

def _time(fn, *args, chain: bool = False) -> float:
    """Seconds per call: median over ROUNDS of CALLS calls enqueued back to back. ``chain``:
    each call's result is the next call's first argument (a donated buffer updated in place)."""
    import jax

    args = list(args)
    first = jax.block_until_ready(fn(*args))  # compile, warm up
    if chain:
        args[0] = first
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        outs = []
        for _ in range(CALLS):
            out = fn(*args)
            if chain:
                args[0] = out
            else:
                outs.append(out)
        jax.block_until_ready(args[0] if chain else outs)
        rounds.append((time.perf_counter() - t0) / CALLS)
    return statistics.median(rounds)


def time_in_program(op, args, chain: bool = False) -> float:
    """GPU seconds per call of ``op``: one jitted program runs it CALLS times, on CALLS
    parameters that XLA cannot merge (the same buffers, passed as distinct arguments) or, with
    ``chain``, as a chain ``o = op(o, args[1])`` on a donated buffer; median over ROUNDS."""
    import jax

    if chain:
        def body(o, *qs):
            for q in qs:
                o = op(o, q)
            return o
        fn = jax.jit(body, donate_argnums=0)
        o = jax.block_until_ready(fn(args[0], *[args[1]] * CALLS))  # compile, warm up
        rounds = []
        for _ in range(ROUNDS):
            t0 = time.perf_counter()
            o = jax.block_until_ready(fn(o, *[args[1]] * CALLS))
            rounds.append((time.perf_counter() - t0) / CALLS)
        return statistics.median(rounds)
    k = len(args)
    fn = jax.jit(lambda *a: [op(*a[i * k:(i + 1) * k]) for i in range(CALLS)])
    many = tuple(args) * CALLS
    jax.block_until_ready(fn(*many))
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*many))
        rounds.append((time.perf_counter() - t0) / CALLS)
    return statistics.median(rounds)


def _codec_cases():
    # (label, bits, spikes, rotation)
    return (("int8", 8, 0, 0), ("int4", 4, 0, 0), ("int4 spikes=1", 4, 1, 0),
            ("int8 hadamard", 8, 0, 1))


def measure_codec(device, sizes_mib=(16, 256)) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jax_flashcomm import codec

    rows = []
    chunks = 8
    for mib in sizes_mib:
        n = mib * MIB // 2
        x = jax.device_put(jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16), device)
        t_copy = time_in_program(jnp.copy, (x,))  # a device-to-device copy of the operand
        nbytes = n * 2
        for label, bits, spikes, rotation in _codec_cases():
            opts = dict(bits=bits, group_size=128, spikes=spikes, rotation=rotation,
                        backend="ffi")
            p = jax.jit(lambda a, o=opts: codec.quantize(a, **o))(x)
            pc = jax.block_until_ready(jax.jit(
                lambda a, o=opts: codec.quantize(a, num_chunks=chunks, **o))(x)).split_groups(
                    chunks)
            one = jax.block_until_ready(
                jax.jit(lambda a, o=opts: codec.quantize(a, **o))(x[: n // chunks]))
            out = jnp.zeros((n,), jnp.bfloat16)
            ops = {
                "quantize": (lambda a, o=opts: codec.quantize(a, **o), (x,)),
                "dequantize": (lambda q: codec.dequantize(q, backend="ffi"), (p,)),
                "dequantize_sum (8 chunks)": (
                    lambda q: codec.dequantize_sum(q, backend="ffi"), (pc,)),
                "dequantize_sum_quantize (8 chunks)": (
                    lambda q: codec.dequantize_sum_quantize(q, backend="ffi"), (pc,)),
                "dequantize_into": (  # in place, chained on a donated buffer
                    lambda o, q: codec.dequantize_into(o, q, n // 2, backend="ffi"),
                    (jax.device_put(out, device), one)),
            }
            for op, (fn, args) in ops.items():
                t = time_in_program(fn, args, chain=op == "dequantize_into")
                op_bytes = nbytes // chunks if op == "dequantize_into" else nbytes
                copy_t = t_copy * op_bytes / nbytes  # the copy of the same bytes
                rows.append({"op": op, "config": label, "mib": mib, "seconds": t,
                             "gbps": op_bytes / t / 1e9, "copy_gbps": op_bytes / copy_t / 1e9,
                             "vs_copy": copy_t / t})
                print(f"{op:36s} {label:14s} {mib:4d} MiB  {op_bytes / t / 1e9:8.1f} GB/s  "
                      f"{copy_t / t:5.2f} of a copy", flush=True)
    return rows


def measure_psum(devices, sizes_mib=(16, 64)) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc

    n = 1 << (min(len(devices), 8).bit_length() - 1)
    mesh = jax.sharding.Mesh(np.asarray(devices[:n]), ("i",))
    rows = []
    for mib in sizes_mib:
        local = mib * MIB // 2
        x = jax.device_put(jnp.ones((n, local), jnp.bfloat16), NamedSharding(mesh, P("i")))

        def program(f):
            return jax.jit(jax.shard_map(lambda v: f(v[0])[None], mesh=mesh, in_specs=P("i"),
                                         out_specs=P("i")))

        t_lax = _time(program(lambda v: lax.psum(v, "i")), x)
        rows.append({"op": "lax.psum", "config": "bf16", "mib": mib, "ranks": n,
                     "seconds": t_lax, "vs_lax": 1.0})
        for bits in (8, 4):
            for transport in ("xla", "p2p"):
                cfg = fc.CommConfig(bits=bits, min_bytes=0, transport=transport, backend="ffi")
                try:
                    t = _time(program(lambda v, c=cfg: fc.psum(v, "i", config=c)), x)
                except Exception as err:  # noqa: BLE001  (reported, not fatal)
                    rows.append({"op": "jax_flashcomm.psum", "config": f"int{bits} {transport}",
                                 "mib": mib, "ranks": n, "error": str(err)[:300]})
                    continue
                rows.append({"op": "jax_flashcomm.psum", "config": f"int{bits} {transport}",
                             "mib": mib, "ranks": n, "seconds": t, "vs_lax": t_lax / t})
                print(f"psum int{bits} {transport:4s} {mib:3d} MiB x {n}: {t * 1e3:8.3f} ms, "
                      f"{t_lax / t:5.2f}x lax.psum", flush=True)
    return rows


# --- report ----------------------------------------------------------------------------------

def _sizes_head(rows, default_sizes, columns):
    """The sizes (MiB) of a table's columns (``default_sizes`` where ``rows`` is the reason it
    was not run) and its two header lines."""
    sizes = sorted({r["mib"] for r in rows}) if not isinstance(rows, str) else default_sizes
    return sizes, ["| " + " | ".join(columns + [f"{mib} MiB" for mib in sizes]) + " |",
                   "|" + "---|" * (len(columns) + len(sizes))]


def markdown(report: dict) -> str:
    m, t = report["machine"], report["tests"]
    gpu = ", ".join(m["gpus"]) or "none"
    lines = [
        BEGIN,
        "<!-- written by benchmarks/gpu/check.py (bash benchmarks/gpu_check.sh); a rerun "
        "replaces everything between the markers -->",
        "",
        f"GPU: {gpu}; Python {m['python']}, jax {m['jax']}, "
        f"jaxlib {m['jaxlib']}, {', '.join(m['cuda_plugins']) or 'no CUDA plugin'}; "
        f"XLA FFI API {m['ffi_api_vendored']} (vendored headers) / {m['ffi_api_jaxlib']} "
        f"(jaxlib's). Full data: `docs/results/cuda_check.json`.",
        "",
        "| step | result |",
        "|---|---|",
        f"| build (`FLASHCOMM_CUDA=ON`) | {report['build']} |",
        f"| tests marked gpu | {t['passed']} passed, {t['failed']} failed, {t['skipped']} "
        f"skipped |",
    ]
    for reason, count in sorted(t["skips"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| skipped ({count}) | {reason.replace('|', '/')} |")
    for failure in t["failures"][:10]:
        first_line = failure.splitlines()[0] if failure else ""  # one table row each
        lines.append(f"| FAILED | {first_line.replace('|', '/')} |")
    lines += ["", "Codec kernels (bf16, G = 128) against a device-to-device copy of the same "
              "bytes: GB/s of the operand (fraction of the copy's):", ""]
    codec_rows = report["codec"]
    sizes, head = _sizes_head(codec_rows, [16, 256], ["op", "config"])
    lines += head
    if isinstance(codec_rows, str):
        for op in ("quantize", "dequantize", "dequantize_sum (8 chunks)",
                   "dequantize_sum_quantize (8 chunks)", "dequantize_into"):
            lines.append(f"| {op} | int8, int4, int4 spikes=1, int8 hadamard | "
                         + " | ".join([codec_rows] * len(sizes)) + " |")
    else:
        keyed = {(r["op"], r["config"], r["mib"]): r for r in codec_rows}
        for op, config in dict.fromkeys((r["op"], r["config"]) for r in codec_rows):
            cells = [f"{r['gbps']:.0f} ({r['vs_copy']:.2f})" if r else "-"
                     for r in (keyed.get((op, config, mib)) for mib in sizes)]
            lines.append(f"| {op} | {config} | " + " | ".join(cells) + " |")
    lines += ["", "Quantized psum against `lax.psum` (bf16, per rank): ms per call (speed-up "
              "over lax.psum):", ""]
    psum_rows = report["psum"]
    sizes, head = _sizes_head(psum_rows, [16, 64], ["op", "config", "ranks"])
    lines += head
    if isinstance(psum_rows, str):
        lines.append("| jax_flashcomm.psum vs lax.psum | int8, int4; xla, p2p | - | "
                     + " | ".join([psum_rows] * len(sizes)) + " |")
    else:
        keyed = {(r["op"], r["config"], r["mib"]): r for r in psum_rows}
        for op, config in dict.fromkeys((r["op"], r["config"]) for r in psum_rows):
            cells, ranks = [], "-"
            for mib in sizes:
                r = keyed.get((op, config, mib))
                ranks = r["ranks"] if r else ranks
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("error (see docs/results/cuda_check.json)")
                else:
                    cells.append(f"{r['seconds'] * 1e3:.3f} ({r['vs_lax']:.2f}x)")
            lines.append(f"| {op} | {config} | {ranks} | " + " | ".join(cells) + " |")
    lines.append(END)
    return "\n".join(lines)


def write_markdown(path, block: str) -> None:
    """Replace the marked block of ``path`` (appended at the end when it has none)."""
    path = pathlib.Path(path)
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", help="pytest --junitxml of the gpu tests")
    parser.add_argument("--build", default=NOT_RUN, help="the build step's result, one line")
    parser.add_argument("--json", default=str(ROOT / "docs/results/cuda_check.json"))
    parser.add_argument("--markdown", default=str(ROOT / "docs/cuda.md"))
    parser.add_argument("--quick", action="store_true", help="16 MiB codec figures only")
    args = parser.parse_args(argv)

    import jax

    report = {"machine": machine(), "build": args.build, "tests": tests_from_junit(args.junit)}
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        reason = f"{NOT_RUN}: no GPU"
        report["codec"], report["psum"] = reason, reason
        print(f"measurements {reason} (jax.devices('gpu') is empty)")
    else:
        report["codec"] = measure_codec(gpus[0], (16,) if args.quick else (16, 256))
        report["psum"] = (measure_psum(gpus) if len(gpus) > 1
                          else f"{NOT_RUN}: one GPU (lax.psum over one rank moves nothing)")
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    write_markdown(args.markdown, markdown(report))
    write_page(args.json, report, tables=markdown(report))
    print(f"wrote {args.json}, its page and the table in {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
