"""Placing a checkpoint's weights on the TP mesh, shard by shard.

Every parameter of :class:`models.llama.Llama` is built with ``jax.make_array_from_callback``:
the callback of each device reads only the rows / columns that device holds (through
``Checkpoint.read(name, index)``, which for safetensors reads just that slice from disk), and
rearranges them into the TP layout: q, k, v of a rank's heads side by side (KV heads replicated
when TP exceeds their number), gate and up likewise, the MLP and the vocabulary padded with
zeros to a multiple of TP. No device ever holds more than its shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jax_flashcomm import nn
from models.llama.modeling import Llama

if TYPE_CHECKING:
    from models.checkpoints import Checkpoint

__all__ = ["load_model", "load_weights"]


def _rank_block(index, axis: int, size: int) -> int:
    """Which rank's block of ``size`` columns/rows along ``axis`` a device index covers."""
    sl = index[axis]
    start = sl.start or 0
    stop = sl.stop if sl.stop is not None else start + size
    if stop - start != size or start % size:
        raise ValueError(f"weights: a device holds [{start}, {stop}) along axis {axis}, not one "
                         f"whole rank block of {size}: the mesh must split only the TP axis")
    return start // size


def _layer(name: str, i: int) -> str:
    return f"model.layers.{i}.{name}"


class _Reader:
    """Reads the TP layout of each parameter kind from a checkpoint in HF layout."""

    def __init__(self, ckpt: Checkpoint, model: Llama):
        self.ckpt, self.cfg, self.tp = ckpt, ckpt.config, model.tp
        cfg = self.cfg
        self.q_local = cfg.n_heads // self.tp
        self.slots = nn.kv_heads(cfg.n_heads, cfg.n_kv_heads, self.tp)
        self.kv_local = len(self.slots) // self.tp
        self.ffn_local = nn.padded_ffn(cfg.ffn_dim, self.tp) // self.tp
        self.vocab_local = model.embed.vocab_padded // self.tp

    def _rows(self, name, start, stop, total):
        """Rows [start, stop) of an HF (out, in) tensor, zero rows past ``total``."""
        out = np.zeros((stop - start,) + tuple(self.ckpt.shape(name)[1:]), np.float32)
        if start < total:
            out[:min(stop, total) - start] = self.ckpt.read(name, (slice(start, min(stop, total)),))
        return out

    def embedding(self, name, index):
        r = _rank_block(index, 0, self.vocab_local)
        v = self.vocab_local
        return self._rows(name, r * v, (r + 1) * v, self.cfg.vocab_size)

    def qkv(self, index, kind="weight"):
        """The fused q, k, v kernels (``kind="weight"``, transposed to ``(in, out)``) or biases
        (``kind="bias"``) of the rank that ``index`` covers, stacked over layers."""
        dh = self.cfg.head_dim
        per_rank = (self.q_local + 2 * self.kv_local) * dh
        r = _rank_block(index, len(index) - 1, per_rank)
        layers = []
        for i in range(self.cfg.n_layers):
            def rows(proj, start, stop, total=1 << 62, i=i):
                return self._rows(_layer(f"self_attn.{proj}_proj.{kind}", i), start, stop, total)

            q = rows("q", r * self.q_local * dh, (r + 1) * self.q_local * dh,
                     self.cfg.n_heads * dh)
            heads = self.slots[r * self.kv_local:(r + 1) * self.kv_local]
            k = [rows("k", h * dh, (h + 1) * dh) for h in heads]
            v = [rows("v", h * dh, (h + 1) * dh) for h in heads]
            layers.append(np.concatenate([q, *k, *v], axis=0).T)
        return np.stack(layers)

    def o(self, index):
        dh = self.cfg.head_dim
        rows = self.q_local * dh
        r = _rank_block(index, 1, rows)
        return np.stack([self.ckpt.read(_layer("self_attn.o_proj.weight", i),
                                        (slice(None), slice(r * rows, (r + 1) * rows))).T
                         for i in range(self.cfg.n_layers)])

    def gate_up(self, index):
        f = self.ffn_local
        r = _rank_block(index, 2, 2 * f)
        return np.stack([np.concatenate([
            self._rows(_layer(f"mlp.{kind}_proj.weight", i), r * f, (r + 1) * f,
                       self.cfg.ffn_dim) for kind in ("gate", "up")], axis=0).T
            for i in range(self.cfg.n_layers)])

    def down(self, index):
        f = self.ffn_local
        r = _rank_block(index, 1, f)
        layers = []
        for i in range(self.cfg.n_layers):
            name = _layer("mlp.down_proj.weight", i)
            block = np.zeros((self.cfg.d_model, f), np.float32)
            stop = min((r + 1) * f, self.cfg.ffn_dim)
            if r * f < stop:
                block[:, :stop - r * f] = self.ckpt.read(name, (slice(None), slice(r * f, stop)))
            layers.append(block.T)
        return np.stack(layers)

    def block_norm(self, kind):
        return np.stack([self.norm(_layer(kind, i)) for i in range(self.cfg.n_layers)])

    def norm(self, name):
        """An RMSNorm's scale: the checkpoint's weight plus the config's ``norm_offset``."""
        w = self.ckpt.read(name)
        return w + np.float32(self.cfg.norm_offset) if self.cfg.norm_offset else w


def load_weights(model: Llama, ckpt: Checkpoint, mesh) -> Llama:
    """Fill ``model`` (abstract or not) with ``ckpt``'s weights, placed on ``mesh``."""
    reader = _Reader(ckpt, model)
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    sources = {
        ("embed", "embedding"): lambda idx: reader.embedding("model.embed_tokens.weight", idx),
        ("lm_head", "embedding"): lambda idx: reader.embedding("lm_head.weight", idx),
        ("blocks", "attn", "qkv", "kernel"): reader.qkv,
        ("blocks", "attn", "o", "kernel"): reader.o,
        ("blocks", "mlp", "gate_up", "kernel"): reader.gate_up,
        ("blocks", "mlp", "down", "kernel"): reader.down,
        ("blocks", "attn", "qkv", "bias"): lambda idx: reader.qkv(idx, "bias"),
        ("blocks", "attn_norm", "scale"): lambda idx: reader.block_norm(
            "input_layernorm.weight")[idx],
        ("blocks", "mlp_norm", "scale"): lambda idx: reader.block_norm(
            "pre_feedforward_layernorm.weight" if ckpt.config.sandwich_norms
            else "post_attention_layernorm.weight")[idx],
        ("blocks", "post_attn_norm", "scale"): lambda idx: reader.block_norm(
            "post_attention_layernorm.weight")[idx],
        ("blocks", "post_mlp_norm", "scale"): lambda idx: reader.block_norm(
            "post_feedforward_layernorm.weight")[idx],
        ("blocks", "attn", "q_norm", "scale"): lambda idx: reader.block_norm(
            "self_attn.q_norm.weight")[idx],
        ("blocks", "attn", "k_norm", "scale"): lambda idx: reader.block_norm(
            "self_attn.k_norm.weight")[idx],
        ("norm", "scale"): lambda idx: reader.norm("model.norm.weight")[idx],
    }
    flat_specs = dict(nnx.to_flat_state(specs))
    new = {}
    for path, var in nnx.to_flat_state(state):
        key = tuple(str(p) for p in path)
        if key not in sources:
            raise KeyError(f"weights: no checkpoint source for parameter {'.'.join(key)}")
        sharding = NamedSharding(mesh, flat_specs[path].get_value())
        dtype = var.get_value().dtype
        shape = var.get_value().shape
        read = sources[key]
        array = jax.make_array_from_callback(
            shape, sharding, lambda idx, read=read, dtype=dtype: np.asarray(read(idx), dtype))
        new[path] = var.replace(array)
    nnx.update(model, nnx.from_flat_state(new))
    # the dequantized tensors (f32, whole: up to 4x a GGUF's bytes) are not needed any more
    ckpt.drop_cache()
    return model


def load_model(name_or_path: str, *, tp: int, mesh, comm: nn.TPComm | None = None,
               dtype=np.float32, ckpt: Checkpoint | None = None):
    """``(model, checkpoint)``: the Llama of a checkpoint (a known name such as ``"smollm2"``, a
    GGUF file or a Hugging Face directory) at TP size ``tp`` on ``mesh``."""
    if ckpt is None:
        from models.checkpoints import open_checkpoint

        ckpt = open_checkpoint(name_or_path)
    model = nnx.eval_shape(lambda: Llama(ckpt.config, tp=tp, comm=comm, dtype=dtype))
    return load_weights(model, ckpt, mesh), ckpt
