"""Reading the package's JSON files (tuning tables, policies) with errors that name the file."""

from __future__ import annotations

import json
import os
import pathlib


def read_json(path: pathlib.Path, kind: str):
    """The JSON value in the file ``path``.

    Args:
      path: the file.
      kind: what the file should be, for errors (``"tuning table"``, ...).

    Raises:
      ValueError: not UTF-8, not JSON, or nested too deep, naming the file.
    """
    try:
        return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a {kind} (nested too deep)") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason})") from None


CACHE_ENV = "FLASHCOMM_CACHE_DIR"


def cache_dir() -> pathlib.Path:
    """The user's cache folder of the package (tuning tables, the CPU build measured per CPU
    kind): ``FLASHCOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/jax_flashcomm``, else
    ``~/.cache/jax_flashcomm``."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jax_flashcomm"
