"""jax_flashcomm: faster tensor-parallel collectives for JAX.

Low-bit quantized collectives (Flash Communication, arXiv 2412.04964) and ring-decomposed
collective matmuls (Flash-Overlap, arXiv 2604.24013), as drop-ins for ``jax.lax``.
"""

from jax_flashcomm import codec
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.allreduce import pmean, psum
from jax_flashcomm.policy import CommConfig, Decision, record
from jax_flashcomm.scatter_gather import all_gather, psum_scatter

__all__ = ["codec", "all_gather_matmul", "matmul_reduce_scatter"]
__all__ += ["psum", "pmean", "psum_scatter", "all_gather", "CommConfig", "Decision", "record"]
__version__ = "0.1.0"
from jax_flashcomm.rewrite import RewritePolicy, rewrite  # noqa: E402  (jax_flashcomm.rewrite is the function; its module is sys.modules["jax_flashcomm.rewrite"])
