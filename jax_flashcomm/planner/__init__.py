"""The path of every call, decided in one place.

:func:`plan` (:mod:`._plan`) turns a call (op, operand, axes, config) into a :class:`Plan`: the
size policy, the transport, the per-phase formats; under ``min_bytes="auto"`` it asks
:func:`choose` (:mod:`._choose`), which prices the call on every transport that can take it
(from the measured table or the cost model, :mod:`jax_flashcomm.costs`) and keeps the fastest.
:func:`record` collects the plans of a trace.
"""

from jax_flashcomm.planner._choose import (CANDIDATES, EXACT_PREFERENCE, STEP_EXACT_PREFERENCE,
                                           Call, Choice, Profile, choose, profile)
from jax_flashcomm.planner._plan import (OPS, PATHS, WEIGHED, Plan, as_plan, choice_bits, plan,
                                         quantized_plan, quantizes, record, record_plan,
                                         size_policy)

__all__ = ["Plan", "plan", "quantized_plan", "as_plan", "record", "record_plan", "size_policy",
           "quantizes", "choice_bits", "OPS", "PATHS", "WEIGHED", "Call", "Choice", "Profile",
           "choose", "profile", "CANDIDATES", "EXACT_PREFERENCE", "STEP_EXACT_PREFERENCE"]
