"""Jit-compiled tensor-parallel inference of a :class:`models.llama.Llama`: prefill, decode,
scoring, sampling.

Each step is one ``jax.jit`` of one ``jax.shard_map`` over the model's TP mesh axis. Prompts are
padded to a few bucket lengths, so a generation compiles once per bucket used for its prefill
and once for its decode step (``Engine.traces`` counts traces, the tests assert it). The KV
cache lives on the mesh, split by KV head, and is donated to every step (updated in place).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama import Llama, LlamaSharding

__all__ = ["Engine", "Sampling", "sample", "DEFAULT_BUCKETS"]

#: Prefill lengths a prompt is padded to (then to a multiple of the TP size).
DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Next-token choice: greedy when ``temperature == 0``, else sampled from the softmax at
    ``temperature``, restricted to the ``top_k`` most likely tokens (0: all) and to the smallest
    set whose probability reaches ``top_p`` (1.0: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits, key, sampling: Sampling):
    """Token ids ``(B,)`` from ``logits (B, V)``."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # the smallest prefix whose mass reaches top_p: keep tokens up to the first crossing
        cutoff_index = jnp.sum(cum < sampling.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class Engine:
    """Prefill / decode / score steps of ``model`` on ``mesh`` (its TP axis is the model's).

    ``cache_len``: positions of the KV cache (prompt + generated tokens must fit), rounded up
    to a multiple of the TP size.
    """

    def __init__(self, model: Llama, mesh, *, cache_len: int = 2048,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        axis = model.comm.axis_name
        if mesh.shape.get(axis) != model.tp:
            raise ValueError(f"Engine: the model is built for TP={model.tp} over axis "
                             f"{axis!r}, the mesh has {dict(mesh.shape)}")
        self.model, self.mesh, self.tp = model, mesh, model.tp
        self.sharding = LlamaSharding(axis)
        self.cache_len = -(-cache_len // self.tp) * self.tp
        if self.cache_len > model.cfg.max_seq_len:
            raise ValueError(f"Engine: cache_len={cache_len} exceeds the model's context "
                             f"{model.cfg.max_seq_len}")
        self.buckets = tuple(sorted({min(-(-b // self.tp) * self.tp, self.cache_len)
                                     for b in buckets}))
        self.graphdef, self.state = nnx.split(model)
        self.specs = nnx.get_partition_spec(self.state)
        self.traces: collections.Counter = collections.Counter()
        self._prefill = jax.jit(self._prefill_step, donate_argnums=(3,))
        self._decode = jax.jit(self._decode_step, donate_argnums=(3,), static_argnums=(5,))
        self._score = jax.jit(self._score_step)

    # --- placement -------------------------------------------------------------------------

    def _put(self, array, spec=P()):
        """``array`` on the mesh. Across processes ``device_put`` places host (numpy) values
        only, so a local jax array (the PRNG key of a decode step) goes through numpy, a key
        as its key data."""
        if (isinstance(array, jax.Array) and array.is_fully_addressable
                and jax.process_count() > 1):
            if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(
                    self._put(np.asarray(jax.random.key_data(array)), spec),
                    impl=jax.random.key_impl(array))
            array = np.asarray(array)
        return jax.device_put(array, NamedSharding(self.mesh, spec))

    def new_cache(self, batch: int = 1):
        """Zeroed ``(k, v)`` caches on the mesh, split by KV slot."""
        shape = self.model.kv_cache_shape(batch, self.cache_len)
        sharding = NamedSharding(self.mesh, self.sharding.kv_cache)
        zeros = jax.jit(lambda: jnp.zeros(shape, self.model.dtype), out_shardings=sharding)
        return zeros(), zeros()

    def bucket(self, length: int) -> int:
        """The padded prefill length of a prompt of ``length`` tokens."""
        if length < 1:
            raise ValueError("the prompt is empty")
        if length > self.cache_len:
            raise ValueError(f"the prompt has {length} tokens, longer than the KV cache "
                             f"({self.cache_len} positions)")
        return next(b for b in self.buckets if b >= length)

    # --- the steps (traced) ----------------------------------------------------------------

    def _shard_map(self, body, in_specs, out_specs):
        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.specs, *in_specs),
                             out_specs=out_specs)

    def _prefill_step(self, state, tokens, length, cache):
        self.traces["prefill", tokens.shape[1]] += 1
        sp = self.model.comm.overlap and self.tp > 1
        cspec = self.sharding.kv_cache

        def body(state, tokens, length, cache):
            model = nnx.merge(self.graphdef, state)
            h, cache = model.hidden(tokens, 0, cache, decode=False, sp=sp)
            if sp:
                h = model.gather_sequence(h)
            last = jax.lax.dynamic_index_in_dim(h, length - 1, axis=1, keepdims=False)
            return model.logits(last), cache

        return self._shard_map(body, (P(), P(), (cspec, cspec)), (P(), (cspec, cspec)))(
            state, tokens, length, cache)

    def _decode_step(self, state, tokens, pos, cache, key, sampling: Sampling):
        self.traces["decode"] += 1
        cspec = self.sharding.kv_cache

        def body(state, tokens, pos, cache):
            model = nnx.merge(self.graphdef, state)
            h, cache = model.hidden(tokens[:, None], pos, cache, decode=True, sp=False)
            return model.logits(h[:, 0]), cache

        logits, cache = self._shard_map(body, (P(), P(), (cspec, cspec)),
                                        (P(), (cspec, cspec)))(state, tokens, pos, cache)
        return sample(logits, key, sampling), logits, cache

    def _score_step(self, state, tokens):
        self.traces["score", tokens.shape[1]] += 1
        sp = self.model.comm.overlap and self.tp > 1

        def body(state, tokens):
            model = nnx.merge(self.graphdef, state)
            h, _ = model.hidden(tokens, 0, None, decode=False, sp=sp)
            if sp:
                h = model.gather_sequence(h)
            return model.logits(h)

        return self._shard_map(body, (P(),), P())(state, tokens)

    # --- the public calls ------------------------------------------------------------------

    def prefill(self, tokens, cache):
        """Run the prompt ``tokens (B, L)`` (all rows of length L): returns the logits of the
        next token ``(B, V)`` and the cache filled at positions ``[0, L)``."""
        tokens = np.asarray(tokens, np.int32)
        length = tokens.shape[1]
        padded = np.zeros((tokens.shape[0], self.bucket(length)), np.int32)
        padded[:, :length] = tokens
        return self._prefill(self.state, self._put(padded), self._put(np.int32(length)), cache)

    def decode(self, tokens, pos: int, cache, key, sampling: Sampling = Sampling()):
        """One token per row at position ``pos``: returns ``(next_tokens (B,), logits (B, V),
        cache)``."""
        if pos >= self.cache_len:
            raise ValueError(f"position {pos} is past the end of the KV cache "
                             f"({self.cache_len} positions)")
        tokens = self._put(jnp.asarray(tokens, jnp.int32))
        return self._decode(self.state, tokens, self._put(np.int32(pos)), cache,
                            self._put(key), sampling)

    def score(self, tokens):
        """Logits ``(B, S, V)`` (f32) at every position of ``tokens (B, S)``, no cache (padded
        to a multiple of the TP size when the strategy is sequence-parallel)."""
        tokens = np.asarray(tokens, np.int32)
        s = tokens.shape[1]
        padded_len = -(-s // self.tp) * self.tp if self.model.comm.overlap else s
        padded = np.zeros((tokens.shape[0], padded_len), np.int32)
        padded[:, :s] = tokens
        return self._score(self.state, self._put(padded))[:, :s]

    def generate(self, prompt_ids, max_new_tokens: int, *, sampling: Sampling = Sampling(),
                 seed: int = 0, stop_ids=()) -> Iterator[int]:
        """Yield generated token ids of one prompt, one at a time (stops after an id in
        ``stop_ids``, which is yielded, or after ``max_new_tokens``). ``self.last_timings``
        holds ``ttft`` (seconds to the first token) and the ``decode`` step times."""
        prompt = np.asarray(prompt_ids, np.int32)[None, :]
        if prompt.shape[1] + max_new_tokens > self.cache_len:
            raise ValueError(f"the prompt ({prompt.shape[1]} tokens) and {max_new_tokens} new "
                             f"tokens do not fit in the KV cache ({self.cache_len} positions)")
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        cache = self.new_cache(1)
        logits, cache = self.prefill(prompt, cache)
        key, sub = jax.random.split(key)
        token = sample(logits, sub, sampling)
        first = int(token[0])
        self.last_timings = {"ttft": time.perf_counter() - t0, "decode": []}
        yield first
        if first in stop_ids:
            return
        pos = prompt.shape[1]
        for _ in range(max_new_tokens - 1):
            t = time.perf_counter()
            key, sub = jax.random.split(key)
            token, _, cache = self.decode(token, pos, cache, sub, sampling)
            tid = int(token[0])
            self.last_timings["decode"].append(time.perf_counter() - t)
            yield tid
            if tid in stop_ids:
                return
            pos += 1
