"""The structure of a GGUF file, read and checked before anything is mapped: the header, the
metadata (scalars and strings by value, arrays by type and length) and the tensor infos, every
offset and size against the file's (:func:`scan_gguf`). :mod:`models.checkpoints.gguf` reads
the tensors it locates."""

from __future__ import annotations

import math
import mmap
import os
import pathlib
import struct
from typing import NamedTuple

from models.checkpoints.base import CheckpointError

__all__ = ["GGUFLayout", "TensorInfo", "MetadataArray", "INT_TYPES", "FLOAT_TYPES", "scan_gguf"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_COUNT = 1 << 24  # tensors / metadata keys (real files: hundreds / tens)
# GGUF metadata value types: code -> (struct format, size); 8 STRING and 9 ARRAY are variable.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
FLOAT_TYPES = {6, 12}


class MetadataArray(NamedTuple):
    """A metadata array (its values are not kept: the tokenizer reads them through gguf)."""

    item_type: int
    count: int


class TensorInfo(NamedTuple):
    """One tensor as the header describes it, every number a Python int (no uint64 wrap)."""

    name: str
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    ggml_type: int
    offset: int  # relative to the data section
    n_bytes: int
    data_offset: int  # absolute


class GGUFLayout(NamedTuple):
    """What :func:`scan_gguf` read: the metadata (scalars and strings by value, arrays by type
    and length), the tensor infos, the alignment and where the data section starts."""

    version: int
    fields: dict
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    size: int


def _dequantizable_types() -> dict[int, tuple[int, int]]:
    """Tensor type code -> (block size, bytes per block) of the float and quantized types that
    ``gguf.quants.dequantize`` reads; integer types (I8 ... I64) and F64 are refused."""
    import gguf
    import gguf.quants

    kinds = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
             *getattr(gguf.quants, "_type_traits", {})}
    return {int(t): tuple(gguf.GGML_QUANT_SIZES[t]) for t in kinds
            if t in gguf.GGML_QUANT_SIZES}


class _Cursor:
    """Bounds-checked little-endian reads from a bytes-like object."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file ({what})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has "
                      f"{self.size - self.pos} left")
        pos = self.pos
        self.pos += n
        return pos

    def scalar(self, fmt: str, size: int, what: str):
        return struct.unpack_from(fmt, self.buf, self.take(size, what))[0]

    def string(self, what: str) -> bytes:
        n = self.scalar("<Q", 8, f"the length of {what}")
        pos = self.take(n, f"{what} ({n} bytes)")
        return bytes(self.buf[pos:pos + n])

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8: {raw[:40]!r}")

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            v = self.scalar(fmt, size, what)
            return bool(v) if vtype == _BOOL else v
        if vtype == _STRING:
            return self.text(what)
        if vtype == _ARRAY:
            item = self.scalar("<I", 4, f"the item type of {what}")
            count = self.scalar("<Q", 8, f"the length of {what}")
            if item in _SCALARS:
                self.take(count * _SCALARS[item][1] if count < self.size else self.size + 1,
                          f"{what} ({count} items of type {item})")
            elif item == _STRING:
                if count > (self.size - self.pos) // 8:
                    self.fail(f"{what} claims {count} strings, more than the file can hold")
                for i in range(count):
                    self.text(f"{what}[{i}]")
            else:
                self.fail(f"{what} has items of type {item}, not a GGUF scalar or string type")
            return MetadataArray(item, count)
        self.fail(f"{what} has value type {vtype}, not a GGUF value type")


def scan_gguf(path) -> GGUFLayout:
    # long function: one pass over the header in file order, each field checked where it is read
    """Read and check a GGUF file's structure, every number as a Python int: the magic and
    version, every string and array length against the bytes left, no repeated key or tensor
    name, ``general.alignment`` a power of two, each tensor's rank (1..4), dimensions (>= 1,
    the row a whole number of blocks), type (one ``gguf`` can dequantize) and offset (aligned,
    and exactly where the previous tensor's padded data ends, as llama.cpp requires: so no
    gap, overlap, or offset past the end or wrapped around 2**64), and the data section ending
    at the end of the file (give or take the last tensor's padding).

    Raises :class:`CheckpointError` naming the field on the first violation."""
    path = pathlib.Path(path)
    size = os.path.getsize(path)
    if size < 24:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        c = _Cursor(mm, path)
        if bytes(mm[:4]) != _MAGIC:
            c.fail(f"magic {bytes(mm[:4])!r}, not {_MAGIC!r}")
        c.pos = 4
        version = c.scalar("<I", 4, "the version")
        if version not in _VERSIONS:
            c.fail(f"version {version} (0x{version:08x}); this reader knows little-endian GGUF "
                   f"versions {_VERSIONS}")
        n_tensors = c.scalar("<Q", 8, "the tensor count")
        n_kv = c.scalar("<Q", 8, "the metadata key count")
        for what, n in (("tensor count", n_tensors), ("metadata key count", n_kv)):
            if n > min(_MAX_COUNT, size // 8):
                c.fail(f"{what} {n} is more than the file can hold")
        fields: dict = {}
        for i in range(n_kv):
            key = c.text(f"metadata key #{i}")
            if key in fields:
                c.fail(f"metadata key {key!r} appears twice")
            vtype = c.scalar("<I", 4, f"the value type of {key}")
            fields[key] = (vtype, c.value(vtype, key))
        alignment = _DEFAULT_ALIGNMENT
        if "general.alignment" in fields:
            vtype, alignment = fields["general.alignment"]
            if vtype != 4 or alignment <= 0 or alignment & (alignment - 1):
                c.fail(f"general.alignment = {alignment!r} (type {vtype}) is not a power of two "
                       f"stored as uint32")
        kinds = _dequantizable_types()
        infos = []
        names = set()
        for i in range(n_tensors):
            name = c.text(f"the name of tensor #{i}")
            if name in names:
                c.fail(f"tensor name {name!r} appears twice")
            names.add(name)
            n_dims = c.scalar("<I", 4, f"the rank of tensor {name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                c.fail(f"tensor {name} has rank {n_dims}, not 1..{_MAX_DIMS}")
            dims = tuple(c.scalar("<Q", 8, f"dimension {j} of tensor {name}")
                         for j in range(n_dims))
            ggml_type = c.scalar("<I", 4, f"the type of tensor {name}")
            offset = c.scalar("<Q", 8, f"the offset of tensor {name}")
            infos.append((name, dims, ggml_type, offset))
        data_start = -(-c.pos // alignment) * alignment
        tensors = []
        expect = 0
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in kinds:
                c.fail(f"tensor {name} has type {_type_name(ggml_type)}, which is not a float or "
                       f"quantized type this reader can dequantize")
            block, block_bytes = kinds[ggml_type]
            if min(dims) < 1 or max(dims) > size * block:
                c.fail(f"tensor {name} has dimensions {list(dims)}")
            if dims[0] % block:
                c.fail(f"tensor {name} ({_type_name(ggml_type)}): its rows of {dims[0]} are not "
                       f"a whole number of blocks of {block}")
            n_bytes = math.prod(dims) // block * block_bytes
            if offset % alignment:
                c.fail(f"tensor {name} has offset {offset}, not a multiple of the alignment "
                       f"{alignment}")
            if offset != expect:
                prev = tensors[-1] if tensors else None
                after = ("the data section starts at 0" if prev is None else
                         f"the previous tensor {prev.name} ({_type_name(prev.ggml_type)}, "
                         f"{list(prev.dims)}: {prev.n_bytes} bytes) ends at {expect}")
                c.fail(f"tensor {name} has offset {offset}, but {after}: overlapping or "
                       f"misplaced tensor data, or a tensor type / dimension that does not match "
                       f"its data")
            end = data_start + offset + n_bytes
            if end > size:
                c.fail(f"tensor {name} ({_type_name(ggml_type)}, {list(dims)}) ends at byte "
                       f"{end}, the file has {size}")
            tensors.append(TensorInfo(name, dims, ggml_type, offset, n_bytes,
                                      data_start + offset))
            expect = -(-(offset + n_bytes) // alignment) * alignment
        if size > data_start + expect and (tensors or size > data_start):
            last = (f"the last tensor {tensors[-1].name} ({_type_name(tensors[-1].ggml_type)}, "
                    f"{list(tensors[-1].dims)}: {tensors[-1].n_bytes} bytes)" if tensors
                    else "the header")
            c.fail(f"{size - data_start - expect} bytes after the data of {last}; the tensor "
                   f"types or dimensions do not account for the file")
        return GGUFLayout(version, fields, tensors, alignment, data_start, size)


def _type_name(code: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(code).name
    except ValueError:
        return f"#{code} (unknown)"
