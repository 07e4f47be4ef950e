"""Flax NNX tensor-parallel layers that communicate through jax_flashcomm.

Every layer takes a :class:`TPComm` (a quantization of :data:`QUANTIZATIONS` and a layout of
:data:`LAYOUTS`; :meth:`TPComm.from_kind` reads the kind strings of :data:`COMM_KINDS`), keeps
its parameters at global shape with sharding metadata, and runs on local shards inside a
``jax.shard_map`` (a model step's, or :func:`shard_call`'s for a layer on its own).
:class:`EPMoE` is the expert-parallel mixture-of-experts block (:mod:`jax_flashcomm.nn.moe`),
over an expert axis instead.
"""

from jax_flashcomm.nn.comm import COMM_KINDS, LAYOUTS, QUANTIZATIONS, TPComm
from jax_flashcomm.nn.layers import (RMSNorm, TPAttention, TPMLP, check_heads, kv_heads,
                                     padded_ffn, rope)
from jax_flashcomm.nn.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from jax_flashcomm.nn.moe import DISPATCH_MODES, EPMoE, moe_block, moe_reference
from jax_flashcomm.nn.sharded import param_specs, place, shard_call
from jax_flashcomm.fused_norm import rms_norm

__all__ = ["COMM_KINDS", "LAYOUTS", "QUANTIZATIONS", "TPComm", "RMSNorm", "TPAttention", "TPMLP",
           "check_heads", "kv_heads", "padded_ffn", "rope", "ColumnParallelLinear",
           "RowParallelLinear",
           "VocabParallelEmbedding", "param_specs", "place", "shard_call", "rms_norm",
           "DISPATCH_MODES", "EPMoE", "moe_block", "moe_reference"]
