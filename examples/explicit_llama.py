"""A Llama written with sharding in types (Explicit mesh axes): plain ``jnp``, no ``shard_map``.

This is how JAX's own LLM examples write tensor parallelism now: weights are placed with
``NamedSharding``s (one frozen dataclass of PartitionSpecs, :class:`Sharding`), the row-parallel
projections say where their output lives (``out_sharding=P()``: the partial sums are
all-reduced; ``P(None, "tp", None)``: reduce-scattered over the sequence), and a sequence-parallel
residual is gathered with ``reshard``. Nothing here imports jax_flashcomm: the communication is
implied by the types, and ``jax_flashcomm.rewrite`` finds it (``examples/rewrite_llama.py``).

The math is :mod:`models.llama`'s (RMSNorm in f32, rotate-half RoPE with f32 angles, GQA with
f32 scores, SwiGLU, tied or untied embeddings), with the features of its other architectures
(the config's fields, :class:`models.checkpoints.llama_config.LlamaConfig`): Qwen2's q/k/v
biases; Gemma 3's QK-norm, norms after each sub-block, GeGLU, embeddings scaled by
``sqrt(d_model)``, sliding-window layers with their own RoPE base, query scalar and ``1 + w``
norm weights. Weights come from the project's checkpoint readers
(:func:`models.checkpoints.open_checkpoint`), in Hugging Face layout, rearranged so that each TP
rank's heads (q, k, v side by side) and MLP units are one contiguous block; with fewer KV heads
than ranks, each rank holds a copy of the one KV head its query heads share.
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

__all__ = ["Sharding", "Dims", "load", "logits", "local_heads"]


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
    def qkv_bias(self): return P(self.tp)       # (N * (q + 2 kv) * dh,): Qwen2
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

    @property
    def heads(self) -> tuple[int, int]:
        """``(query heads, KV heads)`` per rank (a KV head copied to every rank that needs it
        when there are fewer than ranks)."""
        return local_heads(self.config, self.tp)


def local_heads(cfg, n: int) -> tuple[int, int]:
    """``(q, kv)``: the query heads of a rank, and the KV heads they use (consecutive).

    Raises:
      ValueError: ``n`` does not split the heads and the MLP evenly.
    """
    q = cfg.n_heads // n
    group = cfg.n_heads // cfg.n_kv_heads
    if cfg.n_heads % n or cfg.ffn_dim % n or (q % group and group % q):
        raise ValueError(f"this example needs query heads ({cfg.n_heads}) and MLP width "
                         f"({cfg.ffn_dim}) divisible by TP={n}, and each rank's query heads to "
                         f"use whole KV heads ({cfg.n_kv_heads} KV heads)")
    return q, max(q // group, 1)


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
    q, kv = local_heads(cfg, n)
    dh, f, group = cfg.head_dim, cfg.ffn_dim // n, cfg.n_heads // cfg.n_kv_heads

    def put(array, spec):
        return jax.device_put(np.ascontiguousarray(array, np.float32), NamedSharding(mesh, spec))

    def norm(name):  # the scale an RMSNorm multiplies by (Gemma 3 stores it as w, uses 1 + w)
        w = ckpt.read(name)
        return put(w + np.float32(cfg.norm_offset) if cfg.norm_offset else w, sharding.norm)

    def heads(a, r):  # rank r's rows of q, k and v (weights or biases)
        first = r * q // group  # its first KV head
        return [a[0][r * q * dh:(r + 1) * q * dh], a[1][first * dh:(first + kv) * dh],
                a[2][first * dh:(first + kv) * dh]]

    def layer(i):
        read = lambda name: ckpt.read(f"model.layers.{i}.{name}")  # noqa: E731
        wqkv = [read(f"self_attn.{k}_proj.weight") for k in "qkv"]
        wg, wu = read("mlp.gate_proj.weight"), read("mlp.up_proj.weight")
        qkv = _rank_blocks([heads(wqkv, r) for r in range(n)])
        gate_up = _rank_blocks([[wg[r * f:(r + 1) * f], wu[r * f:(r + 1) * f]]
                                for r in range(n)])
        p = f"model.layers.{i}."
        w = {"attn_norm": norm(p + "input_layernorm.weight"),
             "qkv": put(qkv.T, sharding.qkv),
             "o": put(read("self_attn.o_proj.weight").T, sharding.o),
             "mlp_norm": norm(p + ("pre_feedforward_layernorm.weight" if cfg.sandwich_norms
                                   else "post_attention_layernorm.weight")),
             "gate_up": put(gate_up.T, sharding.gate_up),
             "down": put(read("mlp.down_proj.weight").T, sharding.down)}
        if cfg.qkv_bias:
            b = [read(f"self_attn.{k}_proj.bias") for k in "qkv"]
            w["qkv_bias"] = put(_rank_blocks([heads(b, r) for r in range(n)]), sharding.qkv_bias)
        if cfg.qk_norm:
            w["q_norm"] = norm(p + "self_attn.q_norm.weight")
            w["k_norm"] = norm(p + "self_attn.k_norm.weight")
        if cfg.sandwich_norms:
            w["post_attn_norm"] = norm(p + "post_attention_layernorm.weight")
            w["post_mlp_norm"] = norm(p + "post_feedforward_layernorm.weight")
        return w

    embed = put(ckpt.read("model.embed_tokens.weight"), sharding.embed)
    lm_head = (embed if cfg.tie_embeddings
               else put(ckpt.read("lm_head.weight"), sharding.embed))
    return Dims(cfg, n, sharding.tp), {
        "embed": embed, "lm_head": lm_head, "norm": norm("model.norm.weight"),
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


def layer_attention(cfg, i: int) -> tuple[int | None, float]:
    """``(window, RoPE base)`` of layer ``i``: a sliding window and the local base on Gemma 3's
    sliding layers, ``(None, rope_theta)`` on the others."""
    if cfg.is_sliding(i):
        return cfg.sliding_window, cfg.rope_local_theta
    return None, cfg.rope_theta


def qk_heads(w, qh, kh, cfg, positions, theta):
    """The queries and keys ``(B, S, N, heads, dh)`` after QK-norm (Gemma 3) and RoPE."""
    if cfg.qk_norm:
        qh, kh = rms_norm(qh, w["q_norm"], cfg.rms_eps), rms_norm(kh, w["k_norm"], cfg.rms_eps)
    return rope(qh, positions, theta), rope(kh, positions, theta)


def scale_and_mask(scores, cfg, positions, window):
    """Scaled scores (``1 / sqrt(dh)``, or the query scalar's), causal, within ``window``."""
    scores = (scores * cfg.query_scale if cfg.query_pre_attn_scalar
              else scores / math.sqrt(cfg.head_dim))
    scores = jnp.where(positions[None, :] <= positions[:, None], scores, -jnp.inf)
    if window is not None:
        scores = jnp.where(positions[:, None] - positions[None, :] < window, scores, -jnp.inf)
    return scores


def activation(cfg, x):
    """The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
    return jax.nn.silu(x) if cfg.activation == "silu" else jax.nn.gelu(x, approximate=True)


def embed_tokens(weights, tokens, cfg):
    """The embeddings of ``tokens`` (scaled by ``sqrt(d_model)`` for Gemma 3)."""
    x = jnp.take(weights["embed"], tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.d_model), jnp.float32).astype(x.dtype)
    return x


def _attention(w, x, cfg, n, tp, row_out, window, theta):
    b, s, _ = x.shape
    dh, (q, kv) = cfg.head_dim, local_heads(cfg, n)
    qkv = jnp.einsum("bsd,de->bse", x, w["qkv"])                        # (B, S, N*(q+2kv)*dh)
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"]
    qkv = jnp.reshape(qkv, (b, s, n, q + 2 * kv, dh), out_sharding=P(None, None, tp))
    positions = jnp.arange(s)
    qh, kh = qk_heads(w, qkv[:, :, :, :q], qkv[:, :, :, q:q + kv], cfg, positions, theta)
    vh = qkv[:, :, :, q + kv:]
    qg = jnp.reshape(qh, (b, s, n, kv, q // kv, dh), out_sharding=P(None, None, tp))
    scores = jnp.einsum("bsnkgh,btnkh->bnkgst", qg, kh, preferred_element_type=jnp.float32)
    scores = scale_and_mask(scores, cfg, positions, window)
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype)
    out = jnp.einsum("bnkgst,btnkh->bsnkgh", probs, vh)
    out = jnp.reshape(out, (b, s, n * q * dh), out_sharding=P(None, None, tp))
    return jnp.einsum("bse,ed->bsd", out, w["o"], out_sharding=row_out)


def _mlp(w, x, cfg, n, tp, row_out):
    b, s, _ = x.shape
    gate_up = jnp.einsum("bsd,de->bse", x, w["gate_up"])
    gate_up = jnp.reshape(gate_up, (b, s, n, 2, -1), out_sharding=P(None, None, tp))
    h = activation(cfg, gate_up[:, :, :, 0]) * gate_up[:, :, :, 1]
    h = jnp.reshape(h, (b, s, -1), out_sharding=P(None, None, tp))
    return jnp.einsum("bsf,fd->bsd", h, w["down"], out_sharding=row_out)


def post_norm(w, key, h, cfg):
    """``h`` through the sub-block's output norm (Gemma 3's ``post_*_norm``), if it has one."""
    return rms_norm(h, w[key], cfg.rms_eps) if key in w else h


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
    x = embed_tokens(weights, tokens, cfg)
    if sequence_parallel:
        x = jax.sharding.reshard(x, row_out)                             # a local slice
    gather = (lambda h: jax.sharding.reshard(h, P())) if sequence_parallel else (lambda h: h)
    for i, w in enumerate(weights["layers"]):
        h = gather(rms_norm(x, w["attn_norm"], cfg.rms_eps))
        x = x + post_norm(w, "post_attn_norm",
                          _attention(w, h, cfg, n, tp, row_out, *layer_attention(cfg, i)), cfg)
        h = gather(rms_norm(x, w["mlp_norm"], cfg.rms_eps))
        x = x + post_norm(w, "post_mlp_norm", _mlp(w, h, cfg, n, tp, row_out), cfg)
    h = gather(rms_norm(x, weights["norm"], cfg.rms_eps))
    return jnp.einsum("bsd,vd->bsv", h, weights["lm_head"], preferred_element_type=jnp.float32)
