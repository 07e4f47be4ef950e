"""The link between processes the cost model prices.

It cannot be read off the machine: :func:`link_profile` gives it (set by :func:`use_link`, or
``FLASHCOMM_LINK="rate=400mbit,latency=0.2ms,topology=shared"``), and the choice prices peers in
other processes with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re

from jax_flashcomm.costs._model import Link

__all__ = ["LINK_ENV", "parse_link", "link_profile", "use_link"]

LINK_ENV = "FLASHCOMM_LINK"

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_link(text: str) -> Link:
    """A :class:`~jax_flashcomm.costs.Link` from ``"rate=400mbit,latency=0.2ms,
    topology=shared"`` (rate in tc units: ``bit`` or ``bps`` = bytes/s, k/m/g = 10^3/6/9;
    latency per collective in s, ms or us; topology shared or switched, default shared).

    Raises:
      ValueError: a malformed profile.
    """
    expected = f"{LINK_ENV}: expected rate=...[,latency=...][,topology=...], got {text!r}"
    fields: dict = {}
    for part in (p for p in str(text).split(",") if p.strip()):
        if "=" not in part:
            raise ValueError(f"{expected} ({part!r} has no '=')")
        name, value = (s.strip() for s in part.split("=", 1))
        if name in fields:
            raise ValueError(f"{expected} ({name!r} given twice)")
        fields[name] = value
    bad = set(fields) - {"rate", "latency", "topology"}
    if bad or "rate" not in fields:
        raise ValueError(expected)
    number = r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*"
    m = re.fullmatch(number + r"([kmg]?)(bit|bps)\s*", fields["rate"].lower())
    if not m or float(m[1]) <= 0:
        raise ValueError(f"{LINK_ENV}: not a positive rate: {fields['rate']!r} (e.g. 400mbit)")
    rate = float(m[1]) * _UNITS[m[2]] / (8 if m[3] == "bit" else 1)
    lat = 0.0
    if "latency" in fields:
        t = re.fullmatch(number + r"(s|ms|us)\s*", fields["latency"].lower())
        if not t:
            raise ValueError(f"{LINK_ENV}: not a latency: {fields['latency']!r} (e.g. 0.2ms)")
        lat = float(t[1]) * _TIME[t[2]]
    return Link(rate, fields.get("topology", "shared"), lat, 0.0)


_link: contextvars.ContextVar = contextvars.ContextVar("jax_flashcomm_link", default=None)


def link_profile() -> Link | None:
    """The link between processes the choice prices: :func:`use_link`'s, else
    ``FLASHCOMM_LINK``'s, else None (the library's default profile)."""
    link = _link.get()
    if link is None and os.environ.get(LINK_ENV):
        link = parse_link(os.environ[LINK_ENV])
    return link


@contextlib.contextmanager
def use_link(link: Link | None):
    """Inside the block (``with use_link(l):``), calls whose peers are other processes are
    priced on ``link``."""
    token = _link.set(link)
    try:
        yield link
    finally:
        _link.reset(token)
