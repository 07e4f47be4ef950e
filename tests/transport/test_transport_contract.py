"""Every transport implements the one contract (jax_flashcomm.transport.base.Transport), and the
automatic choice's candidates are exactly each transport's exact and quantized paths."""

from __future__ import annotations

import inspect

import pytest

from jax_flashcomm import planner, transport
from jax_flashcomm.transport import base, registry

ABSTRACT = sorted(base.Transport.__abstractmethods__)


def test_the_contract_names_every_operation():
    assert set(ABSTRACT) >= {"link", "collective_reason", "ring_reason", "all_reduce",
                             "reduce_scatter", "all_gather", "exact_all_reduce", "ring_link"}


@pytest.mark.parametrize("t", transport.all_transports(), ids=lambda t: t.name)
def test_each_transport_implements_the_contract_with_its_signatures(t):
    assert isinstance(t, base.Transport)
    assert type(t).__abstractmethods__ == frozenset()
    for name in ABSTRACT:
        own = getattr(type(t), name)
        assert own is not getattr(base.Transport, name), f"{t.name} inherits {name}"
        assert (list(inspect.signature(own).parameters)
                == list(inspect.signature(getattr(base.Transport, name)).parameters)), name


def test_transports_by_name():
    names = [t.name for t in transport.all_transports()]
    assert names == list(registry.TRANSPORTS) == ["xla", "p2p", "pallas"]
    assert all(transport.by_name(n).name == n for n in names)
    assert set(names) == set(transport.TRANSPORTS) - {"auto"}
    with pytest.raises(ValueError, match="transport must be one of"):
        transport.by_name("nccl")


def test_the_candidates_are_every_transport_path_in_tie_break_order():
    got = [(c.transport.name, c.exact, c.name) for c in planner.CANDIDATES]
    assert got == [("xla", True, "lax"), ("p2p", True, "exact/p2p"),
                   ("p2p", False, "quantized/p2p"), ("pallas", False, "quantized/pallas"),
                   ("xla", False, "quantized/xla")]


CALL = dict(op="psum", nbytes=1 << 20, itemsize=4, dtype="float32", n=3, platform="cpu",
            group_size=128, spikes=0)


@pytest.mark.parametrize("layout", ["in-process", "processes"])
def test_each_transport_prices_both_paths_over_its_own_link(layout):
    call = transport.Call(layout=layout, p2p_reason=None, bits=(8, 8), **CALL)
    prof = planner.profile(call, None)
    for cand in planner.CANDIDATES:
        link = cand.transport.link(call, None)
        assert prof.links[cand.transport.name] == link
        seconds = cand.model_s(call, prof)
        assert seconds > 0 and seconds == cand.transport.model_s(
            call, cand.exact, link, prof.codec.codec_pass_s)
    # the two transports' links differ: each has its own profile
    assert prof.links["xla"] != prof.links["p2p"]


def test_why_not_comes_from_the_transport():
    call = transport.Call(layout="in-process", p2p_reason="no kernels", bits=None,
                          exact_p2p_reason="no exact kernels", **CALL)
    reasons = {c.name: c.unavailable(call) for c in planner.CANDIDATES}
    assert reasons == {"lax": None,
                       "exact/p2p": "no exact kernels",
                       "quantized/p2p": "bits=None (exact setting)",
                       "quantized/pallas": "bits=None (exact setting)",
                       "quantized/xla": "bits=None (exact setting)"}
