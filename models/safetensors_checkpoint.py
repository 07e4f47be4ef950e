"""A Hugging Face checkpoint directory: ``config.json`` and ``model.safetensors`` or shards listed
in ``model.safetensors.index.json`` (plus, optionally, ``tokenizer.json`` /
``tokenizer_config.json``).

Each file is opened with ``safetensors.safe_open`` (memory-mapped); ``read(name, index)`` reads
only ``[index]`` of a tensor through ``get_slice``, so a device can load its shard alone. F32 and
F16 are read through safetensors; BF16 (which numpy lacks) through a memory map of the file
viewed as ``ml_dtypes.bfloat16``. Everything comes out float32.
"""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np

from models.checkpoint_base import Checkpoint, CheckpointError
from models.config import LlamaConfig

__all__ = ["SafetensorsCheckpoint"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


def _header(path: pathlib.Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset of its data; checks that the file
    holds every byte the header describes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (header of {n} "
                                  f"bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (bad header: "
                                  f"{e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file (bad header)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file (bad entry for "
                                  f"{name})") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file (the tensors end "
                              f"at byte {8 + n + end}, the file has {size})")
    return header, 8 + n


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face Llama directory of safetensors."""

    def __init__(self, directory, files: list[str] | None = None):
        from safetensors import SafetensorError, safe_open

        self.path = d = pathlib.Path(directory)
        if not d.is_dir():
            raise FileNotFoundError(f"no such checkpoint directory: {d}")
        if not (d / "config.json").is_file():
            raise CheckpointError(f"{d}: not a Hugging Face checkpoint (no config.json)")
        try:
            self.config = LlamaConfig.from_hf(json.loads((d / "config.json").read_text()))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{d / 'config.json'}: {e}") from None
        if files is None:
            if (d / _INDEX).is_file():
                try:
                    weight_map = json.loads((d / _INDEX).read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{d / _INDEX}: truncated or corrupt index "
                                          f"({type(e).__name__}: {e})") from None
                files = sorted(set(weight_map.values()))
            elif (d / _SINGLE).is_file():
                files = [_SINGLE]
            else:
                raise CheckpointError(f"{d}: no {_SINGLE} or {_INDEX}")
        self._where: dict[str, str] = {}
        self._info: dict[str, dict] = {}
        self._handles = {}
        self._data_start: dict[str, int] = {}
        for fname in files:
            path = d / fname
            if not path.is_file():
                raise CheckpointError(f"{d}: the index lists {fname}, which does not exist")
            header, start = _header(path)
            try:
                self._handles[fname] = safe_open(str(path), framework="numpy")
            except SafetensorError as e:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({e})") \
                    from None
            self._data_start[fname] = start
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = fname
                    self._info[name] = info
        self._mmaps: dict[str, np.memmap] = {}
        self.tokenizer = None
        if (d / "tokenizer.json").is_file():
            from models.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_files(d)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._info:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return tuple(int(s) for s in self._info[name]["shape"])

    def read(self, name: str, index=()) -> np.ndarray:
        if name not in self._info:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        dtype = self._info[name]["dtype"]
        fname = self._where[name]
        if dtype in _NUMPY_DTYPES:
            index = index if isinstance(index, tuple) else (index,)
            return np.asarray(self._handles[fname].get_slice(name)[index], np.float32)
        if dtype == "BF16":
            bf16 = _bfloat16()
            if bf16 is None:
                raise CheckpointError(f"{self.path / fname}: tensor {name} is BF16, which needs "
                                      f"the ml_dtypes package")
            return np.asarray(self._bf16_view(fname, name, bf16)[index], np.float32)
        raise CheckpointError(f"{self.path / fname}: tensor {name} has dtype {dtype}; only F32, "
                              f"F16 and BF16 are supported")

    def _bf16_view(self, fname, name, bf16):
        mm = self._mmaps.get(fname)
        if mm is None:
            mm = self._mmaps[fname] = np.memmap(self.path / fname, np.uint8, "r")
        start, stop = (self._data_start[fname] + int(o) for o in self._info[name]["data_offsets"])
        return mm[start:stop].view(bf16).reshape(self.shape(name))

    def close(self) -> None:
        self._handles.clear()
        self._mmaps.clear()
