"""The mutations of the checkpoint fuzzer (tests/models/test_checkpoint_fuzz.py) and the
independent decoders that check what a mutant loads as: a GGUF's bytes mutated in memory
(:func:`mutate_gguf`, :func:`check_gguf_mutant`), a Hugging Face directory mutated in place
(:func:`mutate_hf`, :func:`check_hf_mutant`)."""

from __future__ import annotations

import json
import struct

import numpy as np

from models.checkpoints import CheckpointError, open_checkpoint
from models.checkpoints.llama_config import LIMITS
from tests.support.checkpoint_files import (SCALARS, SMALL, gguf_map, patch, safetensors_header,
                                            with_header)


def pick(rs, seq):
    return seq[rs.randint(len(seq))]


U64 = 2 ** 64 - 1


# -- GGUF -------------------------------------------------------------------------------------


def special_int(rs, value, bits, signed):
    mask = (1 << bits) - 1
    v = pick(rs, [0, 1, 2, -1, value + 1, value - 1, value * 2, value // 2, 10 ** 9,
                   2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 63, U64, int(rs.randint(0, 2 ** 31))])
    v &= mask
    if signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def special_float(rs, value):
    return pick(rs, [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, 1e-30, 3e38,
                      -value, value * 2, value / 2, 1.0, 1e12, 1e13, 0.5])


def mutate_gguf(rs, data: bytes, m: dict) -> tuple[bytes, str]:
    """One random mutation of GGUF ``data`` (``m``: its :func:`gguf_map`); the mutant and what
    was done."""
    op = pick(rs, ["byte", "byte", "byte", "bytes", "field", "field", "field_type",
                    "tensor_offset", "tensor_type", "tensor_dims", "tensor_rank", "count",
                    "length", "truncate", "data", "data_nan"])
    header = m["data_start"]
    t = m["tensors"][rs.randint(len(m["tensors"]))]
    if op in ("byte", "bytes"):
        out = bytearray(data)
        where = []
        for _ in range(1 if op == "byte" else rs.randint(2, 5)):
            at = rs.randint(header) if rs.rand() < 0.75 else rs.randint(len(data))
            kind = rs.randint(4)
            out[at] = [rs.randint(256), out[at] ^ (1 << rs.randint(8)), 0, 255][kind]
            where.append(at)
        return bytes(out), f"{op} at {where}"
    if op == "field":
        key = pick(rs, [k for k, f in m["fields"].items() if f["type"] in SCALARS])
        f = m["fields"][key]
        fmt, size = SCALARS[f["type"]]
        if f["type"] in (6, 12):
            value = special_float(rs, f["value"])
        else:
            value = special_int(rs, f["value"], 8 * size, fmt[1] in "bhiq")
        return patch(data, f["value_at"], fmt, value), f"field {key} = {value!r}"
    if op == "field_type":
        key = pick(rs, list(m["fields"]))
        code = pick(rs, [*range(14), 255, 2 ** 32 - 1])
        return patch(data, m["fields"][key]["type_at"], "<I", code), f"type of {key} = {code}"
    if op == "tensor_offset":
        other = pick(rs, m["tensors"])["offset"]
        a = m["alignment"]
        value = pick(rs, [t["offset"] + 1, t["offset"] - 1, t["offset"] + a, t["offset"] - a, 0,
                           U64, 2 ** 63, other, len(data), int(rs.randint(0, 2 ** 31)) * 32])
        return patch(data, t["offset_at"], "<Q", value & U64), f"offset of {t['name']} = {value}"
    if op == "tensor_type":
        import gguf

        code = pick(rs, [*(int(k) for k in gguf.GGMLQuantizationType), 99, 2 ** 32 - 1])
        return patch(data, t["type_at"], "<I", code), f"type of {t['name']} = {code}"
    if op == "tensor_dims":
        j = rs.randint(len(t["dims"]))
        d = t["dims"][j]
        value = pick(rs, [0, 1, 2 ** 32, 2 ** 63, U64, d * 2, d // 2, d + 32, d - 32, 16, 64])
        return (patch(data, t["dims_at"][j], "<Q", value & U64),
                f"dim {j} of {t['name']} = {value}")
    if op == "tensor_rank":
        value = pick(rs, [0, 5, len(t["dims"]) - 1, len(t["dims"]) + 1, 2 ** 32 - 1])
        return patch(data, t["n_dims_at"], "<I", value & 0xFFFFFFFF), f"rank of {t['name']} = {value}"
    if op == "count":
        at = pick(rs, [m["tensor_count_at"], m["kv_count_at"]])
        n = struct.unpack_from("<Q", data, at)[0]
        value = pick(rs, [0, n - 1, n + 1, n * 2, 2 ** 32, 2 ** 63, U64])
        return patch(data, at, "<Q", value & U64), f"count at {at} = {value}"
    if op == "length":
        choices = [t["name_len_at"]] + [f["count_at"] for f in m["fields"].values()
                                        if "count_at" in f]
        at = pick(rs, choices)
        n = struct.unpack_from("<Q", data, at)[0]
        value = pick(rs, [0, n - 1, n + 1, n + 100, 2 ** 31, 2 ** 62, U64])
        return patch(data, at, "<Q", value & U64), f"length at {at} = {value}"
    if op == "truncate":
        cut = rs.randint(header) if rs.rand() < 0.6 else rs.randint(len(data))
        return data[:cut], f"truncated to {cut}"
    start = header + t["offset"]
    if op == "data_nan" and t["type"] == 0:  # F32
        at = start + 4 * rs.randint(t["n_bytes"] // 4)
        return patch(data, at, "<f", pick(rs, [float("nan"), float("inf")])), f"NaN in {t['name']}"
    at = start + rs.randint(t["n_bytes"])
    out = bytearray(data)
    out[at] = rs.randint(256)
    return bytes(out), f"data byte {at} of {t['name']}"


def decode_gguf_tensor(data: bytes, ti: dict, cfg) -> np.ndarray:
    """An independent decode of tensor ``ti`` of a GGUF map, HF layout."""
    import gguf
    import gguf.quants

    from models.checkpoints.gguf import unpermute_qk

    kind = gguf.GGMLQuantizationType(ti["type"])
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    start = ti["data_start"] + ti["offset"]
    raw = np.frombuffer(data, np.uint8, ti["n_bytes"], start)
    rows = int(np.prod(ti["dims"][1:]))
    if kind == gguf.GGMLQuantizationType.F32:
        arr = raw.view(np.float32)
    elif kind == gguf.GGMLQuantizationType.F16:
        arr = raw.view(np.float16).astype(np.float32)
    else:
        arr = gguf.quants.dequantize(raw.reshape(rows, -1), kind)
    arr = np.asarray(arr, np.float32).reshape(tuple(reversed(ti["dims"])))
    if ".attn_q." in ti["name"]:
        arr = unpermute_qk(arr, cfg.n_heads)
    elif ".attn_k." in ti["name"]:
        arr = unpermute_qk(arr, cfg.n_kv_heads)
    return arr


def check_gguf_mutant(path, original: bytes, m: dict, stored: dict, mutant: bytes) -> str:
    """Open the mutant at ``path`` and check it against the original; its outcome class."""
    from models.checkpoints.gguf import gguf_to_hf_name

    path.write_bytes(mutant)
    try:
        ckpt = open_checkpoint(str(path))
        got = {n: ckpt.read(n) for n in ckpt.names()}
    except CheckpointError:
        return "refused"
    cfg = ckpt.config
    check_config(cfg)
    assert set(got) == set(stored), f"tensor names {sorted(set(got) ^ set(stored))}"
    mm = gguf_map(mutant)  # the reader accepted its structure: the test's parser can follow it
    by_name = {t["name"]: dict(t, data_start=mm["data_start"]) for t in mm["tensors"]}
    outcome = "identical" if cfg == SMALL else "config differs (in range)"
    for ot in m["tensors"]:
        hf = gguf_to_hf_name(ot["name"])
        nt = by_name.get(ot["name"])
        assert nt is not None, f"{ot['name']} gone, yet it loaded"
        assert (nt["dims"], nt["offset"]) == (ot["dims"], ot["offset"]), \
            f"{ot['name']}: dims / offset changed, yet it loaded"
        assert np.isfinite(got[hf]).all(), f"{hf}: non-finite values loaded"
        start_o, start_n = m["data_start"] + ot["offset"], mm["data_start"] + nt["offset"]
        same_bytes = original[start_o:start_o + ot["n_bytes"]] == mutant[start_n:start_n +
                                                                        nt["n_bytes"]]
        if nt["type"] == ot["type"] and same_bytes:
            np.testing.assert_array_equal(got[hf], stored[hf], err_msg=hf)
        else:  # the data or a same-size type changed: what those bytes mean, exactly
            np.testing.assert_array_equal(got[hf], decode_gguf_tensor(mutant, nt, cfg), err_msg=hf)
            outcome = "data bytes changed" if nt["type"] == ot["type"] else "same-size type swap"
    return outcome


def check_config(cfg):
    for name, (lo, hi) in LIMITS.items():
        assert lo <= getattr(cfg, name) <= hi, name
    assert np.isfinite([cfg.rope_theta, cfg.rms_eps]).all() and cfg.rms_eps > 0
    # what the tensors were checked against: their shapes fix these
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.ffn_dim,
            cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim) == (
        SMALL.vocab_size, SMALL.d_model, SMALL.n_layers, SMALL.ffn_dim,
        SMALL.n_heads * SMALL.head_dim, SMALL.n_kv_heads * SMALL.head_dim)


# -- safetensors ------------------------------------------------------------------------------

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
INDEX = "model.safetensors.index.json"


def hf_dtypes(name):
    if "norm" in name:
        return "float32"
    return "float16" if "self_attn" in name or "embed" in name else "bfloat16"


def special_json(rs, value):
    num = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 1
    return pick(rs, [0, -1, 1, 10 ** 9, 2 ** 63, float("nan"), float("inf"), float("-inf"),
                      1e-300, 2.5, "x", "1", None, [], {}, True, False, num + 1, num * 2])


def mutate_hf(rs, d) -> str:
    # long function: one branch per kind of mutation, the kind picked by one draw
    """Mutate the Hugging Face directory ``d`` in place; what was done."""
    op = pick(rs, ["byte", "byte", "byte", "header", "header", "header", "config", "config",
                    "index", "index", "truncate", "data", "data_nan"])
    shard = d / pick(rs, SHARDS)
    data = shard.read_bytes()
    header, start = safetensors_header(data)
    names = [k for k in header if k != "__metadata__"]
    name = pick(rs, names)
    if op == "byte":
        out = bytearray(data)
        at = rs.randint(start) if rs.rand() < 0.75 else rs.randint(len(data))
        out[at] = [rs.randint(256), out[at] ^ (1 << rs.randint(8)), 0, 255][rs.randint(4)]
        shard.write_bytes(bytes(out))
        return f"byte {at} of {shard.name}"
    if op == "header":
        e = header[name]
        what = pick(rs, ["dtype", "shape", "offsets", "delete", "add", "rename", "metadata"])
        if what == "dtype":
            e["dtype"] = pick(rs, ["F32", "F16", "BF16", "F64", "I32", "U8", "BOOL", "", None, 7])
        elif what == "shape":
            s = list(e["shape"])
            j = rs.randint(len(s))
            s[j] = pick(rs, [s[j] + 1, s[j] - 1, 0, s[j] * 2, -1, 2.0, "8", 2 ** 62])
            e["shape"] = pick(rs, [s, s + [1], [1] + s, s[:-1], s[::-1]])
        elif what == "offsets":
            b, f = e["data_offsets"]
            k = pick(rs, [1, 2, 4, 8, -4, 100])
            e["data_offsets"] = pick(rs, [[b + k, f + k], [b, f + k], [f, b], [-1, f], [b],
                                           [b * 1.0, f], [b, 2 ** 64], header[pick(
                                               rs, names)]["data_offsets"]])
        elif what == "delete":
            del header[name]
        elif what == "add":
            header["model.layers.0.extra.weight"] = dict(e)
        elif what == "rename":
            header[pick(rs, ["model.layers.5.mlp.up_proj.weight", "lm_head.weight",
                              name.replace("0", "1")])] = header.pop(name)
        else:
            header["__metadata__"] = pick(rs, [[], {"a": 1}, "x"])
        shard.write_bytes(with_header(data, header))
        return f"header {what} of {name}"
    if op == "config":
        cfg = json.loads((d / "config.json").read_text())
        key = pick(rs, sorted(cfg))
        if rs.rand() < 0.15:
            del cfg[key]
            text = json.dumps(cfg)
        elif rs.rand() < 0.1:
            text = json.dumps(cfg)[:rs.randint(1, 40)]
        else:
            cfg[key] = special_json(rs, cfg[key])
            text = json.dumps(cfg)
        (d / "config.json").write_text(text)
        return f"config {key}"
    if op == "index":
        ix = json.loads((d / INDEX).read_text())
        wm = ix["weight_map"]
        what = pick(rs, ["list", "str", "empty", "abs", "dotdot", "missing_file", "other_shard",
                          "int", "drop_entry", "no_map", "top_list", "truncate", "backslash"])
        k = pick(rs, sorted(wm))
        if what == "list":
            ix["weight_map"] = list(wm.items())
        elif what == "str":
            ix["weight_map"] = "model.safetensors"
        elif what == "empty":
            ix["weight_map"] = {}
        elif what == "abs":
            wm[k] = str((d / wm[k]).resolve())
        elif what == "dotdot":
            wm[k] = f"../{d.name}/{wm[k]}"
        elif what == "missing_file":
            wm[k] = "nowhere.safetensors"
        elif what == "other_shard":
            wm[k] = SHARDS[1 - SHARDS.index(wm[k])]
        elif what == "int":
            wm[k] = 7
        elif what == "drop_entry":
            del wm[k]
        elif what == "no_map":
            del ix["weight_map"]
        elif what == "backslash":
            wm[k] = "sub\\" + wm[k]
        text = json.dumps([ix] if what == "top_list" else ix)
        (d / INDEX).write_text(text[:rs.randint(1, len(text))] if what == "truncate" else text)
        return f"index {what}"
    if op == "truncate":
        cut = rs.randint(start) if rs.rand() < 0.5 else rs.randint(len(data))
        shard.write_bytes(data[:cut])
        return f"{shard.name} truncated to {cut}"
    e = header[name]
    b, f = e["data_offsets"]
    if op == "data_nan" and e["dtype"] == "F32" and f > b:
        at = start + b + 4 * rs.randint((f - b) // 4)
        shard.write_bytes(patch(data, at, "<f", float("nan")))
        return f"NaN in {name}"
    if f > b:
        out = bytearray(data)
        out[start + b + rs.randint(f - b)] = rs.randint(256)
        shard.write_bytes(bytes(out))
    return f"data byte of {name}"


NUMPY_TYPES = {"F32": np.float32, "F16": np.float16}


def decode_safetensors_tensor(data: bytes, start: int, e: dict) -> np.ndarray:
    b, f = e["data_offsets"]
    if e["dtype"] == "BF16":
        import ml_dtypes

        dt = ml_dtypes.bfloat16
    else:
        dt = NUMPY_TYPES[e["dtype"]]
    return np.frombuffer(data[start + b:start + f], dt).reshape(e["shape"]).astype(np.float32)


def check_hf_mutant(d, pristine, stored: dict) -> str:
    try:
        ckpt = open_checkpoint(str(d))
        got = {n: ckpt.read(n) for n in ckpt.names()}
        if "model.layers.1.mlp.down_proj.weight" in got:  # a slice, as a TP shard reads it
            part = ckpt.read("model.layers.1.mlp.down_proj.weight", (slice(3, 9), slice(5, 40)))
            np.testing.assert_array_equal(part, got["model.layers.1.mlp.down_proj.weight"][3:9, 5:40])
    except CheckpointError:
        return "refused"
    cfg = ckpt.config
    check_config(cfg)
    assert set(got) == set(stored), f"tensor names {sorted(set(got) ^ set(stored))}"
    outcome = "identical" if cfg == SMALL else "config differs (in range)"
    for shard in SHARDS:
        data = (d / shard).read_bytes()
        header, start = safetensors_header(data)
        odata, (oheader, ostart) = pristine[shard], safetensors_header(pristine[shard])
        for name, e in header.items():
            if name == "__metadata__":
                continue
            o = oheader[name]  # loaded: every name is an original one, in its original shard
            assert (e["shape"], e["data_offsets"]) == (o["shape"], o["data_offsets"]), name
            assert np.isfinite(got[name]).all(), f"{name}: non-finite values loaded"
            b, f = e["data_offsets"]
            if e["dtype"] == o["dtype"] and data[start + b:start + f] == odata[ostart + b:
                                                                            ostart + f]:
                np.testing.assert_array_equal(got[name], stored[name], err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], decode_safetensors_tensor(data, start, e), err_msg=name)
                outcome = ("data bytes changed" if e["dtype"] == o["dtype"]
                           else "same-size type swap")
    return outcome
