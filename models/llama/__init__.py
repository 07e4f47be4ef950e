"""Llama-architecture decoders (SmolLM2, Llama 2 and 3, ...) on the tensor-parallel layers of
:mod:`jax_flashcomm.nn`: the model (:mod:`models.llama.modeling`) and the mapping of a
checkpoint's tensors onto it, shard by shard (:mod:`models.llama.params`). README.md says how
to run it."""

from models.llama.modeling import (SITES, Block, Llama, LlamaSharding, layer_segments,
                                   policy_comms, set_comm, site_names)
from models.llama.params import load_model, load_weights

__all__ = ["Llama", "Block", "LlamaSharding", "set_comm", "SITES", "site_names", "policy_comms",
           "layer_segments", "load_model", "load_weights"]
