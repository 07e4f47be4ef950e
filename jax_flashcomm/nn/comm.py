"""How a tensor-parallel layer communicates: one object, chosen by the user, used by every layer.

Four strategies (``TPComm.kind``):

* ``"exact"``: ``lax.psum`` after each row-parallel matmul (Megatron-style TP).
* ``"flash"``: :func:`jax_flashcomm.psum` with a :class:`~jax_flashcomm.CommConfig` (low-bit
  two-step all-reduce, Flash Communication).
* ``"overlap"``: sequence-parallel in and out: column-parallel matmuls gather the sequence with
  :func:`jax_flashcomm.all_gather_matmul`, row-parallel ones scatter it with
  :func:`jax_flashcomm.matmul_reduce_scatter` (ring steps next to partial matmuls, Flash-Overlap).
* ``"flash+overlap"``: the all-gather ring carries quantized chunks (``ag_bits`` of the config);
  the reduce-scatter is the quantized :func:`jax_flashcomm.psum_scatter` (``rs_bits``) after the
  matmul: there is no quantized reduce-scatter ring (re-quantizing the running sum at every step
  would add N-1 quantization errors).

Sequence parallelism needs the sequence length to be a multiple of the TP size, so the overlap
strategies use it where the caller says so (prefill); a one-token decode step cannot be split
over ranks and all-reduces instead (``lax.psum`` for ``overlap``, the quantized psum for
``flash+overlap``).
"""

from __future__ import annotations

import dataclasses

from jax import lax

from jax_flashcomm.allreduce import psum as flash_psum
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.policy import CommConfig
from jax_flashcomm.scatter_gather import psum_scatter as flash_psum_scatter
from jax_flashcomm.transport.ring import RING_TRANSPORTS

__all__ = ["TPComm", "COMM_KINDS"]

COMM_KINDS = ("exact", "flash", "overlap", "flash+overlap")


@dataclasses.dataclass(frozen=True)
class TPComm:
    """A communication strategy over the mesh axis ``axis_name`` (hashable: a static argument).

    ``config`` sets the quantization of the ``flash`` kinds (bits, per-phase bits, group size,
    spikes, rotation, min_bytes, backend); it defaults to ``CommConfig(bits=8, min_bytes=0)``:
    a layer's messages are small (one token's activations at decode), and a user who picked
    ``flash`` wants them quantized. ``bidirectional`` splits every ring chunk over both
    directions (overlap kinds). ``ring_transport`` is the ``transport=`` of the overlap kinds'
    ring matmuls (``"auto"``, ``"xla"`` or ``"p2p"``: docs/transport.md, "Ring steps").
    """

    kind: str = "exact"
    axis_name: str = "tp"
    config: CommConfig | None = None
    bidirectional: bool = False
    ring_transport: str = "auto"

    def __post_init__(self):
        if self.kind not in COMM_KINDS:
            raise ValueError(f"TPComm: unknown communication kind {self.kind!r}; "
                             f"expected one of {COMM_KINDS}")
        if not isinstance(self.axis_name, str):
            raise TypeError(f"TPComm: axis_name must be a mesh axis name (str), "
                            f"got {self.axis_name!r}")
        if self.ring_transport not in RING_TRANSPORTS:
            raise ValueError(f"TPComm: ring_transport must be one of {RING_TRANSPORTS}, got "
                             f"{self.ring_transport!r}")
        if self.quantized:
            config = self.config if self.config is not None else CommConfig(bits=8, min_bytes=0)
            if not isinstance(config, CommConfig):
                raise TypeError(f"TPComm: config must be a jax_flashcomm.CommConfig, "
                                f"got {type(config)}")
            if config.exact:
                raise ValueError(f"TPComm: kind={self.kind!r} quantizes; its config has "
                                 f"bits=None (use kind='exact' or 'overlap')")
            object.__setattr__(self, "config", config)
        elif self.config is not None and not self.config.exact:
            raise ValueError(f"TPComm: kind={self.kind!r} does not quantize; a config with "
                             f"bits={self.config.bits} would be ignored (use 'flash' or "
                             f"'flash+overlap')")

    @property
    def quantized(self) -> bool:
        return self.kind in ("flash", "flash+overlap")

    @property
    def overlap(self) -> bool:
        """Whether the sequence-parallel ring matmuls are used (where the caller allows)."""
        return self.kind in ("overlap", "flash+overlap")

    def all_reduce(self, x):
        """Sum of the ranks' partial results, replicated (after a row-parallel matmul)."""
        if self.quantized:
            return flash_psum(x, self.axis_name, config=self.config)
        return lax.psum(x, self.axis_name)

    def gather_matmul(self, x, w, axis: int):
        """``all_gather(x, axis) @ w``: the sequence-parallel input of a column-parallel matmul."""
        if self.kind == "flash+overlap":
            c = self.config
            return all_gather_matmul(x, w, self.axis_name, axis=axis,
                                     bidirectional=self.bidirectional, bits=c.phase2_bits,
                                     group_size=c.group_size, rotation=c.rotation,
                                     spikes=c.phase2_spikes,
                                     codec_backend="jnp" if c.backend == "auto" else c.backend,
                                     transport=self.ring_transport)
        return all_gather_matmul(x, w, self.axis_name, axis=axis,
                                 bidirectional=self.bidirectional, transport=self.ring_transport)

    def matmul_scatter(self, x, w, axis: int):
        """``psum_scatter(x @ w, axis)``: the sequence-parallel output of a row-parallel matmul."""
        if self.kind == "flash+overlap":
            return flash_psum_scatter(x @ w, self.axis_name, scatter_dimension=axis, tiled=True,
                                      config=self.config)
        return matmul_reduce_scatter(x, w, self.axis_name, axis=axis,
                                     bidirectional=self.bidirectional,
                                     transport=self.ring_transport)
