"""Expert-parallel mixture of experts (Flax NNX), its dense reference and a tiny MoE decoder.

:class:`EPMoE` (and the function it runs, :func:`moe_block`) is one MoE block on local shards
inside ``jax.shard_map`` over an expert axis (e.g. ``"ep"``) of ``N`` ranks. Each rank holds its
own tokens and ``n_experts / N`` consecutive experts (SwiGLU MLPs); every rank holds the router.

* Routing (Mixtral, Qwen3-MoE): ``softmax(x @ router)`` in f32, the ``top_k`` experts of each
  token, their probabilities renormalized to sum to one (``renormalize=False`` keeps them).
* Dispatch ``"capacity"``: each rank fills a dense ``(N, experts per rank, capacity, hidden)``
  buffer (``capacity`` slots per expert and per source rank; first choices take slots before
  second choices, tokens in order; assignments past the capacity are dropped: they add nothing
  to the output) and moves it with :func:`jax_flashcomm.all_to_all`; the expert outputs come
  back the same way.
* Dispatch ``"ragged"`` (MaxText, tunix): the ``tokens * top_k`` rows sorted by expert move with
  :func:`jax_flashcomm.ragged_all_to_all`, the send sizes from the routing, the receive sizes
  and offsets from a ``lax.all_to_all`` of the int32 counts; the receiver groups its rows by
  local expert (``lax.ragged_dot``) and sends the outputs back to where they came from. Nothing
  is dropped; the receive buffer holds ``buffer_rows`` rows (default ``N * tokens * top_k``,
  every rank's rows at once).
* Shared experts (``shared_ffn_dim > 0``): a dense SwiGLU MLP every token takes, added.
* ``dispatch_config`` / ``combine_config``: the :class:`~jax_flashcomm.CommConfig` of each
  direction (None: exact), e.g. ``CommConfig(format="fp8", min_bytes=0)`` for the dispatch and
  None for the combine. Each token's row is quantized in groups along the hidden axis.

:func:`moe_reference` is the same routing computed densely on one device (every expert on every
token, weighted by the gates). :func:`moe_decoder_init` / :func:`moe_decoder_logits` build and
run a tiny random-weight MoE language model (embedding, blocks of RMSNorm, causal attention,
RMSNorm, MoE, tied logits) sharded over the expert axis or dense.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.alltoall import all_to_all, ragged_all_to_all
from jax_flashcomm.config import CommConfig
from jax_flashcomm.fused_norm import rms_norm
from jax_flashcomm.nn.attention import attend

__all__ = ["DISPATCH_MODES", "EPMoE", "moe_block", "moe_reference", "route", "swiglu",
           "expert_capacity", "moe_decoder_init", "moe_decoder_logits", "moe_decoder_specs"]

#: How the tokens reach their experts.
DISPATCH_MODES = ("capacity", "ragged")
_EXACT = CommConfig(bits=None)


def route(router: jax.Array, x: jax.Array, top_k: int, *, renormalize: bool = True):
    """``(gates, experts)``, each ``(tokens, top_k)``: the f32 weights and int32 ids of each
    token's ``top_k`` experts (softmax over all experts in f32, then top-k)."""
    probs = jax.nn.softmax(x.astype(jnp.float32) @ router.astype(jnp.float32), axis=-1)
    gates, experts = lax.top_k(probs, top_k)
    if renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return gates, experts.astype(jnp.int32)


def swiglu(x, gate_up, down):
    """``(silu(x @ gate) * (x @ up)) @ down``, ``gate_up`` = ``[gate | up]`` ``(d, 2F)``."""
    gate, up = jnp.split(x @ gate_up, 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ down


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Slots per expert and per source rank: ``ceil(capacity_factor * tokens * top_k /
    n_experts)`` (at least 1); ``capacity_factor = n_experts`` never drops."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))


def _config(config):
    return _EXACT if config is None else config


def _check_weights(weights, n):
    el, d = weights["gate_up"].shape[:2]
    e = weights["router"].shape[1]
    if e != n * el:
        raise ValueError(f"moe_block: the router has {e} experts, the expert axis holds {n} "
                         f"ranks x {el} local experts")
    return e, el, d


def _capacity_dispatch(x, gates, experts, weights, axes, n, capacity, dispatch, combine):
    t, d = x.shape
    el = weights["gate_up"].shape[0]
    e_all = n * el
    e = experts.T.reshape(-1)                    # choice-major: first choices take slots first
    tok = jnp.tile(jnp.arange(t, dtype=jnp.int32), experts.shape[1])
    onehot = jax.nn.one_hot(e, e_all, dtype=jnp.int32)
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, e[:, None], axis=1)[:, 0]
    keep = pos < capacity
    slot = jnp.where(keep, pos, capacity)        # out of range: dropped by the scatter
    buf = jnp.zeros((e_all, capacity, d), x.dtype).at[e, slot].set(x[tok], mode="drop")
    recv = all_to_all(buf.reshape(n, el, capacity, d), axes, 0, 0, config=dispatch)
    rows = jnp.swapaxes(recv, 0, 1).reshape(el, n * capacity, d)     # per local expert
    h = jax.vmap(swiglu)(rows, weights["gate_up"], weights["down"])
    h = jnp.swapaxes(h.reshape(el, n, capacity, d), 0, 1)
    out = all_to_all(h, axes, 0, 0, config=combine).reshape(e_all, capacity, d)
    got = out.at[e, slot].get(mode="fill", fill_value=0).astype(jnp.float32)
    w = (gates.T.reshape(-1) * keep)[:, None]
    return jnp.zeros((t, d), jnp.float32).at[tok].add(got * w)


def _zeros(shape, dtype, axes):
    # varying like the rows: ragged_all_to_all's VJP returns a varying cotangent for `output`
    return _axes.to_varying(jnp.zeros(shape, dtype), axes)


def _ragged_dispatch(x, gates, experts, weights, axes, n, buffer_rows, dispatch, combine):
    t, d = x.shape
    k = experts.shape[1]
    el = weights["gate_up"].shape[0]
    e = experts.reshape(-1)                      # token-major assignments
    order = jnp.argsort(e, stable=True)
    rows = x[order // k]                         # (t * k, d), sorted by expert
    per = jnp.bincount(e, length=n * el).astype(jnp.int32).reshape(n, el)
    send = per.sum(axis=1)
    in_off = jnp.cumsum(send) - send
    got = lax.all_to_all(per, axes, 0, 0)        # [s, l]: rows from rank s for local expert l
    recv = got.sum(axis=1)
    recv_off = jnp.cumsum(recv) - recv
    out_off = lax.all_to_all(recv_off, axes, 0, 0, tiled=True)   # where rank j puts my rows
    src_off = lax.all_to_all(in_off, axes, 0, 0, tiled=True)     # where rank s took them from
    r = n * t * k if buffer_rows is None else buffer_rows
    landed = ragged_all_to_all(rows, _zeros((r, d), x.dtype, axes), in_off, send, out_off, recv,
                               axes, config=dispatch)
    # each received row's local expert (source-major segments of got), el past the end
    ends = jnp.cumsum(got.reshape(-1))
    seg = jnp.searchsorted(ends, jnp.arange(r, dtype=jnp.int32), side="right")
    local = jnp.where(seg < n * el, seg % el, el)
    lorder = jnp.argsort(local, stable=True)
    hidden = lax.ragged_dot(landed[lorder], weights["gate_up"], got.sum(axis=0))
    gate, up = jnp.split(hidden, 2, axis=-1)
    h = lax.ragged_dot(jax.nn.silu(gate) * up, weights["down"], got.sum(axis=0))
    h = jnp.zeros_like(h).at[lorder].set(h)
    back = ragged_all_to_all(h, _zeros((t * k, d), x.dtype, axes), recv_off, recv, src_off, send,
                             axes, config=combine)
    y = jnp.zeros_like(back).at[order].set(back).astype(jnp.float32).reshape(t, k, d)
    return jnp.sum(y * gates[..., None], axis=1)


def moe_block(weights: dict, x: jax.Array, axis_name, *, top_k: int = 2,
              mode: str = "capacity", capacity: int | None = None,
              capacity_factor: float = 1.25, renormalize: bool = True,
              buffer_rows: int | None = None, dispatch_config: CommConfig | None = None,
              combine_config: CommConfig | None = None) -> jax.Array:
    """One expert-parallel MoE block on local shards (call inside ``jax.shard_map``).

    Args:
      weights: ``router`` ``(d, E)`` (replicated), ``gate_up`` ``(E / N, d, 2F)`` and ``down``
        ``(E / N, F, d)`` (this rank's experts), optionally ``shared_gate_up`` ``(d, 2Fs)`` and
        ``shared_down`` ``(Fs, d)`` (replicated).
      x: ``(..., d)``: this rank's tokens.
      axis_name: the expert mesh axis (or a tuple of axes).
      top_k: experts per token.
      mode: one of :data:`DISPATCH_MODES`.
      capacity: ``"capacity"`` mode's slots per expert and per source rank (default
        :func:`expert_capacity` of ``capacity_factor``).
      capacity_factor: see :func:`expert_capacity`.
      renormalize: scale each token's top-k gates to sum to one.
      buffer_rows: ``"ragged"`` mode's receive buffer (default every rank's rows at once).
      dispatch_config, combine_config: the config of each direction; None is exact.

    Returns:
      ``x``'s shape and dtype: the gate-weighted expert outputs (plus the shared experts').
    """
    if mode not in DISPATCH_MODES:
        raise ValueError(f"moe_block: mode must be one of {DISPATCH_MODES}, got {mode!r}")
    axes = _axes.normalize_axes(axis_name, "moe_block")
    n = _axes.axis_size(axes)
    e_all, _, d = _check_weights(weights, n)
    shape = x.shape
    x = x.reshape(-1, d)
    gates, experts = route(weights["router"], x, top_k, renormalize=renormalize)
    dispatch, combine = _config(dispatch_config), _config(combine_config)
    if mode == "capacity":
        c = capacity or expert_capacity(x.shape[0], top_k, e_all, capacity_factor)
        y = _capacity_dispatch(x, gates, experts, weights, axes, n, c, dispatch, combine)
    else:
        y = _ragged_dispatch(x, gates, experts, weights, axes, n, buffer_rows, dispatch,
                             combine)
    if "shared_gate_up" in weights:
        y = y + swiglu(x, weights["shared_gate_up"], weights["shared_down"]).astype(y.dtype)
    return y.astype(x.dtype).reshape(shape)


def moe_reference(weights: dict, x: jax.Array, *, top_k: int = 2,
                  renormalize: bool = True) -> jax.Array:
    """The MoE block computed densely on one device: every expert on every token, weighted by
    the top-k gates (zero elsewhere); ``weights`` at global shape (:meth:`EPMoE.weights`)."""
    shape, d = x.shape, x.shape[-1]
    x = x.reshape(-1, d)
    gates, experts = route(weights["router"], x, top_k, renormalize=renormalize)
    dense = jnp.zeros((x.shape[0], weights["router"].shape[1]), jnp.float32)
    dense = dense.at[jnp.arange(x.shape[0])[:, None], experts].set(gates)
    outs = jax.vmap(swiglu, in_axes=(None, 0, 0))(x, weights["gate_up"], weights["down"])
    y = jnp.einsum("te,etd->td", dense, outs.astype(jnp.float32))
    if "shared_gate_up" in weights:
        y = y + swiglu(x, weights["shared_gate_up"], weights["shared_down"]).astype(y.dtype)
    return y.astype(x.dtype).reshape(shape)


def _normal(key, shape, fan_in, dtype):
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def _init(rngs, shape, fan_in, dtype, sharding):
    value = (jnp.zeros(shape, dtype) if rngs is None
             else _normal(rngs.params(), shape, fan_in, dtype))
    return nnx.Param(value, out_sharding=tuple(sharding), eager_sharding=False)


class EPMoE(nnx.Module):
    """An expert-parallel MoE block: ``__call__(x)`` is :func:`moe_block` on local shards.

    Parameters at global shape with sharding metadata (:func:`jax_flashcomm.nn.shard_call`
    runs it on its own): the router ``(d, E)`` and the shared experts replicated, the experts'
    ``gate_up`` ``(E, d, 2F)`` and ``down`` ``(E, F, d)`` sharded over ``axis_name``.

    Args:
      d_model: the model width.
      ffn_dim: each expert's hidden width.
      n_experts: the experts (a multiple of ``ep``).
      ep: the ranks on ``axis_name``.
      top_k, mode, capacity_factor, renormalize, buffer_rows, dispatch_config,
        combine_config: as for :func:`moe_block`.
      axis_name: the expert mesh axis.
      shared_ffn_dim: the shared experts' hidden width (0: none).
      dtype: the parameters' dtype.
      rngs: ``nnx.Rngs`` (normal, ``1 / sqrt(fan_in)`` scaled), or None for zeros.
    """

    def __init__(self, d_model: int, ffn_dim: int, n_experts: int, *, ep: int, top_k: int = 2,
                 axis_name: str = "ep", mode: str = "capacity", capacity_factor: float = 1.25,
                 renormalize: bool = True, buffer_rows: int | None = None,
                 shared_ffn_dim: int = 0, dispatch_config: CommConfig | None = None,
                 combine_config: CommConfig | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        if n_experts % ep:
            raise ValueError(f"EPMoE: n_experts={n_experts} is not a multiple of ep={ep}")
        if mode not in DISPATCH_MODES:
            raise ValueError(f"EPMoE: mode must be one of {DISPATCH_MODES}, got {mode!r}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"EPMoE: top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.axis_name, self.top_k, self.mode = axis_name, top_k, mode
        self.capacity_factor, self.renormalize, self.buffer_rows = (capacity_factor,
                                                                    renormalize, buffer_rows)
        self.dispatch_config, self.combine_config = dispatch_config, combine_config
        ep_ = (axis_name, None, None)
        self.router = _init(rngs, (d_model, n_experts), d_model, dtype, (None, None))
        self.gate_up = _init(rngs, (n_experts, d_model, 2 * ffn_dim), d_model, dtype, ep_)
        self.down = _init(rngs, (n_experts, ffn_dim, d_model), ffn_dim, dtype, ep_)
        fs = shared_ffn_dim
        self.shared_gate_up = (_init(rngs, (d_model, 2 * fs), d_model, dtype, (None, None))
                               if fs else None)
        self.shared_down = (_init(rngs, (fs, d_model), fs, dtype, (None, None)) if fs
                            else None)

    def weights(self) -> dict:
        """The parameters as :func:`moe_block` / :func:`moe_reference` take them (local shards
        inside ``shard_map``, global arrays outside)."""
        names = ["router", "gate_up", "down"]
        if self.shared_gate_up is not None:
            names += ["shared_gate_up", "shared_down"]
        return {name: getattr(self, name)[...] for name in names}

    def __call__(self, x):
        return moe_block(self.weights(), x, self.axis_name, top_k=self.top_k, mode=self.mode,
                         capacity_factor=self.capacity_factor, renormalize=self.renormalize,
                         buffer_rows=self.buffer_rows, dispatch_config=self.dispatch_config,
                         combine_config=self.combine_config)


# --- a tiny MoE decoder ---------------------------------------------------------------------------

def moe_decoder_init(key, *, vocab: int = 256, d_model: int = 128, n_layers: int = 2,
                     n_heads: int = 4, n_experts: int = 8, ffn_dim: int = 256,
                     shared_ffn_dim: int = 0, dtype=jnp.float32) -> dict:
    """Random weights of a tiny MoE decoder (global shapes; ``1 / sqrt(fan_in)`` normal, the
    embedding's rows of norm about 1, so the blocks' outputs, not the token's own embedding,
    decide the logits).

    Returns:
      ``{"embed": (vocab, d), "norm": (d,), "n_heads": int, "layers": [per layer: "attn_norm",
      "wqkv" (d, 3d), "wo" (d, d), "moe_norm", "moe": the :func:`moe_block` weights]}``.
    """
    keys = iter(jax.random.split(key, 2 + 8 * n_layers))
    d = d_model
    layers = []
    for _ in range(n_layers):
        moe = {"router": _normal(next(keys), (d, n_experts), d, dtype),
               "gate_up": _normal(next(keys), (n_experts, d, 2 * ffn_dim), d, dtype),
               "down": _normal(next(keys), (n_experts, ffn_dim, d), ffn_dim, dtype)}
        if shared_ffn_dim:
            moe["shared_gate_up"] = _normal(next(keys), (d, 2 * shared_ffn_dim), d, dtype)
            moe["shared_down"] = _normal(next(keys), (shared_ffn_dim, d), shared_ffn_dim, dtype)
        layers.append({"attn_norm": jnp.ones((d,), dtype), "moe_norm": jnp.ones((d,), dtype),
                       "wqkv": _normal(next(keys), (d, 3 * d), d, dtype),
                       "wo": _normal(next(keys), (d, d), d, dtype), "moe": moe})
    return {"embed": _normal(next(keys), (vocab, d), d, dtype), "norm": jnp.ones((d,), dtype),
            "n_heads": n_heads, "layers": layers}


def moe_decoder_specs(params: dict, axis_name: str = "ep"):
    """The ``PartitionSpec`` pytree of :func:`moe_decoder_init`'s params: experts sharded
    over ``axis_name``, everything else replicated (``n_heads`` is static: pass it apart)."""
    spec = jax.sharding.PartitionSpec
    return jax.tree_util.tree_map_with_path(
        lambda path, _: spec(axis_name) if path[-1].key in ("gate_up", "down") else spec(),
        {k: v for k, v in params.items() if k != "n_heads"})


def moe_decoder_logits(params: dict, ids: jax.Array, axis_name=None, *, n_heads: int = 4,
                       eps: float = 1e-6, **block) -> jax.Array:
    """f32 logits ``(B, S, vocab)`` of the tiny decoder on ``ids`` ``(B, S)`` (tied embedding).

    Args:
      params: :func:`moe_decoder_init`'s (without ``n_heads``), local shards inside
        ``shard_map`` (specs: :func:`moe_decoder_specs`).
      ids: int token ids; inside ``shard_map``, this rank's sequences.
      axis_name: the expert axis (:func:`moe_block`), or None for :func:`moe_reference`.
      n_heads: attention heads.
      eps: the RMSNorms' epsilon.
      **block: :func:`moe_block`'s keywords (``top_k``, ``mode``, the configs, ...); with
        ``axis_name=None`` only ``top_k`` and ``renormalize``.
    """
    x = params["embed"][ids]
    b, s, d = x.shape
    pos = jnp.arange(s, dtype=jnp.int32)
    for layer in params["layers"]:
        q, k, v = jnp.split(rms_norm(x, layer["attn_norm"], eps) @ layer["wqkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, s, n_heads, d // n_heads) for a in (q, k, v))
        x = x + attend(q, k, v, pos, pos).reshape(b, s, d) @ layer["wo"]
        h = rms_norm(x, layer["moe_norm"], eps)
        if axis_name is None:
            x = x + moe_reference(layer["moe"], h, **block)
        else:
            x = x + moe_block(layer["moe"], h, axis_name, **block)
    x = rms_norm(x, params["norm"], eps).astype(jnp.float32)
    return x @ params["embed"].astype(jnp.float32).T          # f32 logits: no bf16 ties
