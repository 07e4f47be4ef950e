"""What the model CLIs share: the communication and TP options, the argument check, the error
convention, and the setup they imply.

The device count must be set before JAX's backends start, so :func:`setup` sets it before it
builds anything (``jax_num_cpu_devices``).

Errors (docs/models.md, "CLI errors"): every CLI's ``main`` calls :func:`check` right after
parsing, before it imports jax's backends or loads a model; a bad argument is reported by
argparse (``usage: ...`` then ``<prog>: error: <message>``, exit status 2). What only the run can
find (a corrupt checkpoint, a chat template over its limits, a text too short for one window)
goes through :func:`run_checked`: the same ``<prog>: error: <message>`` line, exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import zipfile

from jax_flashcomm.config import COMM_KINDS as COMM_CHOICES  # the one tuple of kinds


#: The communication options: every field of jax_flashcomm.CommConfig, as --flag (type, help).
#: Their defaults are the library's (CommConfig's); a flag not given leaves the config's value.
CONFIG_FLAGS = {
    "bits": (int, "bits of both phases of the quantized collectives (flash kinds)"),
    "rs_bits": (int, "reduce-scatter phase bits"),
    "ag_bits": (int, "all-gather phase bits"),
    "group_size": (int, "values per quantization group"),
    "min_bytes": (str, "'auto': each call takes the path the tuning table or the cost model "
                       "predicts fastest; an int: messages below this many bytes per rank stay "
                       "exact (0: quantize every all-reduce of the model)"),
    "backend": (str, "codec backend: auto, ffi or jnp"),
    "grad": (str, "cotangent collectives: exact or quantized"),
    "rotation": (str, "group rotation: auto, 0/none, 1/hadamard, 2/signed_hadamard"),
    "spikes": (str, "values per group kept in bf16: auto or 0..16"),
    "transport": (str, "how the bytes move: auto, xla or p2p"),
    "p2p_timeout_ms": (int, "the p2p transport's limit on a wait for a peer"),
    "format": (str, "group format of both quantized phases: int (--bits), fp8, mxfp4 or nvfp4"),
    "rs_format": (str, "reduce-scatter phase format"),
    "ag_format": (str, "all-gather phase format"),
}
#: The flags with a fixed set of values.
FLAG_CHOICES = {name: ("int", "fp8", "mxfp4", "nvfp4") for name in ("format", "rs_format",
                                                                     "ag_format")}


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
                            choices=FLAG_CHOICES.get(name),
                            help=f"{text} (default: {getattr(defaults, name)!r})")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="parameter and activation dtype")
    parser.add_argument("--fuse-norm", dest="fuse_norm", action="store_true",
                        help="fuse every all-reduce with the residual add and the next RMSNorm "
                             "(TPComm(fuse_norm=True), docs/fused_norm.md)")
    parser.add_argument("--comm-policy", dest="comm_policy", default=None, metavar="FILE",
                        help="a per-site jax_flashcomm.CommPolicy (JSON, as models.calibrate "
                             "writes): each all-reduce gets its site's config; replaces --comm "
                             "and the quantization flags (docs/calibration.md)")


#: int (or float) options and the least value each takes; checked on any parser that has them.
AT_LEAST = {"tp": 1, "devices": 1, "max_new_tokens": 1, "window": 2, "max_windows": 1,
            "cache_len": 1, "tokens": 2, "top_k": 0, "temperature": 0.0, "rounds": 1,
            "seed": -2**63}
#: options that must be at most a bound (a PRNG seed is a 64-bit int)
AT_MOST = {"top_p": 1.0, "seed": 2**63 - 1}
#: float options that must be finite (NaN passes every comparison above)
FINITE = ("temperature", "top_p", "max_shard_mb")
#: options that must be > 0
POSITIVE = ("max_shard_mb", "top_p")
#: options naming a file the run reads (must exist and be a regular file)
INPUT_FILES = ("text", "prompts", "ref", "comm_policy")
#: options naming a file the run writes (its folder must exist; it must not be a folder)
OUTPUT_FILES = ("json", "out", "plot")
#: options naming a checkpoint: a known name or an existing path
MODEL_OPTIONS = ("model", "src")


def check(parser: argparse.ArgumentParser, args) -> None:
    """The argument check of every model CLI, called right after parsing: whatever can be found
    wrong before the run (no jax backend, no model load; the TP size against the checkpoint's
    heads reads only its config) is reported by argparse (``parser.error``: exit status 2).

    Checks the options the parser has, by destination name: the ints of :data:`AT_LEAST` /
    :data:`POSITIVE`; the input files of :data:`INPUT_FILES` (``--text``: UTF-8 and not empty;
    ``--prompts``: a JSON list of strings; ``--ref``: an npz); the folders of the outputs of
    :data:`OUTPUT_FILES` and ``outdir``; the checkpoint (:data:`MODEL_OPTIONS`) and whether its
    heads split over ``--tp`` (one size or a list); ``--settings`` (``models.compare``);
    ``--kinds``; the communication options of :func:`add_common`.
    """
    def flag(dest):
        return "--" + dest.replace("_", "-")

    for dest, least in AT_LEAST.items():
        values = getattr(args, dest, None)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and v < least:
                parser.error(f"{flag(dest)} must be >= {least}, got {v}")
    for dest in FINITE:
        v = getattr(args, dest, None)
        if v is not None and not math.isfinite(v):
            parser.error(f"{flag(dest)} must be a finite number, got {v}")
    for dest, most in AT_MOST.items():
        v = getattr(args, dest, None)
        if v is not None and v > most:
            parser.error(f"{flag(dest)} must be <= {most}, got {v}")
    for dest in POSITIVE:
        v = getattr(args, dest, None)
        if v is not None and not v > 0:
            parser.error(f"{flag(dest)} must be > 0, got {v}")
    for dest in INPUT_FILES:
        path = getattr(args, dest, None)
        if path is not None:
            _check_input(parser, flag(dest), dest, path)
    for dest in OUTPUT_FILES:
        path = getattr(args, dest, None)
        if path is not None:
            _check_output(parser, flag(dest), pathlib.Path(path))
    outdir = getattr(args, "outdir", None)
    if outdir is not None and pathlib.Path(outdir).exists() and not pathlib.Path(outdir).is_dir():
        parser.error(f"outdir {outdir}: exists and is not a folder")
    for dest in MODEL_OPTIONS:
        model = getattr(args, dest, None)
        if model is not None:
            _check_model(parser, model, getattr(args, "tp", None))
    if getattr(args, "settings", None) is not None:
        try:
            if not args.settings.strip():
                raise ValueError("no setting given")
            for name in args.settings.split(","):
                parse_setting(name.strip())
        except (TypeError, ValueError) as e:
            parser.error(f"--settings {args.settings!r}: {e}")
    if getattr(args, "kinds", None) is not None:
        bad = [k for k in args.kinds.split(",") if k not in COMM_CHOICES]
        if bad:
            parser.error(f"--kinds: unknown {', '.join(map(repr, bad))}: choose among "
                         f"{', '.join(COMM_CHOICES)}")
    if getattr(args, "comm", None) is not None and hasattr(args, "bits"):
        _check_comm(parser, args)


def _check_input(parser, flag: str, dest: str, path: str) -> None:
    p = pathlib.Path(path)
    if not p.exists():
        parser.error(f"{flag} {path}: no such file")
    if not p.is_file():
        parser.error(f"{flag} {path}: not a file")
    if dest == "ref":
        if not zipfile.is_zipfile(p):
            parser.error(f"{flag} {path}: not an npz file (models/reference_hf.py writes one)")
        return
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"{flag} {path}: cannot read it as UTF-8 text ({e})")
    if dest == "text" and not text.strip():
        parser.error(f"{flag} {path}: the file is empty: no windows to score")
    if dest == "prompts":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            parser.error(f"{flag} {path}: not JSON ({e})")
        if (not isinstance(prompts, list) or not prompts
                or not all(isinstance(x, str) for x in prompts)):
            parser.error(f"{flag} {path}: expected a JSON list of prompt strings")


def _check_output(parser, flag: str, path: pathlib.Path) -> None:
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    if path.is_symlink() and not path.exists():
        parser.error(f"{flag} {path}: a symlink that leads nowhere (dangling, or a loop)")
    if path.is_dir():
        parser.error(f"{flag} {path}: is a folder, not a file")
    if path.exists() and not path.is_file() and str(path) != os.devnull:
        parser.error(f"{flag} {path}: not a regular file (a FIFO or a device would block or "
                     f"fill up after the whole run)")
    if not folder.is_dir():
        parser.error(f"{flag} {path}: no such folder {str(folder)!r}")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: the folder {str(folder)!r} is not writable")


def model_heads(model: str) -> tuple[int, int] | None:
    """``(query heads, KV heads)`` of a checkpoint, read from its config alone (a GGUF file's
    metadata header, a Hugging Face ``config.json``); ``None`` when they cannot be read that
    way (a known model not fetched yet, an unreadable file: the load reports those)."""
    from models.checkpoints.fetch import REGISTRY, cache_dir

    path = (cache_dir() / REGISTRY[model].filename if model in REGISTRY
            else pathlib.Path(model).expanduser())
    try:
        if path.is_dir():
            d = json.loads((path / "config.json").read_text(encoding="utf-8"))
            n = int(d["num_attention_heads"])
            return n, int(d.get("num_key_value_heads", n))
        if path.is_file():
            return _gguf_heads(path)
    except (OSError, ValueError, KeyError, TypeError):  # CheckpointError is a ValueError
        pass
    return None


def _gguf_heads(path: pathlib.Path) -> tuple[int, int] | None:
    """The ``*.attention.head_count`` / ``head_count_kv`` of a GGUF's metadata, read by the
    checkpoint reader's own header scan (no tensor is read)."""
    from models.checkpoints.gguf import scan_gguf

    fields = scan_gguf(path).fields
    heads = next((v for k, (_, v) in fields.items() if k.endswith(".attention.head_count")),
                 None)
    kv = next((v for k, (_, v) in fields.items() if k.endswith(".attention.head_count_kv")),
              heads)
    return None if heads is None else (int(heads), int(kv))


def _check_model(parser, model: str, tp) -> None:
    from models.checkpoints.fetch import REGISTRY

    path = pathlib.Path(model).expanduser()
    if model not in REGISTRY and not path.exists():
        parser.error(f"no such model file or directory: {model!r} (known model names: "
                     f"{', '.join(sorted(REGISTRY))})")
    if model not in REGISTRY and not (path.is_file() or path.is_dir()):
        parser.error(f"{model}: not a regular file or a checkpoint directory")
    sizes = [s for s in (tp if isinstance(tp, list) else [tp]) if isinstance(s, int) and s > 1]
    heads = model_heads(model) if sizes else None
    if heads is None:
        return
    from jax_flashcomm.nn.layers import check_heads

    for size in sizes:
        try:
            check_heads(heads[0], heads[1], size)
        except ValueError as e:
            parser.error(f"--tp {size}: {e}")


def tp_list(text: str) -> list[int]:
    """An argparse type: a comma-separated list of TP sizes."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text!r}") \
            from None


def _phase(token: str, first: bool):
    """One phase of a setting name: ``("int", B)`` for ``intB`` (or a bare ``B`` after the
    slash), ``("format", F)`` for fp8 / mxfp4 / nvfp4; None otherwise."""
    if token in ("fp8", "mxfp4", "nvfp4"):
        return "format", token
    digits = token[3:] if token.startswith("int") else ("" if first else token)
    return ("int", int(digits)) if digits.isdigit() else None


def parse_setting(name: str):
    """``(label, TPComm)`` of a setting name of ``models.compare``: ``exact``, ``overlap``,
    ``intB`` (flash, B bits both phases, every all-reduce quantized), ``intR/A`` (flash,
    reduce-scatter R bits, all-gather A bits), a floating-point format (``fp8``, ``mxfp4``,
    ``nvfp4``) in place of either phase (``nvfp4``, ``nvfp4/fp8``, ``int4/fp8``),
    ``overlap+`` any of those, or ``auto`` / ``autoB`` (the automatic choice per call, within
    a budget of B bits, default 8; ``overlap+auto``, ``overlap+autoB``: in the
    sequence-parallel layout)."""
    from jax_flashcomm import CommConfig
    from jax_flashcomm.nn import TPComm

    if name in ("exact", "overlap"):
        return name, TPComm.from_kind(name)
    before, sequence_parallel, rest = name.rpartition("overlap+")
    if not before and rest.startswith("auto") and (rest == "auto" or rest[4:].isdigit()):
        return name, TPComm.from_kind("auto+overlap" if sequence_parallel else "auto",
                                      bits=int(rest[4:] or 8))
    kind, plus, quant = name.partition("+")
    if plus and kind == "overlap":
        kind = "flash+overlap"
    elif not plus:
        kind, quant = "flash", name
    else:
        kind = None
    first, slash, second = quant.partition("/")
    rs = _phase(first, True)
    ag = _phase(second, False) if slash else None
    if kind is None or rs is None or (slash and ag is None):
        raise ValueError(f"unknown setting {name!r}: use exact, overlap, intB, intR/A, fp8, "
                         f"mxfp4, nvfp4 (either phase: nvfp4/fp8), overlap+<setting>, auto, "
                         f"autoB or overlap+auto[B]")
    fields = {"min_bytes": 0}
    if rs[0] == "int":
        fields["bits"] = rs[1]
    else:
        fields["format"] = rs[1]
    if ag is not None and ag[0] == "int":
        fields.update(ag_bits=ag[1], ag_format="int")
    elif ag is not None:
        fields["ag_format"] = ag[1]
    return name, TPComm.from_kind(kind, config=CommConfig(**fields))


def format_setting(fmt: str | None, rs_format: str | None, ag_format: str | None) -> str | None:
    """The ``models.compare`` setting name the ``--format`` / ``--rs-format`` / ``--ag-format``
    flags describe (None when none is given): ``F`` or ``R/A``."""
    if fmt is None and rs_format is None and ag_format is None:
        return None
    rs, ag = (("int8" if f == "int" else f) for f in (rs_format or fmt or "int",
                                                      ag_format or fmt or "int"))
    return rs if rs == ag else f"{rs}/{ag}"


#: The errors a run meets in its inputs (CheckpointError, ChatTemplateError, a text too short,
#: FileNotFoundError, JSON and UTF-8 errors are subclasses): one line, exit status 2.
RUN_ERRORS = (ValueError, OSError, zipfile.BadZipFile)


def fail(parser: argparse.ArgumentParser, message) -> int:
    """Print ``<prog>: error: <message>`` (on one line) to stderr; return exit status 2."""
    text = " ".join(str(message).split()) or type(message).__name__
    print(f"{parser.prog}: error: {text}", file=sys.stderr, flush=True)
    return 2


def run_checked(parser: argparse.ArgumentParser, body, *args, **kwargs) -> int:
    """``body(*args, **kwargs)`` (an exit status); a :data:`RUN_ERRORS` error instead prints
    one ``<prog>: error: ...`` line and returns 2."""
    try:
        return body(*args, **kwargs)
    except RUN_ERRORS as e:
        sys.stdout.flush()
        return fail(parser, e)


def _check_comm(parser: argparse.ArgumentParser, args) -> None:
    """Option errors of :func:`add_common`'s communication options."""
    if args.comm not in COMM_CHOICES:
        parser.error(f"unknown --comm {args.comm!r}: choose one of {', '.join(COMM_CHOICES)}")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if getattr(args, "comm_policy", None) is not None:
        given = [flag for flag, v in (("--comm", None if args.comm == "exact" else args.comm),
                                      ("--config", args.config),
                                      *(("--" + n.replace("_", "-"), getattr(args, n))
                                        for n in CONFIG_FLAGS)) if v is not None]
        if given:
            parser.error(f"--comm-policy gives every all-reduce its config: drop "
                         f"{', '.join(given)}")
        try:
            load_policy(args.comm_policy)
        except (ValueError, OSError) as e:
            parser.error(f"--comm-policy: {e}")
    if args.devices is not None and args.devices < args.tp:
        parser.error(f"--devices {args.devices} is fewer than --tp {args.tp}")
    quant = (args.bits, args.rs_bits, args.ag_bits, args.format, args.rs_format, args.ag_format)
    if args.comm in ("exact", "overlap") and any(b is not None for b in quant):
        parser.error(f"--comm {args.comm} does not quantize: --bits/--rs-bits/--ag-bits and "
                     f"--format/--rs-format/--ag-format need --comm flash, flash+overlap, auto "
                     f"or auto+overlap")
    if args.comm.startswith("auto") and args.min_bytes not in (None, "auto"):
        parser.error(f"--comm {args.comm} chooses the path of every call; --min-bytes "
                     f"{args.min_bytes} pins the size policy (use --comm "
                     f"{args.comm.replace('auto', 'flash')})")
    try:
        comm_options(args)
    except (TypeError, ValueError, OSError) as e:
        parser.error(str(e))


def _number_or_name(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


#: The largest JSON config or policy a CLI reads (a CommConfig is a few hundred bytes).
MAX_JSON_BYTES = 1 << 20


def read_regular(path, what: str, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes (never a FIFO, a device or
    a folder, which would block or read forever).

    Raises:
      ValueError: naming ``what`` and the path.
    """
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"{what} {path}: no such file")
    if not p.is_file():
        raise ValueError(f"{what} {path}: not a regular file")
    if p.stat().st_size > limit:
        raise ValueError(f"{what} {path}: {p.stat().st_size} bytes, more than {limit}")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: cannot read it as UTF-8 text ({e})") from None


def config_fields(args) -> dict | None:
    """The JSON object of ``--config`` (inline, or a file's), None without the flag.

    Raises:
      ValueError: not a regular file, not JSON, nested too deep, or not an object.
    """
    if getattr(args, "config", None) is None:
        return None
    text = args.config
    if not text.lstrip().startswith(("{", "[")):
        text = read_regular(text, "--config")
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config: not JSON ({e})") from None
    except RecursionError:
        raise ValueError("--config: not a CommConfig (nested too deep)") from None
    if not isinstance(fields, dict):
        raise ValueError("--config: expected a JSON object of CommConfig fields")
    return fields


def comm_options(args) -> dict:
    """``{"config": CommConfig | None, option: value}``: the --config and the option flags
    given (the others are left to the config's defaults)."""
    from jax_flashcomm.config import CommConfig

    fields = config_fields(args)
    config = None if fields is None else CommConfig(**fields)
    options = {name: getattr(args, name) for name in CONFIG_FLAGS
               if getattr(args, name) is not None}
    for name in ("rotation", "spikes", "min_bytes"):
        if name in options:
            options[name] = _number_or_name(options[name])
    if args.comm in ("flash", "flash+overlap", "auto", "auto+overlap"):
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

    return TPComm.from_kind(args.comm, "tp", fuse_norm=getattr(args, "fuse_norm", False),
                  **comm_options(args))


def load_policy(path):
    """The :class:`jax_flashcomm.CommPolicy` in the file ``path``."""
    from jax_flashcomm.policy import CommPolicy

    return CommPolicy.load(path)


def setup(args):
    """``(model, checkpoint, mesh, comm)`` for the options: the devices, the mesh, the model
    (with ``--comm-policy``, each all-reduce set to its site's config; ``comm`` is the
    policy's default)."""
    set_devices(args.devices or args.tp)
    import jax
    import jax.numpy as jnp

    from models.engine import Engine
    from models.llama.params import load_model

    comm = comm_from_args(args)
    if len(jax.devices()) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices, jax has {len(jax.devices())}")
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh, comm=comm, dtype=dtype)
    if getattr(args, "comm_policy", None) is not None:
        from models.llama import policy_comms, set_comm

        comm, overrides = policy_comms(load_policy(args.comm_policy), ckpt.config.n_layers,
                                       fuse_norm=getattr(args, "fuse_norm", False))
        set_comm(model, comm, overrides=overrides)
    return model, ckpt, mesh, comm


def quantize_every_call(args, log=None) -> None:
    """For the accuracy tools: a quantized ``--comm`` (flash, flash+overlap) with no
    ``--min-bytes`` and no ``min_bytes`` in ``--config`` quantizes every all-reduce
    (``--min-bytes 0``), so that the setting evaluated is the setting named; the library's
    ``"auto"`` would keep exact ``lax`` wherever it predicts that faster."""
    if (getattr(args, "comm", None) not in ("flash", "flash+overlap")
            or getattr(args, "min_bytes", "unset") is not None
            or getattr(args, "comm_policy", None) is not None
            or "min_bytes" in (config_fields(args) or {})):
        return
    args.min_bytes = "0"
    if log is not None:
        print("quantizing every all-reduce (--min-bytes 0; --min-bytes auto lets the size "
              "policy keep some exact)", file=log)


def describe(args) -> str:
    """A one-line summary of the communication options."""
    fused = " fuse_norm" if getattr(args, "fuse_norm", False) else ""
    if getattr(args, "comm_policy", None) is not None:
        policy = load_policy(args.comm_policy)
        return f"comm policy {args.comm_policy} ({len(policy.sites)} sites){fused}"
    if args.comm in ("exact", "overlap"):
        return args.comm + fused
    c = comm_from_args(args).config
    phases = "/".join(f"int{b}" if f == "int" else f for f, b in (
        (c.phase1_format, c.phase1_bits), (c.phase2_format, c.phase2_bits)))
    if args.comm.startswith("auto"):
        return f"{args.comm} (per call: exact or {phases} G={c.group_size}){fused}"
    return (f"{args.comm} {phases} G={c.group_size} "
            f"spikes={c.spikes} rotation={c.rotation} min_bytes={c.min_bytes}{fused}")
