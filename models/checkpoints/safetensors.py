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
import math
import pathlib
import struct

import numpy as np

from models.checkpoints.base import Checkpoint, CheckpointError, check_finite
from models.checkpoints.llama_config import LlamaConfig

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


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _header(path: pathlib.Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset of its data. Checks every entry
    against the file: a supported dtype, a shape of non-negative ints, ``data_offsets`` of ints
    whose span is exactly the shape's bytes, the tensors packed one after the other from 0 with
    no gap or overlap, and the last one ending at the end of the file; no repeated key."""
    size = path.stat().st_size

    def fail(what):
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({what})")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            fail(f"{size} bytes")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > _MAX_HEADER:
            fail(f"header of {n} bytes, file of {size}")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            fail(f"bad header: {e}")
    if not isinstance(header, dict):
        fail("bad header: not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        fail("__metadata__ is not an object of strings")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            fail(f"bad entry for {name}: {str(info)[:80]}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ITEMSIZE:
            fail(f"tensor {name} has dtype {dtype!r}; only {', '.join(_ITEMSIZE)} are supported")
        if not isinstance(shape, list) or not all(
                type(s) is int and 0 <= s <= size for s in shape):
            fail(f"tensor {name} has shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            fail(f"tensor {name} has data_offsets {offsets!r}")
        want = math.prod(shape) * _ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != want:
            fail(f"tensor {name} ({dtype}, {shape}) spans {offsets[1] - offsets[0]} bytes, its "
                 f"dtype and shape need {want}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            fail(f"tensor {name} starts at data byte {begin}, expected {end}: overlapping or "
                 f"misplaced tensor data")
        end = stop
    if 8 + n + end != size:
        fail(f"the tensors end at byte {8 + n + end}, the file has {size}")
    return header, 8 + n


def _shard_name(directory: pathlib.Path, fname) -> str:
    """``fname`` if it names a file inside ``directory`` (relative, no ``..``); else a
    :class:`CheckpointError`. Checked on the name, not the resolved path: a shard may be a
    symbolic link (the Hugging Face cache links each to its blob)."""
    if not isinstance(fname, str) or not fname or "\\" in fname or "\0" in fname:
        raise CheckpointError(f"{directory / _INDEX}: weight_map names the file {fname!r}")
    pure = pathlib.PurePosixPath(fname)
    if pure.is_absolute() or ".." in pure.parts or pathlib.PureWindowsPath(fname).drive:
        raise CheckpointError(f"{directory / _INDEX}: weight_map names the file {fname!r}, which "
                              f"is not inside the checkpoint directory")
    return fname


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
            self.config = LlamaConfig.from_hf(json.loads((d / "config.json").read_text(),
                                                         object_pairs_hook=_no_duplicates))
        except (ValueError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{d / 'config.json'}: {e}") from None
        weight_map = None
        if files is None:
            if (d / _INDEX).is_file():
                try:
                    weight_map = json.loads((d / _INDEX).read_text(),
                                            object_pairs_hook=_no_duplicates)["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{d / _INDEX}: truncated or corrupt index "
                                          f"({type(e).__name__}: {e})") from None
                if not isinstance(weight_map, dict) or not weight_map:
                    raise CheckpointError(f"{d / _INDEX}: weight_map must be a non-empty object "
                                          f"of tensor name -> file, got "
                                          f"{type(weight_map).__name__}")
                files = sorted({_shard_name(d, f) for f in weight_map.values()})
            elif (d / _SINGLE).is_file():
                files = [_SINGLE]
            else:
                raise CheckpointError(f"{d}: no {_SINGLE} or {_INDEX}")
        else:
            files = [_shard_name(d, f) for f in files]
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
                    if name in self._where:
                        raise CheckpointError(f"{d}: tensor {name} is in both "
                                              f"{self._where[name]} and {fname}")
                    self._where[name] = fname
                    self._info[name] = info
        for name, fname in (weight_map or {}).items():
            if self._where.get(name) != fname:
                where = (f"it is in {self._where[name]}" if name in self._where
                         else "no file holds it")
                raise CheckpointError(f"{d / _INDEX}: weight_map puts {name} in {fname}, but "
                                      f"{where}")
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
            return check_finite(self.path / fname, name, np.asarray(
                self._handles[fname].get_slice(name)[index], np.float32))
        if dtype == "BF16":
            bf16 = _bfloat16()
            if bf16 is None:
                raise CheckpointError(f"{self.path / fname}: tensor {name} is BF16, which needs "
                                      f"the ml_dtypes package")
            return check_finite(self.path / fname, name, np.asarray(
                self._bf16_view(fname, name, bf16)[index], np.float32))
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
