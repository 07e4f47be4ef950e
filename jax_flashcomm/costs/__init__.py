"""What a call costs: the cost model and this machine's measured table.

* the cost model (:mod:`._model`): a collective's seconds from a link (:class:`Link`), a codec
  speed (:class:`CpuCodec`, or a :class:`Gpu`) and the format's wire bytes;
* the measured table (:mod:`._table`): the timings ``python -m jax_flashcomm.tune`` wrote for
  this machine, kept in the user's cache, looked up per call (:func:`active`, :func:`use_table`,
  :meth:`Table.seconds`);
* the link profile between processes (:mod:`._link`: :func:`link_profile`, :func:`use_link`,
  ``FLASHCOMM_LINK``).

The planner (:mod:`jax_flashcomm.planner`) prices each transport's paths with them.
"""

from jax_flashcomm.costs import _link, _model, _table, _tpu
from jax_flashcomm.costs._link import *  # noqa: F403  (the names of its __all__)
from jax_flashcomm.costs._model import *  # noqa: F403  (the names of its __all__)
from jax_flashcomm.costs._table import *  # noqa: F403  (likewise)
from jax_flashcomm.costs._tpu import *  # noqa: F403  (likewise: the TPU profiles)

__all__ = [*_model.__all__, *_table.__all__, *_link.__all__, *_tpu.__all__]
