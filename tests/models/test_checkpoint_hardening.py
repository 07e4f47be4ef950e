"""Corrupt checkpoints are refused with a :class:`CheckpointError` naming the field (issue 38):
the probes that loaded silently (NaN hyper-parameters, wrapped / misaligned / shared tensor
offsets, a changed tensor type), crashed (``head_count = 0``, a list ``weight_map``), exhausted
memory (``block_count = 10**9``), followed a path out of the checkpoint, or returned a corrupt
cached download. Each probe patches one field of a small well-formed file written here."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from models.checkpoints import CheckpointError, open_checkpoint
from tests.support.checkpoint_files import (
    SMALL, gguf_map, patch, safetensors_header, set_field, tensor_info, with_header, write_gguf,
    write_hf)
from tests.support.tiny_llama import tiny_tensors

# -- GGUF ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """The small mixed-type GGUF (norms F32, embedding F16, attention Q8_0, MLP Q4_1), its
    bytes, field map and tensors."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    stored = write_gguf(path)
    data = path.read_bytes()
    return data, gguf_map(data), stored


def _open(tmp_path, data, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    ckpt = open_checkpoint(str(path))
    for n in ckpt.names():  # every tensor read, as load_model reads them
        ckpt.read(n)
    return ckpt


def test_gguf_pristine_loads(tmp_path, gguf_file):
    data, _, stored = gguf_file
    ckpt = _open(tmp_path, data)
    assert ckpt.config == SMALL
    for name, arr in stored.items():
        np.testing.assert_array_equal(ckpt.read(name), arr, err_msg=name)


@pytest.mark.parametrize("key,value", [
    ("llama.attention.layer_norm_rms_epsilon", float("nan")),
    ("llama.attention.layer_norm_rms_epsilon", float("inf")),
    ("llama.attention.layer_norm_rms_epsilon", 0.0),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5),
    ("llama.rope.freq_base", float("nan")),
    ("llama.rope.freq_base", float("-inf")),
    ("llama.rope.freq_base", 0.0),
])
def test_gguf_nonfinite_or_nonpositive_float(tmp_path, gguf_file, key, value):
    data, layout, _ = gguf_file
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        _open(tmp_path, set_field(data, layout, key, value))


@pytest.mark.parametrize("key,value", [
    ("llama.attention.head_count", 0),  # was ZeroDivisionError (no key_length: d // heads)
    ("llama.attention.head_count", 3),  # does not divide embedding_length 32
    ("llama.attention.head_count_kv", 0),
    ("llama.attention.head_count_kv", 3),  # does not divide head_count 4
    ("llama.embedding_length", 0),
    ("llama.feed_forward_length", 0),
    ("llama.context_length", 0),
    ("llama.vocab_size", 0),
    ("llama.block_count", 0),
    ("llama.rope.dimension_count", 4),  # partial RoPE: this model code rotates the whole head
    ("tokenizer.ggml.bos_token_id", 17),  # = vocab_size: out of the vocabulary
    ("tokenizer.ggml.eos_token_id", 2 ** 32 - 1),
])
def test_gguf_config_out_of_range(tmp_path, gguf_file, key, value):
    data, layout, _ = gguf_file
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        _open(tmp_path, set_field(data, layout, key, value))


def test_gguf_block_count_huge(tmp_path, gguf_file):
    """``block_count = 10**9`` used to build a billion layers of expected shapes (memory)."""
    data, layout, _ = gguf_file
    with pytest.raises(CheckpointError, match=r"llama\.block_count = 1000000000 is out of range"):
        _open(tmp_path, set_field(data, layout, "llama.block_count", 10 ** 9))


def test_gguf_block_count_shrunk(tmp_path, gguf_file):
    """One layer fewer than the file holds: used to load a one-layer model in silence."""
    data, layout, _ = gguf_file
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\..*config has 1 layers"):
        _open(tmp_path, set_field(data, layout, "llama.block_count", 1))


@pytest.mark.parametrize("how", ["wrap", "misaligned", "shared", "past_end"])
def test_gguf_tensor_offset(tmp_path, gguf_file, how):
    """An offset of 2**64 - 1 (wrapped around to the byte before the data section), one byte
    off the alignment, two tensors on the same data, an offset past the end."""
    data, layout, _ = gguf_file
    t = tensor_info(layout, "blk.1.attn_v.weight")
    value = {"wrap": 2 ** 64 - 1, "misaligned": t["offset"] + 1,
             "shared": tensor_info(layout, "blk.1.attn_k.weight")["offset"],
             "past_end": len(data)}[how]
    with pytest.raises(CheckpointError, match=r"blk\.1\.attn_v\.weight.*offset|offset.*blk\.1"):
        _open(tmp_path, patch(data, t["offset_at"], "<Q", value))


@pytest.mark.parametrize("tensor,new_type", [
    *(("blk.0.ffn_up.weight", k) for k in ("F32", "F16", "Q8_0", "Q4_0", "I32", "F64", "unknown")),
    *(("output_norm.weight", k) for k in ("F16", "Q8_0", "I32", "F64", "unknown"))])
def test_gguf_tensor_type_changed(tmp_path, gguf_file, tensor, new_type):
    """A Q4_1 tensor (and the last tensor, F32) read as another type: the bytes that type needs
    no longer match where the next tensor starts / where the file ends; an integer type of the
    same size (F32 -> I32) is not a weight type at all."""
    import gguf

    data, layout, _ = gguf_file
    t = tensor_info(layout, tensor)
    code = 99 if new_type == "unknown" else int(gguf.GGMLQuantizationType[new_type])
    assert code != t["type"]
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        _open(tmp_path, patch(data, t["type_at"], "<I", code))


def test_gguf_tensor_dims_changed(tmp_path, gguf_file):
    data, layout, _ = gguf_file
    t = tensor_info(layout, "blk.0.attn_norm.weight")
    for value in (0, 2 ** 63, 2 ** 64 - 1, 16):
        with pytest.raises(CheckpointError, match=r"blk\.0\.attn_norm\.weight"):
            _open(tmp_path, patch(data, t["dims_at"][0], "<Q", value))


def test_gguf_array_length_huge(tmp_path, gguf_file):
    """A metadata array claiming 2**62 items: gguf's reader looped over them past the end of
    the file (hours, memory)."""
    data, layout, _ = gguf_file
    f = layout["fields"]["general.fuzz_ints"]
    with pytest.raises(CheckpointError, match=r"general\.fuzz_ints"):
        _open(tmp_path, patch(data, f["count_at"], "<Q", 2 ** 62))


def test_gguf_nan_weight(tmp_path, gguf_file):
    """A NaN in an F32 weight (a norm) is corrupt data: refused when the tensor is read."""
    data, layout, _ = gguf_file
    t = tensor_info(layout, "blk.1.ffn_norm.weight")
    bad = patch(data, layout["data_start"] + t["offset"] + 8, "<f", float("nan"))
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_norm\.weight.*non-finite"):
        _open(tmp_path, bad)


def test_gguf_padding_byte_changes_nothing(tmp_path, gguf_file):
    """A byte of padding (between the header and the data, and after a tensor) carries nothing:
    the file loads and every tensor equals the original's."""
    data, layout, stored = gguf_file
    assert layout["data_start"] > layout["header_end"]
    pads = [layout["header_end"], layout["data_start"] - 1]
    for t in layout["tensors"]:
        end = layout["data_start"] + t["offset"] + t["n_bytes"]
        if end % layout["alignment"] and end < len(data):
            pads.append(end)
    assert len(pads) >= 2
    bad = data
    for at in pads:
        bad = bad[:at] + b"\x5a" + bad[at + 1:]
    ckpt = _open(tmp_path, bad)
    assert ckpt.config == SMALL
    for name, arr in stored.items():
        np.testing.assert_array_equal(ckpt.read(name), arr, err_msg=name)


# -- the real model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_bytes():
    from models.checkpoints.fetch import model_path

    path = model_path("smollm2")
    data = path.read_bytes()
    return data, gguf_map(data)


@pytest.mark.model
@pytest.mark.parametrize("probe", ["type:F32", "type:F16", "type:Q8_0", "rms_eps:nan",
                                   "freq_base:nan", "head_count:0", "offset:wrap"])
def test_smollm2_probes(tmp_path, smol_bytes, probe):
    """The issue's probes on a copy of SmolLM2's Q4_1 GGUF: each used to load (or crash) and
    make ``models.generate --greedy`` print ``<|endoftext|>`` four times with exit 0."""
    import gguf

    data, layout = smol_bytes
    what, _, arg = probe.partition(":")
    t = tensor_info(layout, "blk.3.ffn_up.weight")
    assert gguf.GGMLQuantizationType(t["type"]).name == "Q4_1"
    if what == "type":
        bad, match = patch(data, t["type_at"], "<I",
                           int(gguf.GGMLQuantizationType[arg])), r"blk\.3\.ffn_up"
    elif what == "offset":
        bad, match = patch(data, t["offset_at"], "<Q", 2 ** 64 - 1), r"blk\.3\.ffn_up.*offset"
    else:
        key = {"rms_eps": "llama.attention.layer_norm_rms_epsilon",
               "freq_base": "llama.rope.freq_base",
               "head_count": "llama.attention.head_count"}[what]
        bad, match = set_field(data, layout, key, float(arg) if what != "head_count"
                               else int(arg)), key.replace(".", r"\.")
    path = tmp_path / "smol-bad.gguf"
    path.write_bytes(bad)
    with pytest.raises(CheckpointError, match=match):
        open_checkpoint(str(path))


# -- safetensors -----------------------------------------------------------------------------


def _hf(tmp_path, shards=2):
    d = tmp_path / "hf"
    stored = write_hf(d, shards=shards)
    return d, stored


def _load_hf(d):
    ckpt = open_checkpoint(str(d))
    for n in ckpt.names():
        ckpt.read(n)
    return ckpt


def _index(d, update):
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    update(index)
    path.write_text(json.dumps(index))


def test_index_weight_map_list(tmp_path):
    """Was ``AttributeError: 'list' object has no attribute 'values'``."""
    d, _ = _hf(tmp_path)
    _index(d, lambda ix: ix.update(weight_map=list(ix["weight_map"].items())))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map must be"):
        _load_hf(d)


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_index_path_outside_the_checkpoint(tmp_path, how):
    """A shard named by an absolute path, or by ``../``, was opened wherever it pointed."""
    d, _ = _hf(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = "model-00002-of-00002.safetensors"
    shutil.move(str(d / shard), str(outside / shard))
    target = str(outside / shard) if how == "absolute" else f"../elsewhere/{shard}"
    _index(d, lambda ix: ix["weight_map"].update(
        {k: target for k, v in ix["weight_map"].items() if v == shard}))
    with pytest.raises(CheckpointError, match=r"not inside the checkpoint directory"):
        _load_hf(d)


def test_index_names_the_wrong_shard(tmp_path):
    d, _ = _hf(tmp_path)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    name = "model.layers.1.mlp.up_proj.weight"
    _index(d, lambda ix: ix["weight_map"].update(
        {name: shards[1 - shards.index(ix["weight_map"][name])]}))
    with pytest.raises(CheckpointError, match=r"weight_map puts model\.layers\.1\.mlp\.up_proj"):
        _load_hf(d)


@pytest.mark.parametrize("key,value", [
    ("rms_norm_eps", float("nan")), ("rope_theta", float("inf")), ("rope_theta", -1.0),
    ("num_attention_heads", 0), ("num_hidden_layers", 10 ** 9), ("num_hidden_layers", 1),
    ("hidden_size", 2.5), ("vocab_size", "17"), ("tie_word_embeddings", "false"),
    ("bos_token_id", 10 ** 6),
])
def test_config_json_out_of_range(tmp_path, key, value):
    """``num_attention_heads = 0`` was a ZeroDivisionError (hidden_size // heads), NaN / inf
    floats and a string ``tie_word_embeddings`` loaded silently, 10**9 layers ran out of
    memory."""
    d, _ = _hf(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    if key == "num_attention_heads":
        cfg.pop("head_dim")
    (d / "config.json").write_text(json.dumps(cfg))
    match = key if key != "num_hidden_layers" or value != 1 else r"config has 1 layers"
    with pytest.raises(CheckpointError, match=match):
        _load_hf(d)


@pytest.mark.parametrize("how", ["dtype", "offsets", "overlap", "gap", "duplicate"])
def test_safetensors_header_inconsistent(tmp_path, how):
    """A header whose entries do not add up: F32 relabelled I32 (same size), data_offsets off
    by a few bytes, two tensors on the same bytes, a hole between tensors, a repeated key."""
    d, _ = _hf(tmp_path, shards=None)
    path = d / "model.safetensors"
    data = path.read_bytes()
    header, _ = safetensors_header(data)
    spans = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    (a0, a1), first = spans[0]
    (b0, b1), second = spans[1]
    if how == "dtype":
        header[first]["dtype"] = "I32"
        new = with_header(data, header)
    elif how == "offsets":
        header[first]["data_offsets"] = [a0 + 4, a1 + 4]
        new = with_header(data, header)
    elif how == "overlap":
        header[second]["data_offsets"] = [a0, a0 + (b1 - b0)]
        new = with_header(data, header)
    elif how == "gap":
        header[first]["shape"] = [header[first]["shape"][0] - 1, *header[first]["shape"][1:]]
        header[first]["data_offsets"] = [a0, a1 - 4 * int(np.prod(header[first]["shape"][1:]))]
        new = with_header(data, header)
    else:
        raw = json.dumps(header).encode()
        dup = raw[:-1] + b', "' + first.encode() + b'": ' + json.dumps(header[first]).encode() + b"}"
        dup += b" " * (-len(dup) % 8)
        new = len(dup).to_bytes(8, "little") + dup + data[safetensors_header(data)[1]:]
    path.write_bytes(new)
    with pytest.raises(CheckpointError, match=r"truncated or corrupt safetensors"):
        _load_hf(d)


def test_safetensors_nan_weight(tmp_path):
    t = tiny_tensors(SMALL)
    t["model.norm.weight"][3] = np.inf
    d = tmp_path / "hf"
    write_hf(d, tensors=t)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*non-finite"):
        _load_hf(d)
