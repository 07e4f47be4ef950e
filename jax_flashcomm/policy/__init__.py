"""Per-site communication policies: which format each all-reduce of a model uses.

:class:`CommPolicy` (:mod:`._comm_policy`) maps call-site names to configs and reads and writes
its JSON file; :func:`calibrate` (:mod:`._calibrate`) chooses one from measured sensitivities
under an accuracy budget and a wire-bytes cap.
"""

from jax_flashcomm.policy._calibrate import calibrate, select
from jax_flashcomm.policy._comm_policy import (FILE_KIND, FILE_VERSION, MAX_FILE_BYTES, CommPolicy,
                                               config_from_dict, config_to_dict, wire_per_element,
                                               wire_vs_bf16)

__all__ = ["CommPolicy", "calibrate", "select", "config_to_dict", "config_from_dict",
           "wire_per_element", "wire_vs_bf16", "FILE_KIND", "FILE_VERSION", "MAX_FILE_BYTES"]
