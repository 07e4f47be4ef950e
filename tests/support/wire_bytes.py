"""Bytes each device sends per collective, counted from compiled HLO text (while-loop bodies
once per known trip count). Used by tests/codec/test_wire_bytes.py and
tests/benchmarks/test_ttft.py."""

import re

import numpy as np

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_OP = re.compile(r"=\s*(.*?)\s(all-to-all|all-gather|all-reduce|collective-permute|"
                 r"reduce-scatter)(-start)?\(")
_TYPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def _nbytes(types: str) -> int:
    total = 0
    for dtype, dims in _TYPE.findall(types):
        total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _runs_per_call(hlo: str) -> dict:
    """Computation name -> its instruction lines and how many times it runs per call of the
    program: a while body runs its loop's known trip count times its caller's count, every
    other computation once (a while loop without a known trip count fails the test)."""
    lines: dict = {}
    current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            lines[current] = []
        elif current is not None:
            lines[current].append(line)
    caller: dict = {}
    for name, body in lines.items():
        for line in body:
            w = _WHILE.search(line)
            if w:
                t = _TRIPS.search(line)
                assert t, f"while loop without a known trip count: {line.strip()[:160]}"
                caller[w.group(1)] = (name, int(t.group(1)))

    def runs(name, depth=0):
        assert depth < 64, "while loops nested too deep (a cycle?)"
        if name not in caller:
            return 1
        parent, trips = caller[name]
        return trips * runs(parent, depth + 1)

    return {name: (body, runs(name)) for name, body in lines.items()}


def wire_bytes(hlo: str, n: int) -> dict:
    """Bytes each device sends, per collective kind, from compiled HLO text.

    all-to-all: (N-1)/N of its operands (the own chunk stays); all-gather: its operand to N-1
    peers = (N-1)/N of the result; all-reduce: 2(N-1)/N of the operand (ring);
    reduce-scatter: (N-1)/N of the operand = (N-1) x result; collective-permute: the operand.
    A collective inside a while loop's body counts once per iteration (its known trip count).
    """
    sent: dict = {}
    for body, runs in _runs_per_call(hlo).values():
        for line in body:
            m = _OP.search(line)
            if not m:
                continue
            assert not m.group(3), f"async collective not handled: {line.strip()[:120]}"
            kind, result = m.group(2), _nbytes(m.group(1))
            factor = {"all-to-all": (n - 1) / n, "all-gather": (n - 1) / n,
                      "all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1,
                      "collective-permute": 1.0}[kind]
            sent[kind] = sent.get(kind, 0.0) + runs * factor * result
    return sent
