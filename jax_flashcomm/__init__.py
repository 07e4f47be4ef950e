"""jax_flashcomm: faster tensor-parallel collectives for JAX.

Low-bit quantized collectives (Flash Communication, arXiv 2412.04964) and ring-decomposed
collective matmuls (Flash-Overlap, arXiv 2604.24013), as drop-ins for ``jax.lax``. Every op
takes ``config=`` (a :class:`CommConfig`) and the same keyword options; :func:`plan` decides
the path of each call and :func:`record` shows it.
"""

from jax_flashcomm import codec
from jax_flashcomm.allreduce import pmean, psum
from jax_flashcomm.alltoall import all_to_all, ragged_all_to_all
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.config import OPTION_NAMES, CommConfig
from jax_flashcomm.fused_norm import psum_add_rms_norm
from jax_flashcomm.planner import Plan, plan, record
from jax_flashcomm.scatter_gather import all_gather, psum_scatter
from jax_flashcomm.nn.attention import tp_attention  # noqa: E402  (nn imports the ops above)
from jax_flashcomm.rewrite import RewritePolicy, rewrite  # noqa: E402  (the function; its module is sys.modules["jax_flashcomm.rewrite"])
from jax_flashcomm.policy import CommPolicy, calibrate  # noqa: E402  (it imports the ops above)

__all__ = ["codec", "psum", "pmean", "psum_scatter", "all_gather", "all_to_all",
           "ragged_all_to_all", "all_gather_matmul",
           "matmul_reduce_scatter", "psum_add_rms_norm", "tp_attention", "CommConfig",
           "OPTION_NAMES", "Plan",
           "plan", "record", "RewritePolicy", "rewrite", "CommPolicy", "calibrate"]
__version__ = "0.1.0"
