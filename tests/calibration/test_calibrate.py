"""jax_flashcomm.calibrate: the per-site choice from measured sensitivities, checked on
synthetic losses whose optimum is known."""

import io
import itertools
import math

import pytest

import jax_flashcomm as fc
from jax_flashcomm.policy._calibrate import select
from jax_flashcomm.policy._comm_policy import CommPolicy, wire_vs_bf16

NV = fc.CommConfig(format="nvfp4", min_bytes=0)                        # 0.297x
NV_FP8 = fc.CommConfig(bits=4, rs_format="nvfp4", ag_format="fp8", min_bytes=0)  # 0.402x
FP8 = fc.CommConfig(format="fp8", min_bytes=0)                          # 0.508x
CANDIDATES = [NV, NV_FP8, FP8]
#: per site, the loss each candidate adds alone (site "s3" is the sensitive one)
SENS = {"s0": [0.10, 0.04, 0.01], "s1": [0.12, 0.05, 0.01], "s2": [0.08, 0.02, 0.0],
        "s3": [2.00, 0.60, 0.05]}


def additive(scale=1.0, calls=None):
    def evaluate(assignment):
        if calls is not None:
            calls.append(dict(assignment))
        return scale * math.fsum(SENS[s][CANDIDATES.index(c)] for s, c in assignment.items())
    return evaluate


def brute_force(budget, max_wire=None):
    """The cheapest assignment (options 0..2 or exact, -1) whose additive loss is in budget."""
    best = None
    for choice in itertools.product([0, 1, 2, -1], repeat=len(SENS)):
        loss = math.fsum(SENS[s][k] for s, k in zip(SENS, choice) if k >= 0)
        wire = math.fsum(wire_vs_bf16(CANDIDATES[k]) if k >= 0 else 1.0 for k in choice) / 4
        if loss <= budget and (max_wire is None or wire <= max_wire + 1e-12):
            if best is None or wire < best[0] - 1e-12:
                best = (wire, choice)
    return best


@pytest.mark.parametrize("budget", [0.0, 0.1, 0.3, 0.5, 1.0, 3.0])
def test_additive_losses_give_the_cheapest_policy_in_budget(budget):
    calls = []
    policy = fc.calibrate(additive(calls=calls), list(SENS), CANDIDATES, budget=budget,
                          progress_out=None)
    assert isinstance(policy, CommPolicy)
    info = policy.info
    assert info["met"] and info["measured"] <= budget
    wire = policy.mean_wire_vs_bf16(SENS)
    assert wire == pytest.approx(info["mean_wire"])
    assert wire == pytest.approx(brute_force(budget)[0])
    # one evaluation per site and candidate, then one whole policy (the prediction is exact)
    assert len(calls) == len(SENS) * len(CANDIDATES) + 1
    assert all(len(a) == 1 for a in calls[:-1])
    assert info["sensitivity"]["s3"] == dict(zip(info["candidates"], SENS["s3"]))


def test_losses_larger_than_their_sum_shrink_the_target_until_in_budget():
    """The whole policy measures 1.8x the sum of its sites: the first pick misses the budget,
    the next rounds aim lower and land within it."""
    def evaluate(assignment):
        loss = additive()(assignment)
        return loss * (1.8 if len(assignment) > 1 else 1.0)

    policy = fc.calibrate(evaluate, list(SENS), CANDIDATES, budget=0.5, progress_out=None)
    rounds = policy.info["rounds"]
    assert len(rounds) >= 2 and rounds[0]["measured"] > 0.5
    assert policy.info["met"] and policy.info["measured"] <= 0.5
    assert rounds[-1]["target"] < rounds[0]["target"]


def test_a_wire_cap_that_the_budget_cannot_meet_returns_the_least_loss_under_the_cap():
    policy = fc.calibrate(additive(), list(SENS), CANDIDATES, budget=0.0, max_wire=0.35,
                          progress_out=None)
    assert not policy.info["met"]
    assert policy.mean_wire_vs_bf16(SENS) <= 0.35 + 1e-12
    # the cap buys the sensitive site first: s3 leaves nvfp4
    assert policy.config_for("s3") != NV


def test_select_never_takes_an_option_that_costs_more_and_loses_as_much():
    # option 1 costs more than option 0 and loses more: never chosen
    sens = [[0.5, 0.9, 0.0]]
    wires = [0.3, 0.4, 0.5]
    assert select(sens, wires, target=0.1) == [2]
    assert select(sens, wires, target=1.0) == [0]
    assert select(sens, wires, target=0.0, max_wire=0.45) == [0]


def test_progress_bar_counts_every_evaluation():
    out = io.StringIO()
    fc.calibrate(additive(), ["s0", "s1"], [NV, FP8], budget=1.0, progress_out=out, rounds=2)
    text = out.getvalue()
    assert "evaluations" in text and text.rstrip().split("\r")[-1].startswith("[" + "#" * 30)
    assert "6/6" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(sites=[]), "sites"), (dict(sites=["a", "a"]), "sites"),
    (dict(candidates=[]), "no candidate"),
    (dict(candidates=[fc.CommConfig(bits=None)]), "quantized"),
    (dict(candidates=[NV, NV]), "repeat"),
    (dict(budget=-1.0), "budget"), (dict(budget=float("nan")), "budget"),
    (dict(max_wire=0.0), "max_wire"), (dict(rounds=0), "rounds")])
def test_bad_arguments_raise(kwargs, match):
    args = dict(sites=["s0"], candidates=[NV], budget=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fc.calibrate(additive(), args.pop("sites"), args.pop("candidates"), progress_out=None,
                     **args)


def test_reused_sensitivities_measure_only_whole_policies():
    first = fc.calibrate(additive(), list(SENS), CANDIDATES, budget=0.3, progress_out=None)
    calls = []
    again = fc.calibrate(additive(calls=calls), list(SENS), CANDIDATES, budget=1.0,
                         sensitivity=first.info["sensitivity"], progress_out=None)
    assert all(len(a) > 1 or len(SENS) == 1 for a in calls) and len(calls) == 1
    assert again.info["sensitivity_reused"] and again.info["sensitivity"] == \
        first.info["sensitivity"]
    assert again.mean_wire_vs_bf16(SENS) == pytest.approx(brute_force(1.0)[0])
    with pytest.raises(ValueError, match="lacks"):
        fc.calibrate(additive(), list(SENS), [NV, FP8, fc.CommConfig(bits=6, min_bytes=0)],
                     budget=1.0, sensitivity=first.info["sensitivity"], progress_out=None)
