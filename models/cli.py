"""What the model CLIs share: the communication and TP options, and the setup they imply.

The device count must be set before jax is imported, so :func:`parse` runs first and the
modules that import jax are imported by :func:`setup` after it.
"""

from __future__ import annotations

import argparse
import os
import sys

COMM_CHOICES = ("exact", "flash", "overlap", "flash+overlap")


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="a known model name (smollm2), a GGUF file or a Hugging Face "
                             "directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--devices", type=int, default=None,
                        help="number of CPU devices to create (default: the TP size)")
    parser.add_argument("--comm", default="exact",
                        help=f"communication strategy: {', '.join(COMM_CHOICES)}")
    parser.add_argument("--bits", type=int, default=None,
                        help="bits of both phases of the quantized all-reduce (flash kinds; "
                             "default 8)")
    parser.add_argument("--rs-bits", type=int, default=None, help="reduce-scatter phase bits")
    parser.add_argument("--ag-bits", type=int, default=None, help="all-gather phase bits")
    parser.add_argument("--group-size", type=int, default=128, help="values per group")
    parser.add_argument("--spikes", default="auto",
                        help="values per group kept in bf16 (0..16, or auto)")
    parser.add_argument("--rotation", default="0",
                        help="group rotation: 0/none, hadamard, signed_hadamard")
    parser.add_argument("--min-bytes", type=int, default=0,
                        help="messages below this many bytes per rank stay exact (default 0: "
                             "quantize every all-reduce of the model)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="parameter and activation dtype")


def check(parser: argparse.ArgumentParser, args) -> None:
    """Option errors that need no jax: reported by argparse (exit status 2)."""
    if args.comm not in COMM_CHOICES:
        parser.error(f"unknown --comm {args.comm!r}: choose one of {', '.join(COMM_CHOICES)}")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.devices is not None and args.devices < args.tp:
        parser.error(f"--devices {args.devices} is fewer than --tp {args.tp}")
    quant = (args.bits, args.rs_bits, args.ag_bits)
    if args.comm in ("exact", "overlap") and any(b is not None for b in quant):
        parser.error(f"--comm {args.comm} does not quantize: --bits/--rs-bits/--ag-bits need "
                     f"--comm flash or flash+overlap")


def set_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices (before jax is imported)."""
    if "jax" in sys.modules:
        raise RuntimeError("set_devices must run before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def comm_from_args(args):
    """The :class:`jax_flashcomm.nn.TPComm` the options describe."""
    from jax_flashcomm import CommConfig
    from jax_flashcomm.nn import TPComm

    config = None
    if args.comm in ("flash", "flash+overlap"):
        spikes = args.spikes if args.spikes == "auto" else int(args.spikes)
        rotation = int(args.rotation) if args.rotation.isdigit() else args.rotation
        config = CommConfig(bits=8 if args.bits is None else args.bits, rs_bits=args.rs_bits,
                            ag_bits=args.ag_bits, group_size=args.group_size,
                            min_bytes=args.min_bytes, spikes=spikes, rotation=rotation)
    return TPComm(args.comm, "tp", config)


def setup(args):
    """``(engine, checkpoint)`` for the options: the devices, the mesh, the model."""
    set_devices(args.devices or args.tp)
    import jax
    import jax.numpy as jnp

    from models.engine import Engine
    from models.weights import load_model

    comm = comm_from_args(args)
    if len(jax.devices()) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices, jax has {len(jax.devices())}")
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh, comm=comm, dtype=dtype)
    return model, ckpt, mesh, comm


def describe(args) -> str:
    """A one-line summary of the communication options."""
    if args.comm in ("exact", "overlap"):
        return args.comm
    bits = 8 if args.bits is None else args.bits
    rs = args.rs_bits if args.rs_bits is not None else bits
    ag = args.ag_bits if args.ag_bits is not None else bits
    return f"{args.comm} int{rs}/int{ag} G={args.group_size} spikes={args.spikes}"
