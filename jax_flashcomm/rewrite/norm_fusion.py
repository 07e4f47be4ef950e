"""The norm fusion pass: ``psum -> add -> RMSNorm`` chains of one jaxpr become one
:func:`~jax_flashcomm.psum_add_rms_norm`.

The chain matched is the one ``residual + lax.psum(x)`` followed by the RMSNorm expression of
:class:`jax_flashcomm.nn.RMSNorm` (and of ``models/llama/modeling.py``, the JAX docs' and most Flax
models'), as JAX traces it::

    h = add residual s                 # s = psum(x); either operand order
    [h32 = convert_element_type h]     # bf16 / f16 activations
    q = mul h32 h32                    # or integer_pow(h32, 2), square(h32)
    m = reduce_sum q (last axis)
    [broadcast_in_dim / reshape]       # keepdims, before or after the division
    m = div m D                        # the mean over the hidden size D
    e = add m eps                      # eps a literal scalar
    r = rsqrt e
    n = mul h32 r
    o = mul n w'                       # w' = the (D,) weight, through convert / broadcast
    [out = convert_element_type o]

Every intermediate has one use; ``h`` may be used elsewhere (it is the new residual), but only
after the norm's last equation, where the fused op is emitted. Anything else is left unfused,
with the condition that failed in the report.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_flashcomm.jax_compat import core

__all__ = ["NormFusion", "match_psum_norm"]

_SHAPE_OPS = ("broadcast_in_dim", "reshape")


@dataclasses.dataclass(frozen=True)
class NormFusion:
    """One fused chain.

    Attributes:
      psum: the psum equation's index.
      last: the norm's last equation (where the fused op is emitted).
      eqns: every equation of the chain but the psum.
      residual: the residual atom; weight: the norm weight's atom; eps: its epsilon.
      new_residual: the add's output var; out: the norm's output var.
    """

    psum: int
    last: int
    eqns: tuple
    residual: object
    weight: object
    eps: float
    new_residual: object
    out: object


def _literal(atom):
    return atom.val if isinstance(atom, core.Literal) else None


class _Walk:
    """Follows single-use chains forward from a variable."""

    def __init__(self, jaxpr, users):
        self.jaxpr, self.users, self.eqns = jaxpr, users, []

    def only_user(self, var):
        found = list(dict.fromkeys(self.users.get(var, [])))
        if len(found) != 1 or found[0] is None:
            return None
        return found[0]

    def next(self, var, names, skip=()):
        """The single user of ``var`` (through ``skip`` ops) if its primitive is in ``names``."""
        k = self.only_user(var)
        while k is not None and self.jaxpr.eqns[k].primitive.name in skip:
            self.eqns.append(k)
            var = self.jaxpr.eqns[k].outvars[0]
            k = self.only_user(var)
        if k is None or self.jaxpr.eqns[k].primitive.name not in names:
            return None
        self.eqns.append(k)
        return k


def _weight_source(jaxpr, producer, var, hidden):
    """The (hidden,) array ``var`` is broadcast / converted from, or None."""
    while True:
        if var.aval.shape == (hidden,):
            return var
        k = producer.get(var)
        if k is None or jaxpr.eqns[k].primitive.name not in (*_SHAPE_OPS,
                                                              "convert_element_type"):
            return None
        var = jaxpr.eqns[k].invars[0]


def match_psum_norm(jaxpr, index: int, users: dict, producer: dict
                    ) -> tuple[NormFusion | None, str]:
    # long function: the pattern, one check per step of the RMSNorm it matches
    """The fusion of the psum equation ``index`` with the residual add and RMSNorm after it.

    Args:
      jaxpr: the jaxpr holding them.
      index: the psum's index.
      users: ``{var: [indices of the equations reading it]}`` (None: a jaxpr output).
      producer: ``{var: index of the equation computing it}``.

    Returns:
      ``(fusion, "")``, or ``(None, reason)`` naming the condition that failed.
    """
    eqns, walk = jaxpr.eqns, _Walk(jaxpr, users)
    s = eqns[index].outvars[0]
    a = walk.next(s, ("add",))
    if a is None:
        return None, "the sum's one use is not an add"
    add = eqns[a]
    residual = add.invars[1] if add.invars[0] is s else add.invars[0]
    if (not isinstance(residual, core.Var) or residual.aval.shape != s.aval.shape
            or residual.aval.dtype != s.aval.dtype):
        return None, "the add's other operand is not a residual of the sum's shape and dtype"
    h = add.outvars[0]
    hidden = h.aval.shape[-1] if h.aval.ndim else 0
    h_users = [u for u in dict.fromkeys(users.get(h, [])) if u is not None]
    h32 = h
    cast = [u for u in h_users if eqns[u].primitive.name == "convert_element_type"
            and eqns[u].params["new_dtype"] == np.float32]
    square = [u for u in h_users if _is_square(eqns[u], h)]
    if not square and len(cast) == 1:
        h32 = eqns[cast[0]].outvars[0]
        walk.eqns.append(cast[0])
        square = [u for u in dict.fromkeys(users.get(h32, []))
                  if u is not None and _is_square(eqns[u], h32)]
    if h32.aval.dtype != np.float32 or len(square) != 1:
        return None, "the sum plus residual is not squared in f32 (no RMSNorm after it)"
    walk.eqns.append(square[0])
    if walk.next(eqns[square[0]].outvars[0], ("reduce_sum",)) is None:
        return None, "not an RMSNorm: the square is not summed"
    red = eqns[walk.eqns[-1]]
    if tuple(red.params["axes"]) != (h32.aval.ndim - 1,):
        return None, "not an RMSNorm: the sum is not over the last axis"
    k = walk.next(red.outvars[0], ("div",), skip=_SHAPE_OPS)
    if k is None or _literal(eqns[k].invars[1]) is None or float(
            _literal(eqns[k].invars[1])) != float(hidden):
        return None, "not an RMSNorm: the sum of squares is not divided by the hidden size"
    k = walk.next(eqns[k].outvars[0], ("add",), skip=_SHAPE_OPS)
    eps = _literal(eqns[k].invars[1]) if k is not None else None
    if eps is None or np.ndim(eps) != 0:
        return None, "not an RMSNorm: no literal epsilon added to the mean square"
    k = walk.next(eqns[k].outvars[0], ("rsqrt",))
    if k is None:
        return None, "not an RMSNorm: no rsqrt of the mean square"
    k = walk.next(eqns[k].outvars[0], ("mul",), skip=_SHAPE_OPS)
    if k is None or h32 not in eqns[k].invars:
        return None, "not an RMSNorm: the rsqrt does not scale the sum plus residual"
    k = walk.next(eqns[k].outvars[0], ("mul",))
    if k is None:
        return None, "not an RMSNorm: no weight multiplies the normalised rows"
    mul_w = eqns[k]
    scale = mul_w.invars[1] if mul_w.invars[0] is eqns[walk.eqns[-2]].outvars[0] else \
        mul_w.invars[0]
    weight = _weight_source(jaxpr, producer, scale, hidden) if isinstance(scale,
                                                                           core.Var) else None
    if weight is None or np.dtype(weight.aval.dtype) not in (np.dtype(np.float32),
                                                             np.dtype("bfloat16")):
        return None, "the norm's weight is not an f32 or bf16 (hidden,) array"
    out = mul_w.outvars[0]
    back = walk.only_user(out)
    if (h32 is not h and back is not None
            and eqns[back].primitive.name == "convert_element_type"
            and eqns[back].params["new_dtype"] == h.aval.dtype):
        walk.eqns.append(back)
        out = eqns[back].outvars[0]
    if out.aval.dtype != h.aval.dtype:
        return None, "the norm's output is not cast back to the activations' dtype"
    last = walk.eqns[-1]
    if any(u <= last for u in h_users if u not in walk.eqns):
        return None, "the sum plus residual is used before the norm ends"
    chain = tuple(sorted({a, *walk.eqns}))
    return NormFusion(index, last, chain, residual, weight, float(eps), h, out), ""


def _is_square(eqn, var) -> bool:
    name = eqn.primitive.name
    if name == "mul":
        return eqn.invars[0] is var and eqn.invars[1] is var
    if name == "integer_pow":
        return eqn.invars[0] is var and eqn.params["y"] == 2
    return name == "square" and eqn.invars[0] is var
