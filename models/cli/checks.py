"""The argument check of every model CLI (:func:`check`), called right after parsing: whatever
can be found wrong before the run (no jax backend, no model load; the TP size against the
checkpoint's heads reads only its config) is reported by argparse (``parser.error``: exit
status 2). It also builds what the options describe, once: the ``TPComm`` (``args.tp_comm``),
the ``--comm-policy`` (``args.policy``) and the ``--settings`` (``args.comm_settings``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import zipfile

from jax_flashcomm.config import COMM_KINDS
from models.cli import settings

#: int (or float) options and the least value each takes; checked on any parser that has them.
AT_LEAST = {"tp": 1, "devices": 1, "max_new_tokens": 1, "window": 2, "max_windows": 1,
            "cache_len": 1, "tokens": 2, "top_k": 0, "temperature": 0.0, "rounds": 1,
            "seed": -2**63, "calib_first": 0, "calib_windows": 1}
#: options that must be at most a bound (a PRNG seed is a 64-bit int)
AT_MOST = {"top_p": 1.0, "seed": 2**63 - 1}
#: float options that must be finite (NaN passes every comparison above)
FINITE = ("temperature", "top_p", "max_shard_mb")
#: options that must be > 0
POSITIVE = ("max_shard_mb", "top_p", "max_wire")
#: options naming a file the run reads (must exist and be a regular file)
INPUT_FILES = ("text", "prompts", "ref", "comm_policy")
#: options naming a file the run writes (its folder must exist; it must not be a folder)
OUTPUT_FILES = ("json", "out", "plot")
#: options naming a checkpoint: a known name or an existing path
MODEL_OPTIONS = ("model", "src")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check(parser: argparse.ArgumentParser, args, *, quantize_all: bool = False) -> None:
    """Check the options the parser has, by destination name, and build what they describe.

    Checks the numbers of :data:`AT_LEAST`, :data:`AT_MOST`, :data:`FINITE`, :data:`POSITIVE`;
    the input files of :data:`INPUT_FILES` (``--text``: UTF-8 and not empty; ``--prompts``: a
    JSON list of strings; ``--ref``: an npz); the folders of the outputs of
    :data:`OUTPUT_FILES` and ``outdir``; the checkpoint (:data:`MODEL_OPTIONS`) and whether its
    heads split over ``--tp`` (one size or a list); ``--devices``; ``--comm-policy``;
    ``--settings`` (``models.compare``); ``--kinds``; the communication options of
    :func:`models.cli.add_common`.

    Args:
      parser: the CLI's parser (its ``error`` reports).
      args: its parsed options.
      quantize_all: a quantized ``--comm`` without a ``min_bytes`` quantizes every all-reduce
        (:func:`models.cli.quantize_every_call`; the accuracy tools).
    """
    _check_numbers(parser, args)
    _check_paths(parser, args)
    for dest in MODEL_OPTIONS:
        model = getattr(args, dest, None)
        if model is not None:
            _check_model(parser, model, getattr(args, "tp", None))
    devices, tp = getattr(args, "devices", None), getattr(args, "tp", None)
    if devices is not None and isinstance(tp, int) and devices < tp:
        parser.error(f"--devices {devices} is fewer than --tp {tp}")
    if getattr(args, "comm", None) is not None and hasattr(args, "bits"):
        check_comm(parser, args, quantize_all=quantize_all)
    elif getattr(args, "comm_policy", None) is not None:
        args.policy = _policy(parser, args.comm_policy)
    if getattr(args, "settings", None) is not None:
        args.comm_settings = _settings(parser, args)
    if getattr(args, "kinds", None) is not None:
        bad = [k for k in args.kinds.split(",") if k not in COMM_KINDS]
        if bad:
            parser.error(f"--kinds: unknown {', '.join(map(repr, bad))}: choose among "
                         f"{', '.join(COMM_KINDS)}")


def _check_numbers(parser, args) -> None:
    for dest, least in AT_LEAST.items():
        values = getattr(args, dest, None)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and v < least:
                parser.error(f"{_flag(dest)} must be >= {least}, got {v}")
    for dest in FINITE:
        v = getattr(args, dest, None)
        if v is not None and not math.isfinite(v):
            parser.error(f"{_flag(dest)} must be a finite number, got {v}")
    for dest, most in AT_MOST.items():
        v = getattr(args, dest, None)
        if v is not None and v > most:
            parser.error(f"{_flag(dest)} must be <= {most}, got {v}")
    for dest in POSITIVE:
        v = getattr(args, dest, None)
        if v is not None and not v > 0:
            parser.error(f"{_flag(dest)} must be > 0, got {v}")


def _check_paths(parser, args) -> None:
    for dest in INPUT_FILES:
        path = getattr(args, dest, None)
        if path is not None:
            _check_input(parser, _flag(dest), dest, path)
    for dest in OUTPUT_FILES:
        path = getattr(args, dest, None)
        if path is not None:
            _check_output(parser, _flag(dest), pathlib.Path(path))
    outdir = getattr(args, "outdir", None)
    if outdir is not None and pathlib.Path(outdir).exists() and not pathlib.Path(outdir).is_dir():
        parser.error(f"outdir {outdir}: exists and is not a folder")


def check_comm(parser: argparse.ArgumentParser, args, *, quantize_all: bool = False) -> None:
    """The communication options of :func:`models.cli.add_common`: builds their ``TPComm``
    once (``args.tp_comm``; with ``--comm-policy``, the policy as ``args.policy``), a
    ``ValueError`` of the options or of ``TPComm`` reported by ``parser.error``."""
    from jax_flashcomm.nn import TPComm

    try:
        TPComm.parse_kind(args.comm)
    except ValueError:
        parser.error(f"unknown --comm {args.comm!r}: choose one of {', '.join(COMM_KINDS)}")
    if getattr(args, "comm_policy", None) is not None:
        given = [flag for flag, v in (("--comm", None if args.comm == "exact" else args.comm),
                                      ("--config", args.config),
                                      *((_flag(n), getattr(args, n))
                                        for n in settings.CONFIG_FLAGS)) if v is not None]
        if given:
            parser.error(f"--comm-policy gives every all-reduce its config: drop "
                         f"{', '.join(given)}")
        args.policy = _policy(parser, args.comm_policy)
    try:
        if quantize_all:
            settings.quantize_every_call(args, sys.stderr)
        options = settings.flag_options(args)
    except (TypeError, ValueError, OSError) as e:
        parser.error(str(e))
    try:
        args.tp_comm = settings.build_comm(options, fuse_norm=getattr(args, "fuse_norm", False))
    except (TypeError, ValueError) as e:
        parser.error(f"--comm {args.comm}: {e}")


def _policy(parser, path):
    try:
        return settings.load_policy(path)
    except (ValueError, OSError) as e:
        parser.error(f"--comm-policy: {e}")


def _settings(parser, args) -> list:
    """``[(label, TPComm or CommPolicy)]`` of ``--settings``, the format flags' setting when it
    is not among them, and ``("policy", args.policy)`` with ``--comm-policy``."""
    try:
        if not args.settings.strip():
            raise ValueError("no setting given")
        names = [s.strip() for s in args.settings.split(",")]
        comms = [settings.parse_setting(name) for name in names]
    except (TypeError, ValueError) as e:
        parser.error(f"--settings {args.settings!r}: {e}")
    extra = settings.format_setting(getattr(args, "format", None),
                                    getattr(args, "rs_format", None),
                                    getattr(args, "ag_format", None))
    if extra is not None and extra not in names:
        comms.append(settings.parse_setting(extra))
    if getattr(args, "policy", None) is not None:
        comms.append(("policy", args.policy))
    return comms


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
    from models.checkpoints.gguf_header import scan_gguf

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
