"""Small checkpoints for the checkpoint-hardening tests and the mutation fuzzer, and a map of
where each field of a GGUF file lies (so a test can patch one field's bytes).

The map is read with ``struct`` on a well-formed file, independently of the reader under test.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np

from models.checkpoints.llama_config import LlamaConfig
from tests.support.tiny_llama import tiny_tensors

# Rows of 32 (a whole Q8_0 / Q4_1 block), head_dim = d_model / n_heads (so a GGUF without
# key_length, like SmolLM2's, still has the head dimension of its tensors).
SMALL = LlamaConfig(vocab_size=17, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True,
                    max_seq_len=128, bos_token_id=1, eos_token_ids=(2,))

# GGUF metadata value types (struct format, size); 8 STRING and 9 ARRAY are variable.
SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
           6: ("<f", 4), 7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
GGUF_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# llama.cpp's Gemma 3 block (convert_hf_to_gguf.py / gguf-py's tensor map): QK-norm and four
# norms, ``ffn_norm`` being the MLP's pre-norm and ``post_attention_norm`` the attention output's.
GEMMA3_GGUF_NAMES = {**GGUF_NAMES, "attn_q_norm": "self_attn.q_norm",
                     "attn_k_norm": "self_attn.k_norm",
                     "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}


def gguf_names(cfg: LlamaConfig) -> dict[str, str]:
    """llama.cpp tensor name -> HF name (without ``.weight`` / ``.bias``), in llama.cpp's order,
    for ``cfg.arch`` (``llama`` and ``qwen2`` share the names)."""
    layer = GEMMA3_GGUF_NAMES if cfg.arch == "gemma3" else GGUF_NAMES
    names = {"token_embd": "model.embed_tokens"}
    for i in range(cfg.n_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer.items()})
    names.update({"output_norm": "model.norm", "output": "lm_head"})
    return names


def gemma3_gguf_limits(cfg: LlamaConfig) -> None:
    """Raise ``ValueError`` unless a Gemma 3 GGUF can describe ``cfg``: llama.cpp (and the reader)
    take the sliding pattern as 6, the local RoPE base as 10000 and the query scalar as
    ``head_dim``; the file has no key for them."""
    fixed = {"sliding_pattern": (cfg.sliding_pattern, 6),
             "rope_local_theta": (cfg.rope_local_theta, 10000.0),
             "query_pre_attn_scalar": (cfg.query_pre_attn_scalar or cfg.head_dim, cfg.head_dim)}
    wrong = {k: v for k, (v, want) in fixed.items() if v != want}
    if wrong:
        raise ValueError(f"a gemma3 GGUF cannot hold {wrong} (llama.cpp fixes sliding_pattern 6, "
                         f"rope_local_theta 10000, query_pre_attn_scalar = head_dim)")


def default_types(hf_name: str) -> str:
    """The mixed tensor types of :func:`write_gguf`'s default file: norms F32, embedding F16,
    attention Q8_0, MLP Q4_1 (SmolLM2's main type)."""
    if "norm" in hf_name:
        return "F32"
    if "embed" in hf_name or "lm_head" in hf_name:
        return "F16"
    return "Q8_0" if "self_attn" in hf_name else "Q4_1"


def write_gguf(path, cfg: LlamaConfig = SMALL, tensors=None, types=default_types,
               key_length: bool = False, extra: bool = True, arch: str | None = None):
    """A GGUF of ``tensors`` (default: random ones of ``cfg``) as llama.cpp's converter lays it
    out for ``cfg.arch`` (llama.cpp names; Q / K rows permuted for ``llama`` only; Gemma 3's
    norm weights stored as ``1 + w``), each weight of the type ``types(hf_name)`` (``"F32"``,
    ``"F16"``, ``"Q8_0"``, ``"Q4_1"``...) and each bias F32, metadata like SmolLM2's (no
    ``key_length`` unless asked (always for ``gemma3``, as its converter writes it), plus
    ``attention.sliding_window`` for ``gemma3``, ``rope.dimension_count``), plus with ``extra``
    a string array and an int32 array. ``arch`` overrides ``general.architecture`` and the
    ``{arch}.`` key prefix (a file of an unsupported architecture). Returns the HF-layout
    float32 tensors the file holds as the reader should return them (quantized ones as they
    dequantize, Gemma 3 norms as ``stored - 1`` in float32)."""
    import gguf
    import gguf.quants

    from models.checkpoints.gguf import llama_cpp_permute, unpermute_qk

    t = tiny_tensors(cfg) if tensors is None else tensors
    gemma = cfg.arch == "gemma3"
    if gemma:
        gemma3_gguf_limits(cfg)
    permuted = cfg.arch == "llama"
    w = gguf.GGUFWriter(str(path), arch or cfg.arch)
    for key, value in [("block_count", cfg.n_layers), ("context_length", cfg.max_seq_len),
                       ("embedding_length", cfg.d_model), ("feed_forward_length", cfg.ffn_dim),
                       ("head_count", cfg.n_heads), ("head_count_kv", cfg.n_kv_heads),
                       ("rope_freq_base", cfg.rope_theta), ("layer_norm_rms_eps", cfg.rms_eps),
                       ("vocab_size", cfg.vocab_size), ("rope_dimension_count", cfg.head_dim),
                       ("bos_token_id", cfg.bos_token_id),
                       ("eos_token_id", cfg.eos_token_ids[0])]:
        getattr(w, f"add_{key}")(value)
    if key_length or gemma:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if gemma and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if extra:
        w.add_array("general.languages", ["en", "fr"])
        w.add_array("general.fuzz_ints", [3, 1, 4, 1, 5])
    stored = {}
    for g, h in gguf_names(cfg).items():
        for kind in ("weight", "bias"):
            arr = t.get(f"{h}.{kind}")
            if arr is None:
                continue
            arr = np.ascontiguousarray(arr, np.float32)
            norm = gemma and kind == "weight" and h.endswith("norm")
            if norm:
                arr = arr + np.float32(1.0)
            qk = permuted and kind == "weight" and h.endswith(("q_proj", "k_proj"))
            heads = cfg.n_heads if h.endswith("q_proj") else cfg.n_kv_heads
            if qk:
                arr = llama_cpp_permute(arr, cfg.n_heads, heads)
            qtype = gguf.GGMLQuantizationType[types(h) if kind == "weight" else "F32"]
            data = gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)
            back = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(arr.shape)
            if qk:
                back = unpermute_qk(back, heads)
            if norm:
                back = back - np.float32(1.0)
            stored[f"{h}.{kind}"] = np.ascontiguousarray(back)
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w.add_tensor(f"{g}.{kind}", data)
            else:
                w.add_tensor(f"{g}.{kind}", data, raw_dtype=qtype)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    return stored


def gguf_map(data: bytes) -> dict:
    """Where everything lies in a well-formed little-endian GGUF ``data``:

    ``fields``: key -> dict(type_at, value_at, type, size, value) (arrays: ``count_at``,
    ``item_type``, ``count``); ``tensors``: list of dict(name, name_at, name_len_at, n_dims_at,
    dims_at [one offset per dimension], dims, type_at, type, offset_at, offset); ``kv_count_at``,
    ``tensor_count_at``, ``header_end``, ``data_start``, ``alignment``."""
    pos = 24

    def u(fmt, at):
        return struct.unpack_from(fmt, data, at)[0]

    def string(at):
        n = u("<Q", at)
        return data[at + 8:at + 8 + n].decode("utf-8", "surrogateescape"), at + 8 + n

    n_tensors, n_kv = u("<Q", 8), u("<Q", 16)
    fields = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        vtype = u("<I", pos)
        f = {"type_at": pos, "type": vtype, "value_at": pos + 4}
        pos += 4
        if vtype in SCALARS:
            fmt, size = SCALARS[vtype]
            f.update(size=size, value=u(fmt, pos))
            pos += size
        elif vtype == 8:
            f["value"], end = string(pos)
            f["size"] = end - pos
            pos = end
        else:  # array
            item, count = u("<I", pos), u("<Q", pos + 4)
            f.update(item_type=item, count_at=pos + 4, count=count)
            pos += 12
            for _ in range(count):
                if item == 8:
                    _, pos = string(pos)
                else:
                    pos += SCALARS[item][1]
            f["size"] = pos - f["value_at"]
        fields[key] = f
    tensors = []
    for _ in range(n_tensors):
        t = {"name_len_at": pos, "name_at": pos + 8}
        t["name"], pos = string(pos)
        n_dims = u("<I", pos)
        t["n_dims_at"] = pos
        pos += 4
        t["dims_at"] = [pos + 8 * j for j in range(n_dims)]
        t["dims"] = [u("<Q", at) for at in t["dims_at"]]
        pos += 8 * n_dims
        t.update(type_at=pos, type=u("<I", pos), offset_at=pos + 4, offset=u("<Q", pos + 4))
        pos += 12
        tensors.append(t)
    alignment = fields.get("general.alignment", {}).get("value", 32)
    import gguf

    for t in tensors:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t["type"])]
        t["n_bytes"] = math.prod(t["dims"]) // block * nbytes
    return {"fields": fields, "tensors": tensors, "tensor_count_at": 8, "kv_count_at": 16,
            "header_end": pos, "data_start": -(-pos // alignment) * alignment,
            "alignment": alignment}


def patch(data: bytes, at: int, fmt: str, value) -> bytes:
    """``data`` with ``struct.pack(fmt, value)`` written at ``at``."""
    raw = struct.pack(fmt, value)
    return data[:at] + raw + data[at + len(raw):]


def set_field(data: bytes, layout: dict, key: str, value) -> bytes:
    """``data`` with the scalar metadata ``key`` set to ``value`` (in the field's own type)."""
    f = layout["fields"][key]
    return patch(data, f["value_at"], SCALARS[f["type"]][0], value)


def tensor_info(layout: dict, name: str) -> dict:
    return next(t for t in layout["tensors"] if t["name"] == name)


def write_hf(directory, cfg: LlamaConfig = SMALL, tensors=None, shards=None, dtypes=None):
    """A Hugging Face directory of ``tensors`` (default: random ones of ``cfg``), one file or
    ``shards`` files plus an index; ``dtypes(name)`` picks each tensor's numpy dtype (default
    float32; ``"bfloat16"`` uses ml_dtypes). Returns the float32 tensors the files hold."""
    tensors = tiny_tensors(cfg) if tensors is None else tensors
    stored, out = {}, {}
    for name, arr in tensors.items():
        dt = (dtypes or (lambda n: "float32"))(name)
        if dt == "bfloat16":
            import ml_dtypes

            dt = ml_dtypes.bfloat16
        out[name] = np.ascontiguousarray(arr.astype(dt))
        stored[name] = out[name].astype(np.float32)
    save_hf_dir(directory, cfg, out, shards)
    return stored


def save_hf_dir(directory, cfg: LlamaConfig, tensors: dict, shards=None):
    """``config.json`` and ``tensors`` in ``directory``: one ``model.safetensors`` or, with
    ``shards`` (a number), that many files plus ``model.safetensors.index.json``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg.to_hf()))
    if not shards:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(directory / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def safetensors_header(data: bytes) -> tuple[dict, int]:
    """The header dict of safetensors ``data`` and where its data starts."""
    n = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8:8 + n]), 8 + n


def with_header(data: bytes, header: dict) -> bytes:
    """Safetensors ``data`` with its header replaced by ``header`` (the data bytes kept)."""
    _, start = safetensors_header(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[start:]
