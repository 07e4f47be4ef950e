"""The decoder of the Llama family (Llama, Qwen2, Gemma 3) built from the tensor-parallel layers
of :mod:`jax_flashcomm.nn`.

RMSNorm, RoPE, GQA attention, a gated MLP, tied or untied embeddings; the config's feature fields
(:class:`~models.checkpoints.llama_config.LlamaConfig`) add q/k/v biases (Qwen2), QK-norm,
post-sub-block norms, GeGLU, scaled embeddings and sliding-window layers (Gemma 3). The blocks are
stacked
(one parameter array per kind with a leading layer axis) and applied with ``lax.scan``, so a
step compiles once whatever the depth. Every method here runs on local shards inside the
``jax.shard_map`` of a model step (:mod:`models.engine`); :class:`LlamaSharding` says how each
array is laid out over the TP axis.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_flashcomm import nn
from jax_flashcomm.jax_compat import all_gather_invariant
from models.checkpoints.llama_config import LlamaConfig

__all__ = ["Llama", "Block", "LlamaSharding", "set_comm", "SITES", "site_names",
           "policy_comms"]

# The two all-reduces of a block, by the sub-block that ends with them: the attention output
# projection's and the MLP down projection's.
SITES = ("attn", "mlp")


@dataclasses.dataclass(frozen=True)
class LlamaSharding:
    """PartitionSpecs of a TP Llama over mesh axis ``axis`` (stacked blocks lead with layers).

    Attention heads, MLP units and vocabulary rows are split over ``axis``; norms are
    replicated; the KV cache ``(layers, batch, positions, kv_slots, head_dim)`` is split by KV
    slot, the same way as the k and v columns of ``qkv``.
    """

    axis: str = "tp"

    @property
    def embedding(self): return P(self.axis, None)          # (vocab_padded, d)
    @property
    def qkv(self): return P(None, None, self.axis)          # (layers, d, tp * (q + 2 kv) dh)
    @property
    def o(self): return P(None, self.axis, None)            # (layers, heads * dh, d)
    @property
    def gate_up(self): return P(None, None, self.axis)      # (layers, d, tp * 2 * ffn_local)
    @property
    def down(self): return P(None, self.axis, None)         # (layers, tp * ffn_local, d)
    @property
    def block_norm(self): return P(None, None)              # (layers, d)
    @property
    def final_norm(self): return P(None)                    # (d,)
    @property
    def kv_cache(self): return P(None, None, None, self.axis, None)
    @property
    def tokens(self): return P()                            # (batch, seq), replicated
    @property
    def logits(self): return P()                            # (batch, [seq,] vocab)


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``+ mlp(norm(.))``; with ``sandwich_norms`` each sub-block's
    output is normalised too before it is added (``x + norm(attn(norm(x)))``)."""

    def __init__(self, cfg: LlamaConfig, *, tp: int, comm: nn.TPComm, dtype, rngs):
        def norm():
            return nn.RMSNorm(cfg.d_model, eps=cfg.rms_eps, dtype=dtype, rngs=rngs)

        self.attn_norm = norm()
        self.attn = nn.TPAttention(
            cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, tp=tp, comm=comm,
            rope_theta=cfg.rope_theta, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
            norm_eps=cfg.rms_eps,
            query_scale=cfg.query_scale if cfg.query_pre_attn_scalar else None,
            dtype=dtype, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = nn.TPMLP(cfg.d_model, cfg.ffn_dim, tp=tp, comm=comm,
                            activation=cfg.activation, dtype=dtype, rngs=rngs)
        self.post_attn_norm = norm() if cfg.sandwich_norms else None
        self.post_mlp_norm = norm() if cfg.sandwich_norms else None

    def __call__(self, x, start, cache, *, decode: bool, sp: bool, window=None, theta=None):
        h, cache = self.attn(self.attn_norm(x), start, cache, decode=decode, sp=sp,
                             window=window, theta=theta)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = x + h
        m = self.mlp(self.mlp_norm(x), sp=sp)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm(m)
        return x + m, cache

    def fused(self, x, normed, next_scale, start, cache, *, decode: bool, window=None,
              theta=None):
        """The block with its all-reduces fused into the residual adds and the next norms
        (``TPComm.fuse_norm``, docs/fused_norm.md): ``normed`` is ``attn_norm(x)`` (from the
        previous block's fused op), ``next_scale`` the weight of the norm after this block (the
        next block's ``attn_norm`` or the final norm). Returns ``(x, next_norm(x), cache)``.

        With ``sandwich_norms`` the all-reduce is fused with the norm of the sub-block's output
        (a zero residual) and the residual add and the next pre-norm follow unfused."""
        eps = self.mlp_norm.eps
        h, cache = self.attn(normed, start, cache, decode=decode, reduce=False, window=window,
                             theta=theta)
        if self.post_attn_norm is None:
            normed, x = self.attn.o.comm.all_reduce_add_norm(h, x, self.mlp_norm.scale[...], eps)
        else:
            h, _ = self.attn.o.comm.all_reduce_add_norm(h, jnp.zeros_like(x),
                                                        self.post_attn_norm.scale[...], eps)
            x = x + h
            normed = nn.rms_norm(x, self.mlp_norm.scale[...], eps)
        m = self.mlp(normed, reduce=False)
        if self.post_mlp_norm is None:
            normed, x = self.mlp.down.comm.all_reduce_add_norm(m, x, next_scale, eps)
        else:
            m, _ = self.mlp.down.comm.all_reduce_add_norm(m, jnp.zeros_like(x),
                                                          self.post_mlp_norm.scale[...], eps)
            x = x + m
            normed = nn.rms_norm(x, next_scale, eps)
        return x, normed, cache


class Llama(nnx.Module):
    """The decoder. ``rngs=None`` makes zero parameters (to be loaded: use under
    ``nnx.eval_shape``, see :func:`models.llama.params.load_model`)."""

    def __init__(self, cfg: LlamaConfig, *, tp: int, comm: nn.TPComm | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        comm = comm if comm is not None else nn.TPComm("exact")
        nn.check_heads(cfg.n_heads, cfg.n_kv_heads, tp)
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.embed = nn.VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp=tp, comm=comm,
                                               dtype=dtype, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, axis_size=cfg.n_layers,
                  transform_metadata={nnx.PARTITION_NAME: None})
        def blocks(rngs):
            return Block(cfg, tp=tp, comm=comm, dtype=dtype, rngs=rngs)

        if rngs is None:
            self.blocks = nnx.vmap(lambda: Block(cfg, tp=tp, comm=comm, dtype=dtype, rngs=None),
                                   in_axes=(), out_axes=0, axis_size=cfg.n_layers,
                                   transform_metadata={nnx.PARTITION_NAME: None})()
        else:
            self.blocks = nnx.split_rngs(splits=cfg.n_layers)(blocks)(rngs)
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.rms_eps, dtype=dtype, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else nn.VocabParallelEmbedding(
            cfg.vocab_size, cfg.d_model, tp=tp, comm=comm, dtype=dtype, rngs=rngs))
        # ((layer, site), TPComm) pairs that replace the model's comm at one block's site (see
        # set_comm); sorted, so the tuple is a static, hashable part of the graph.
        self.comm_overrides: tuple = ()

    @property
    def comm(self) -> nn.TPComm:
        return self.embed.comm

    def kv_cache_shape(self, batch: int, length: int) -> tuple[int, ...]:
        """Global shape of each of the k and v caches."""
        slots = len(nn.kv_heads(self.cfg.n_heads, self.cfg.n_kv_heads, self.tp))
        return (self.cfg.n_layers, batch, length, slots, self.cfg.head_dim)

    def hidden(self, tokens, start, cache, *, decode: bool, sp: bool):
        """Final-norm hidden states of ``tokens (B, S)`` at positions ``start + [0, S)``
        (``(B, S / N, D)`` with ``sp``), and the updated ``cache`` (``(k, v)`` or None)."""
        x = self.embed(tokens, sp=sp).astype(self.dtype)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), jnp.float32).astype(x.dtype)
        if self.comm.fuse_norm and not sp:
            return self._hidden_fused(x, start, cache, decode=decode)
        graphdef, state = nnx.split(self.blocks)
        layers = jnp.arange(self.cfg.n_layers)

        def scan_layers(x, cache, first, stop, site_comms):
            def step(carry, xs):
                x, cache = carry
                layer_state, i = xs
                block = nnx.merge(graphdef, layer_state)
                for site, comm in site_comms:
                    set_comm(getattr(block, site), comm)
                local = self._local_attention(i)
                if cache is None:
                    x, _ = block(x, start, None, decode=decode, sp=sp, **local)
                    return (x, None), None
                layer_cache = (cache[0][i], cache[1][i])
                x, (k, v) = block(x, start, layer_cache, decode=decode, sp=sp, **local)
                cache = (lax.dynamic_update_index_in_dim(cache[0], k, i, 0),
                         lax.dynamic_update_index_in_dim(cache[1], v, i, 0))
                return (x, cache), None

            xs = jax.tree.map(lambda a: a[first:stop], (state, layers))
            return lax.scan(step, (x, cache), xs)[0]

        # one scan per run of consecutive layers with the same overrides (one without any)
        for first, stop, site_comms in layer_segments(self.cfg.n_layers, self.comm_overrides):
            x, cache = scan_layers(x, cache, first, stop, site_comms)
        return self.norm(x), cache

    def _local_attention(self, layer) -> dict:
        """The ``window`` and ``theta`` of traced layer index ``layer`` (none without sliding
        layers): the sliding window and the local RoPE base on sliding layers, no window
        (every position) and the global base on the others."""
        cfg = self.cfg
        if not (cfg.sliding_window and cfg.sliding_pattern):
            return {}
        sliding = (layer + 1) % cfg.sliding_pattern != 0
        return {"window": jnp.where(sliding, cfg.sliding_window, jnp.iinfo(jnp.int32).max),
                "theta": jnp.where(sliding, jnp.float32(cfg.rope_local_theta),
                                   jnp.float32(cfg.rope_theta))}

    def _hidden_fused(self, x, start, cache, *, decode: bool):
        """:meth:`hidden` with every all-reduce fused into the residual add and the norm after
        it (:meth:`Block.fused`): the first block's ``attn_norm`` runs alone, each block then
        hands the next one its normalised input, the last one the final norm's output."""
        graphdef, state = nnx.split(self.blocks)
        layers = jnp.arange(self.cfg.n_layers)
        norms = self.blocks.attn_norm.scale[...]                       # (layers, d)
        next_scales = jnp.concatenate([norms[1:], self.norm.scale[...][None].astype(norms.dtype)])
        normed = nn.rms_norm(x, norms[0], self.cfg.rms_eps)

        def scan_layers(carry, first, stop, site_comms):
            def step(carry, xs):
                x, normed, cache = carry
                layer_state, i, next_scale = xs
                block = nnx.merge(graphdef, layer_state)
                for site, comm in site_comms:
                    set_comm(getattr(block, site), comm)
                layer_cache = None if cache is None else (cache[0][i], cache[1][i])
                x, normed, kv = block.fused(x, normed, next_scale, start, layer_cache,
                                            decode=decode, **self._local_attention(i))
                if cache is not None:
                    cache = (lax.dynamic_update_index_in_dim(cache[0], kv[0], i, 0),
                             lax.dynamic_update_index_in_dim(cache[1], kv[1], i, 0))
                return (x, normed, cache), None

            xs = jax.tree.map(lambda a: a[first:stop], (state, layers, next_scales))
            return lax.scan(step, carry, xs)[0]

        carry = (x, normed, cache)
        for first, stop, site_comms in layer_segments(self.cfg.n_layers, self.comm_overrides):
            carry = scan_layers(carry, first, stop, site_comms)
        _, normed, cache = carry
        return normed, cache

    def logits(self, h):
        """Logits over the vocabulary, replicated: ``h (..., D)`` → ``(..., vocab)`` (f32 or
        f64)."""
        head = self.embed if self.lm_head is None else self.lm_head
        return head.attend(h).astype(jnp.promote_types(h.dtype, jnp.float32))

    def gather_sequence(self, h):
        """The whole sequence of ``h (B, S / N, D)`` (sequence-parallel) on every rank."""
        return all_gather_invariant(h, (self.comm.axis_name,), axis=1, tiled=True)


def set_comm(model: nnx.Module, comm: nn.TPComm, *, overrides=None) -> nnx.Module:
    """Use ``comm`` in every layer of ``model`` (in place; the weights are untouched).

    ``overrides`` (a :class:`Llama` only) maps ``(layer, site)`` to the ``TPComm`` of that one
    all-reduce, ``site`` one of :data:`SITES` (``"attn"``: after the attention output
    projection; ``"mlp"``: after the down projection), e.g. 8 bits for the few all-reduces that
    carry a model's outlier channels and 4 elsewhere. An override must use the same mesh axis
    and the same layout (``comm.layout``) as ``comm``. Each call replaces the
    previous overrides.
    """
    if not isinstance(comm, nn.TPComm):
        raise TypeError(f"set_comm: comm must be a jax_flashcomm.nn.TPComm, got {type(comm)}")
    pairs = _check_overrides(model, comm, overrides)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "comm") and not isinstance(type(module).__dict__.get("comm"),
                                                      property):
            module.comm = comm
    if isinstance(model, Llama):
        model.comm_overrides = pairs
    return model


def _check_overrides(model, comm: nn.TPComm, overrides) -> tuple:
    if not overrides:
        return ()
    if not isinstance(model, Llama):
        raise TypeError(f"set_comm: overrides apply to a Llama, got {type(model).__name__}")
    pairs = []
    for key, value in dict(overrides).items():
        if (not isinstance(key, tuple) or len(key) != 2 or key[1] not in SITES
                or not isinstance(key[0], int) or not 0 <= key[0] < model.cfg.n_layers):
            raise ValueError(f"set_comm: override key {key!r} is not (layer, site) with "
                             f"0 <= layer < {model.cfg.n_layers} and site in {SITES}")
        if not isinstance(value, nn.TPComm):
            raise TypeError(f"set_comm: override {key} must be a TPComm, got {type(value)}")
        if value.axis_name != comm.axis_name or value.layout != comm.layout:
            raise ValueError(f"set_comm: override {key} ({value.layout!r} over "
                             f"{value.axis_name!r}) must share comm's axis "
                             f"({comm.axis_name!r}) and layout ({comm.layout!r})")
        if value != comm:
            pairs.append((key, value))
    return tuple(sorted(pairs, key=lambda p: (p[0][0], SITES.index(p[0][1]))))


def site_names(n_layers: int) -> list[str]:
    """The names of a Llama's all-reduces in a :class:`jax_flashcomm.CommPolicy`:
    ``"<layer>.<site>"`` (``"0.attn"``, ``"0.mlp"``, ``"1.attn"``, ...), in execution order."""
    return [f"{layer}.{site}" for layer in range(n_layers) for site in SITES]


def policy_comms(policy, n_layers: int, *, axis_name: str = "tp", fuse_norm: bool = False):
    """``(comm, overrides)`` for :func:`set_comm` from a per-site
    :class:`jax_flashcomm.CommPolicy`: ``comm`` is the policy's default (``"quantized"`` with that
    config, ``"exact"`` for ``None``); ``overrides`` gives each listed site its config.

    Raises:
      ValueError: a site name that is not one of :func:`site_names` (a policy for another
        model).
    """
    from jax_flashcomm.policy import CommPolicy

    if not isinstance(policy, CommPolicy):
        raise TypeError(f"policy_comms: expected a jax_flashcomm.CommPolicy, got "
                        f"{type(policy).__name__}")

    known = set(site_names(n_layers))
    unknown = [name for name, _ in policy.sites if name not in known]
    if unknown:
        raise ValueError(f"the comm policy names sites this model does not have: "
                         f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} (a {n_layers}-layer "
                         f"Llama has 0.attn ... {n_layers - 1}.mlp)")
    overrides = {}
    for name, _ in policy.sites:
        layer, site = name.split(".")
        overrides[(int(layer), site)] = nn.TPComm.for_site(policy, name, axis_name,
                                                           fuse_norm=fuse_norm)
    return nn.TPComm.for_site(policy, None, axis_name, fuse_norm=fuse_norm), overrides


def layer_segments(n_layers: int, overrides: tuple) -> list[tuple[int, int, tuple]]:
    """``(first, stop, ((site, comm), ...))`` for each run of consecutive layers whose
    overrides are the same, covering ``range(n_layers)``."""
    per_layer = [tuple((site, c) for (layer, site), c in overrides if layer == i)
                 for i in range(n_layers)]
    segments, first = [], 0
    for i in range(1, n_layers + 1):
        if i == n_layers or per_layer[i] != per_layer[first]:
            segments.append((first, i, per_layer[first]))
            first = i
    return segments
