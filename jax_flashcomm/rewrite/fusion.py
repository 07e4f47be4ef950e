"""The matmul fusion pass: which all-gather -> dot and dot -> reduce-scatter pairs of one jaxpr
become :func:`~jax_flashcomm.all_gather_matmul` / :func:`~jax_flashcomm.matmul_reduce_scatter`.

A pair is fused only when the ring op computes exactly what the pair did:

* ``g = all_gather(x, ax, axis=a, tiled=True); y = dot_general(g, w)``: ``g`` is used by that
  dot only, as its left operand; the dot contracts ``g``'s last dimension with ``w``'s first,
  has no batch dimensions, ``w`` is 2-D, ``a`` is not the contracted dimension, and the dot
  keeps the (floating) dtype of both operands with default precision.
* ``z = dot_general(x, w); psum_scatter(z, ax, scatter_dimension=a, tiled=True)`` (through the
  ``pvary`` lax may insert): the same dot conditions, ``z`` used by the reduce-scatter only, and
  ``a`` one of ``x``'s row dimensions. There is no quantized reduce-scatter ring (it would
  re-quantize the running sum N-1 times), so a pair whose reduce-scatter the size policy would
  quantize is left unfused and the reduce-scatter quantized.

Anything else is left unfused, and the report says which condition failed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["MatmulFusion", "match_gather_dot", "match_dot_scatter", "dot_problem",
           "gathered_dot"]


@dataclasses.dataclass(frozen=True)
class MatmulFusion:
    """One fused pair.

    Attributes:
      kind: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
      collective: the collective's equation index.
      dot: the dot's equation index.
      collective_eqn: the collective's equation.
      x, w: the ring op's operands (jaxpr atoms).
      axis: its row axis.
    """

    kind: str
    collective: int
    dot: int
    collective_eqn: object
    x: object
    w: object
    axis: int


def dot_problem(dot, lhs_var) -> str | None:
    """Why ``dot`` (a dot_general eqn) is not ``lhs @ w`` in the ring ops' form, or None."""
    lhs, rhs = dot.invars
    if lhs is not lhs_var:
        return "the collective's value is not the dot's left operand"
    if rhs is lhs_var:
        return "the dot multiplies the value by itself"
    la, ra, oa = lhs.aval, rhs.aval, dot.outvars[0].aval
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    if lb or rb:
        return "the dot has batch dimensions"
    if ra.ndim != 2:
        return f"the dot's right operand is {ra.ndim}-D, not 2-D"
    if tuple(lc) != (la.ndim - 1,) or tuple(rc) != (0,):
        return "the dot does not contract the last dimension with the weight's first"
    if dot.params.get("precision") is not None:
        return "the dot sets a precision"
    if not (la.dtype == ra.dtype == oa.dtype) or not np.issubdtype(la.dtype, np.floating):
        return (f"the dot's dtypes {la.dtype} @ {ra.dtype} -> {oa.dtype} are not one floating "
                f"dtype")
    return None


def match_gather_dot(jaxpr, index: int, operand, users: dict
                     ) -> tuple[MatmulFusion | None, str]:
    """The fusion of an all-gather equation with the dot consuming it, or None and why.

    Args:
      jaxpr: the jaxpr holding both equations.
      index: the all-gather equation's index.
      operand: its operand, looked through pvary.
      users: ``{var: [indices of the equations reading it]}`` (None: a jaxpr output).

    Returns:
      ``(fusion, "")``, or ``(None, reason)`` naming the condition that failed.
    """
    eqn = jaxpr.eqns[index]
    if not eqn.params["tiled"]:
        return None, "not fused: tiled=False (stacked) all_gather"
    axis = eqn.params["all_gather_dimension"]
    k, why = gathered_dot(jaxpr, eqn.outvars[0], axis, users)
    if k is None:
        return None, why
    return MatmulFusion("all_gather_matmul", index, k, eqn, operand, jaxpr.eqns[k].invars[1],
                        axis), ""


def gathered_dot(jaxpr, out, axis: int, users: dict) -> tuple[int | None, str]:
    """The index of the one dot that consumes the gathered value ``out`` in the ring op's form
    (gathered along ``axis``), or None and the reason."""
    consumers = users.get(out, [])
    if len(consumers) != 1 or consumers[0] is None:
        return None, "not fused: the gathered value has other uses than one dot"
    k = consumers[0]
    dot = jaxpr.eqns[k]
    if dot.primitive.name != "dot_general":
        return None, f"not fused: the gathered value feeds {dot.primitive.name}, not a dot"
    problem = dot_problem(dot, out)
    if problem:
        return None, f"not fused: {problem}"
    if axis == out.aval.ndim - 1:
        return None, "not fused: the gather axis is the contracted dimension"
    return k, ""


def match_dot_scatter(jaxpr, index: int, operand, producer: dict, users: dict
                      ) -> tuple[MatmulFusion | None, str]:
    """The fusion of a reduce-scatter equation with the dot producing it, or None and why.

    Args:
      jaxpr: the jaxpr holding both equations.
      index: the reduce-scatter equation's index.
      operand: its operand, looked through pvary.
      producer: ``{var: index of the equation computing it}``.
      users: ``{var: [indices of the equations reading it]}``.

    Returns:
      ``(fusion, "")``, or ``(None, reason)`` naming the condition that failed.
    """
    eqn = jaxpr.eqns[index]
    if not eqn.params["tiled"]:
        return None, "not fused: tiled=False psum_scatter"
    k = producer.get(operand)
    if k is None or jaxpr.eqns[k].primitive.name != "dot_general":
        return None, "not fused: the operand is not computed by a dot in the same body"
    dot = jaxpr.eqns[k]
    if len(users.get(operand, [])) != 1:
        return None, "not fused: the dot's result has other uses"
    problem = dot_problem(dot, dot.invars[0])
    if problem:
        return None, f"not fused: {problem}"
    axis = eqn.params["scatter_dimension"]
    if axis >= dot.invars[0].aval.ndim - 1:
        return None, "not fused: the scatter dimension is the weight's column dimension"
    return MatmulFusion("matmul_reduce_scatter", index, k, eqn, dot.invars[0], dot.invars[1],
                        axis), ""
