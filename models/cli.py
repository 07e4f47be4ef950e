"""What the model CLIs share: the communication and TP options, and the setup they imply.

The device count must be set before JAX's backends start, so :func:`setup` sets it before it
builds anything (``jax_num_cpu_devices``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

COMM_CHOICES = ("exact", "flash", "overlap", "flash+overlap")


#: The communication options: every field of jax_flashcomm.CommConfig, as --flag (type, help).
#: Their defaults are the library's (CommConfig's); a flag not given leaves the config's value.
CONFIG_FLAGS = {
    "bits": (int, "bits of both phases of the quantized collectives (flash kinds)"),
    "rs_bits": (int, "reduce-scatter phase bits"),
    "ag_bits": (int, "all-gather phase bits"),
    "group_size": (int, "values per quantization group"),
    "min_bytes": (int, "messages below this many bytes per rank stay exact (0: quantize "
                       "every all-reduce of the model)"),
    "backend": (str, "codec backend: auto, ffi or jnp"),
    "grad": (str, "cotangent collectives: exact or quantized"),
    "rotation": (str, "group rotation: auto, 0/none, 1/hadamard, 2/signed_hadamard"),
    "spikes": (str, "values per group kept in bf16: auto or 0..16"),
    "transport": (str, "how the bytes move: auto, xla or p2p"),
    "p2p_timeout_ms": (int, "the p2p transport's limit on a wait for a peer"),
}


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="a known model name (smollm2), a GGUF file or a Hugging Face "
                             "directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--devices", type=int, default=None,
                        help="number of CPU devices to create (default: the TP size)")
    parser.add_argument("--comm", default="exact",
                        help=f"communication strategy: {', '.join(COMM_CHOICES)}")
    parser.add_argument("--config", default=None, metavar="JSON",
                        help="a jax_flashcomm.CommConfig as a JSON object of its fields (a file "
                             "or inline); the option flags below update it")
    from jax_flashcomm.config import CommConfig

    defaults = CommConfig()
    for name, (kind, text) in CONFIG_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                            help=f"{text} (default: {getattr(defaults, name)!r})")
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
    try:
        comm_options(args)
    except (TypeError, ValueError, OSError) as e:
        parser.error(str(e))


def _number_or_name(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


def comm_options(args) -> dict:
    """``{"config": CommConfig | None, option: value}``: the --config and the option flags
    given (the others are left to the config's defaults)."""
    from jax_flashcomm.config import CommConfig

    config = None
    if args.config is not None:
        text = args.config
        if not text.lstrip().startswith("{"):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config: not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError("--config: expected a JSON object of CommConfig fields")
        config = CommConfig(**fields)
    options = {name: getattr(args, name) for name in CONFIG_FLAGS
               if getattr(args, name) is not None}
    for name in ("rotation", "spikes"):
        if name in options:
            options[name] = _number_or_name(options[name])
    if args.comm in ("flash", "flash+overlap"):
        CommConfig(**{**({} if config is None else dataclasses.asdict(config)), **options})
    return {"config": config, **options}


def set_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices (before JAX's backends start: the first jax.devices())."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backends already started
        raise RuntimeError(f"set_devices({n}) must run before JAX's backends start: {e}") from e


def comm_from_args(args):
    """The :class:`jax_flashcomm.nn.TPComm` the options describe."""
    from jax_flashcomm.nn import TPComm

    return TPComm(args.comm, "tp", **comm_options(args))


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
    c = comm_from_args(args).config
    return (f"{args.comm} int{c.phase1_bits}/int{c.phase2_bits} G={c.group_size} "
            f"spikes={c.spikes} rotation={c.rotation} min_bytes={c.min_bytes}")
