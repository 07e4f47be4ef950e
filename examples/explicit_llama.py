"""A Llama written with sharding in types (Explicit mesh axes): plain ``jnp``, no ``shard_map``.

This is how JAX's own LLM examples write tensor parallelism now: weights are placed with
``NamedSharding``s (one frozen dataclass of PartitionSpecs, :class:`Sharding`), the row-parallel
projections say where their output lives (``out_sharding=P()``: the partial sums are
all-reduced; ``P(None, "tp", None)``: reduce-scattered over the sequence), and a sequence-parallel
residual is gathered with ``reshard``. Nothing here imports jax_flashcomm: the communication is
implied by the types, and ``jax_flashcomm.rewrite`` finds it (``examples/rewrite_llama.py``).

The math is :mod:`models.llama`'s (RMSNorm in f32, rotate-half RoPE with f32 angles, GQA with
f32 scores, SwiGLU, tied or untied embeddings). Weights come from the project's checkpoint
readers (:func:`models.checkpoints.open_checkpoint`), in Hugging Face layout, rearranged so that
each TP rank's heads (q, k, v side by side) and MLP units are one contiguous block.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["Sharding", "Dims", "load", "logits"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """PartitionSpecs of every weight over the TP axis ``tp`` (embeddings replicated)."""

    tp: str = "tp"

    @property
    def embed(self): return P(None, None)       # (V, D)
    @property
    def norm(self): return P(None)              # (D,)
    @property
    def qkv(self): return P(None, self.tp)      # (D, N * (q + 2 kv) * dh): rank blocks
    @property
    def o(self): return P(self.tp, None)        # (N * q * dh, D)
    @property
    def gate_up(self): return P(None, self.tp)  # (D, N * 2 * f)
    @property
    def down(self): return P(self.tp, None)     # (N * f, D)


@dataclasses.dataclass(frozen=True)
class Dims:
    """What the forward pass needs besides arrays: the model config, the TP size and axis."""

    config: object
    tp: int
    axis: str


def _rank_blocks(parts_per_rank: list[list[np.ndarray]]) -> np.ndarray:
    """Concatenate, per rank, its parts along the output axis; then the ranks."""
    return np.concatenate([np.concatenate(parts, axis=0) for parts in parts_per_rank], axis=0)


def load(ckpt, mesh, sharding: Sharding = Sharding()) -> tuple[Dims, dict]:
    """The weights of a checkpoint (:class:`models.checkpoints.Checkpoint`) on ``mesh``.

    Args:
      ckpt: an open checkpoint (Hugging Face names and (out, in) layout).
      mesh: a mesh with the axis ``sharding.tp`` (Explicit axes).
      sharding: the PartitionSpecs.

    Returns:
      ``(dims, weights)``: weights ``{"embed", "lm_head", "norm", "layers": [per layer]}``.
    """
    cfg = ckpt.config
    n = mesh.shape[sharding.tp]
    if cfg.n_heads % n or cfg.n_kv_heads % n or cfg.ffn_dim % n:
        raise ValueError(f"this example needs query heads ({cfg.n_heads}), KV heads "
                         f"({cfg.n_kv_heads}) and MLP width ({cfg.ffn_dim}) divisible by TP={n}")
    dh, q, kv, f = cfg.head_dim, cfg.n_heads // n, cfg.n_kv_heads // n, cfg.ffn_dim // n

    def put(array, spec):
        return jax.device_put(np.ascontiguousarray(array, np.float32), NamedSharding(mesh, spec))

    def layer(i):
        read = lambda name: ckpt.read(f"model.layers.{i}.{name}")  # noqa: E731
        wq, wk, wv = (read(f"self_attn.{k}_proj.weight") for k in "qkv")
        wg, wu = read("mlp.gate_proj.weight"), read("mlp.up_proj.weight")
        qkv = _rank_blocks([[wq[r * q * dh:(r + 1) * q * dh], wk[r * kv * dh:(r + 1) * kv * dh],
                             wv[r * kv * dh:(r + 1) * kv * dh]] for r in range(n)])
        gate_up = _rank_blocks([[wg[r * f:(r + 1) * f], wu[r * f:(r + 1) * f]]
                                for r in range(n)])
        return {"attn_norm": put(read("input_layernorm.weight"), sharding.norm),
                "qkv": put(qkv.T, sharding.qkv),
                "o": put(read("self_attn.o_proj.weight").T, sharding.o),
                "mlp_norm": put(read("post_attention_layernorm.weight"), sharding.norm),
                "gate_up": put(gate_up.T, sharding.gate_up),
                "down": put(read("mlp.down_proj.weight").T, sharding.down)}

    embed = put(ckpt.read("model.embed_tokens.weight"), sharding.embed)
    lm_head = (embed if cfg.tie_embeddings
               else put(ckpt.read("lm_head.weight"), sharding.embed))
    return Dims(cfg, n, sharding.tp), {
        "embed": embed, "lm_head": lm_head, "norm": put(ckpt.read("model.norm.weight"),
                                                        sharding.norm),
        "layers": [layer(i) for i in range(cfg.n_layers)]}


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
    """Rotate-half RoPE over the last axis of ``x (B, S, ..., dh)``; angles in f32."""
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    extra = (None,) * (x.ndim - 3)
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[(None, slice(None), *extra)]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[(None, slice(None), *extra)]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return (x.astype(jnp.float32) * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
            ).astype(x.dtype)


def _attention(w, x, cfg, n, tp, row_out):
    b, s, _ = x.shape
    dh, q, kv = cfg.head_dim, cfg.n_heads // n, cfg.n_kv_heads // n
    qkv = jnp.einsum("bsd,de->bse", x, w["qkv"])                        # (B, S, N*(q+2kv)*dh)
    qkv = jnp.reshape(qkv, (b, s, n, q + 2 * kv, dh), out_sharding=P(None, None, tp))
    positions = jnp.arange(s)
    qh = rope(qkv[:, :, :, :q], positions, cfg.rope_theta)
    kh = rope(qkv[:, :, :, q:q + kv], positions, cfg.rope_theta)
    vh = qkv[:, :, :, q + kv:]
    qg = jnp.reshape(qh, (b, s, n, kv, q // kv, dh), out_sharding=P(None, None, tp))
    scores = jnp.einsum("bsnkgh,btnkh->bnkgst", qg, kh,
                        preferred_element_type=jnp.float32) / math.sqrt(dh)
    scores = jnp.where(positions[None, :] <= positions[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype)
    out = jnp.einsum("bnkgst,btnkh->bsnkgh", probs, vh)
    out = jnp.reshape(out, (b, s, n * q * dh), out_sharding=P(None, None, tp))
    return jnp.einsum("bse,ed->bsd", out, w["o"], out_sharding=row_out)


def _mlp(w, x, n, tp, row_out):
    b, s, _ = x.shape
    gate_up = jnp.einsum("bsd,de->bse", x, w["gate_up"])
    gate_up = jnp.reshape(gate_up, (b, s, n, 2, -1), out_sharding=P(None, None, tp))
    h = jax.nn.silu(gate_up[:, :, :, 0]) * gate_up[:, :, :, 1]
    h = jnp.reshape(h, (b, s, -1), out_sharding=P(None, None, tp))
    return jnp.einsum("bsf,fd->bsd", h, w["down"], out_sharding=row_out)


def logits(dims: Dims, weights: dict, tokens: jax.Array, *,
           sequence_parallel: bool = False) -> jax.Array:
    """f32 logits ``(B, S, V)`` of ``tokens (B, S)``.

    Args:
      dims: :func:`load`'s first result.
      weights: its second (a pytree of arrays).
      tokens: token ids, replicated.
      sequence_parallel: keep the residual stream sharded over the sequence between blocks
        (``S`` divisible by TP): each block gathers it with ``reshard`` before its column-
        parallel projections and reduce-scatters after its row-parallel ones. Otherwise the
        residual is replicated and each block ends with two all-reduces.
    """
    cfg, n, tp = dims.config, dims.tp, dims.axis
    row_out = P(None, tp, None) if sequence_parallel else P()
    x = jnp.take(weights["embed"], tokens, axis=0)
    if sequence_parallel:
        x = jax.sharding.reshard(x, row_out)                             # a local slice
    gather = (lambda h: jax.sharding.reshard(h, P())) if sequence_parallel else (lambda h: h)
    for w in weights["layers"]:
        h = gather(rms_norm(x, w["attn_norm"], cfg.rms_eps))
        x = x + _attention(w, h, cfg, n, tp, row_out)
        h = gather(rms_norm(x, w["mlp_norm"], cfg.rms_eps))
        x = x + _mlp(w, h, n, tp, row_out)
    h = gather(rms_norm(x, weights["norm"], cfg.rms_eps))
    return jnp.einsum("bsd,vd->bsv", h, weights["lm_head"], preferred_element_type=jnp.float32)
