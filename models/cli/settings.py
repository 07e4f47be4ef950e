"""The communication settings of the model CLIs, in one language: what ``--comm`` and the option
flags say, what a ``models.compare`` setting name says, and the :class:`jax_flashcomm.nn.TPComm`
both become.

Both forms parse to the same options, ``{"quantization", "layout", "config", field: value}``
(the fields of :class:`jax_flashcomm.CommConfig`), and :func:`build_comm` makes the one
``TPComm`` of them: the setting ``int4/fp8`` is ``--comm flash --bits 4 --ag-format fp8
--min-bytes 0``, ``overlap+auto6`` is ``--comm auto+overlap --bits 6``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jax_flashcomm.config import COMM_KINDS

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
#: The group formats of a quantized phase (the flags' choices, the setting names' phases).
FORMATS = ("int", "fp8", "mxfp4", "nvfp4")
#: The flags with a fixed set of values.
FLAG_CHOICES = {name: FORMATS for name in ("format", "rs_format", "ag_format")}
#: The options whose text may be a number or a name.
NUMBER_OR_NAME = ("rotation", "spikes", "min_bytes")
#: The largest JSON config or policy a CLI reads (a CommConfig is a few hundred bytes).
MAX_JSON_BYTES = 1 << 20

SETTING_NAMES = ("exact, overlap, intB, intR/A, fp8, mxfp4, nvfp4 (either phase: nvfp4/fp8), "
                 "overlap+<setting>, auto, autoB or overlap+auto[B]")


def add_common(parser: argparse.ArgumentParser) -> None:
    """The options of every CLI that runs one model under one communication setting: the
    checkpoint, ``--tp``, ``--devices``, ``--comm`` and :data:`CONFIG_FLAGS`, ``--config``,
    ``--dtype``, ``--fuse-norm`` and ``--comm-policy``."""
    from jax_flashcomm.config import CommConfig

    parser.add_argument("--model", default="smollm2",
                        help="a known model name (smollm2), a GGUF file or a Hugging Face "
                             "directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--devices", type=int, default=None,
                        help="number of CPU devices to create (default: the TP size)")
    parser.add_argument("--comm", default="exact",
                        help=f"communication strategy: {', '.join(COMM_KINDS)}")
    parser.add_argument("--config", default=None, metavar="JSON",
                        help="a jax_flashcomm.CommConfig as a JSON object of its fields (a file "
                             "or inline); the option flags below update it")
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


def build_comm(options: dict, fuse_norm: bool = False):
    """The :class:`jax_flashcomm.nn.TPComm` of parsed options (:func:`flag_options`,
    :func:`setting_options`) over the mesh axis ``"tp"``.

    Raises:
      ValueError: options the strategy contradicts (TPComm's own check).
    """
    from jax_flashcomm.nn import TPComm

    fields = dict(options)
    quantization, layout = fields.pop("quantization"), fields.pop("layout")
    return TPComm(quantization, "tp", layout=layout, fuse_norm=fuse_norm, **fields)


def _number_or_name(value: str):
    return int(value) if value.lstrip("-").isdigit() else value


def flag_options(args) -> dict:
    """The options of ``--comm``, ``--config`` and the option flags given (the others are left
    to the config's defaults).

    Raises:
      ValueError: an unknown ``--comm``, or a ``--config`` that is not a CommConfig.
    """
    from jax_flashcomm.config import CommConfig
    from jax_flashcomm.nn import TPComm

    quantization, layout = TPComm.parse_kind(args.comm)
    fields = config_fields(args)
    options = {name: getattr(args, name) for name in CONFIG_FLAGS
               if getattr(args, name) is not None}
    for name in NUMBER_OR_NAME:
        if name in options:
            options[name] = _number_or_name(options[name])
    return {"quantization": quantization, "layout": layout,
            "config": None if fields is None else CommConfig(**fields), **options}


def comm_from_args(args):
    """The :class:`jax_flashcomm.nn.TPComm` the options describe (built once by
    :func:`models.cli.check`, which keeps it as ``args.tp_comm``)."""
    built = getattr(args, "tp_comm", None)
    if built is not None:
        return built
    return build_comm(flag_options(args), fuse_norm=getattr(args, "fuse_norm", False))


def _phase(token: str, first: bool):
    """One phase of a setting name: ``("int", B)`` for ``intB`` (or a bare ``B`` after the
    slash), ``("format", F)`` for fp8 / mxfp4 / nvfp4; None otherwise."""
    if token in FORMATS[1:]:
        return "format", token
    digits = token[3:] if token.startswith("int") else ("" if first else token)
    return ("int", int(digits)) if digits.isdigit() else None


def setting_options(name: str) -> dict:
    """The options a ``models.compare`` setting name stands for: ``exact``, ``overlap``,
    ``intB`` (quantized, B bits both phases, every all-reduce quantized: ``min_bytes=0``),
    ``intR/A`` (reduce-scatter R bits, all-gather A bits), a floating-point format (``fp8``,
    ``mxfp4``, ``nvfp4``) in place of either phase (``nvfp4``, ``nvfp4/fp8``, ``int4/fp8``),
    ``overlap+`` any of those (the sequence-parallel layout), or ``auto`` / ``autoB`` (the
    automatic choice per call, within a budget of B bits, default 8; ``overlap+auto``,
    ``overlap+autoB``).

    Raises:
      ValueError: a name that is none of those.
    """
    before, plus, rest = name.rpartition("overlap+")
    if before:
        rest = None
    layout = "sequence_parallel" if plus or name == "overlap" else "all_reduce"
    if name in ("exact", "overlap"):
        return {"quantization": "exact", "layout": layout}
    if rest is not None and rest.startswith("auto") and (rest == "auto" or rest[4:].isdigit()):
        return {"quantization": "auto", "layout": layout, "bits": int(rest[4:] or 8)}
    first, slash, second = (rest or "").partition("/")
    rs = _phase(first, True) if rest and "+" not in rest else None
    ag = _phase(second, False) if slash else None
    if rs is None or (slash and ag is None):
        raise ValueError(f"unknown setting {name!r}: use {SETTING_NAMES}")
    options = {"quantization": "quantized", "layout": layout, "min_bytes": 0}
    options.update({"bits": rs[1]} if rs[0] == "int" else {"format": rs[1]})
    if ag is not None:
        options.update({"ag_bits": ag[1], "ag_format": "int"} if ag[0] == "int"
                       else {"ag_format": ag[1]})
    return options


def parse_setting(name: str):
    """``(name, TPComm)`` of a ``models.compare`` setting name (:func:`setting_options`).

    Raises:
      ValueError: an unknown name, or options the strategy contradicts.
    """
    return name, build_comm(setting_options(name))


def format_setting(fmt: str | None, rs_format: str | None, ag_format: str | None) -> str | None:
    """The ``models.compare`` setting name the ``--format`` / ``--rs-format`` / ``--ag-format``
    flags describe (None when none is given): ``F`` or ``R/A``."""
    if fmt is None and rs_format is None and ag_format is None:
        return None
    rs, ag = (("int8" if f == "int" else f) for f in (rs_format or fmt or "int",
                                                      ag_format or fmt or "int"))
    return rs if rs == ag else f"{rs}/{ag}"


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


def load_policy(path):
    """The :class:`jax_flashcomm.CommPolicy` in the file ``path``."""
    from jax_flashcomm.policy import CommPolicy

    return CommPolicy.load(path)


def quantize_every_call(args, log=None) -> None:
    """For the accuracy tools: a quantized ``--comm`` (flash, flash+overlap) with no
    ``--min-bytes`` and no ``min_bytes`` in ``--config`` quantizes every all-reduce
    (``--min-bytes 0``), so that the setting evaluated is the setting named; the library's
    ``"auto"`` would keep exact ``lax`` wherever it predicts that faster.

    Raises:
      ValueError: an unknown ``--comm``, or a ``--config`` that is not JSON.
    """
    from jax_flashcomm.nn import TPComm

    if (getattr(args, "comm", None) is None
            or TPComm.parse_kind(args.comm)[0] != "quantized"
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
        policy = getattr(args, "policy", None) or load_policy(args.comm_policy)
        return f"comm policy {args.comm_policy} ({len(policy.sites)} sites){fused}"
    comm = comm_from_args(args)
    if comm.quantization == "exact":
        return comm.kind + fused
    c = comm.config
    phases = "/".join(f"int{b}" if f == "int" else f for f, b in (
        (c.phase1_format, c.phase1_bits), (c.phase2_format, c.phase2_bits)))
    if comm.quantization == "auto":
        return f"{comm.kind} (per call: exact or {phases} G={c.group_size}){fused}"
    return (f"{comm.kind} {phases} G={c.group_size} "
            f"spikes={c.spikes} rotation={c.rotation} min_bytes={c.min_bytes}{fused}")
