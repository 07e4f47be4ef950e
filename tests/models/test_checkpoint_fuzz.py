"""A mutation fuzzer for the checkpoint readers (issue 38).

A small mixed-type GGUF (F32 norms, F16 embedding, Q8_0 attention, Q4_1 MLP, two metadata
arrays) and a small two-shard safetensors directory (F32 / F16 / BF16, index, config.json) are
written here; each case applies a random mutation (bytes, a metadata / config field, a tensor's
offset / type / dimensions / rank, a count or length, the index, truncation, the data) and
opens the mutant with :func:`models.checkpoints.open_checkpoint`, reading every tensor. Every
mutant must either raise :class:`CheckpointError` or load so that, tensor by tensor, what it
returns is what an independent decode of the mutant's bytes gives, and that equals the
original's unless the mutation changed that tensor's data bytes or its type to another of the
same byte size (F16 <-> BF16, Q4_0 <-> IQ4_NL): neither format has a checksum, so such a file
is a well-formed different checkpoint (the fetch cache's sha256 is what guards the bytes of a
known model). A loaded config may differ from the original's only in range (LlamaConfig checks
it): never NaN, never a tensor read with other hyper-parameters. Any other exception, a
NaN / inf weight or a tensor that differs otherwise fails the case.

Cases: ``CHECKPOINT_FUZZ_CASES`` (default 320, half per format, in 8 chunks that pytest-xdist
spreads), seed ``CHECKPOINT_FUZZ_SEED`` (default 38): numpy ``RandomState``, so a CI run is the
same every time. ``CHECKPOINT_FUZZ_REPORT=path`` writes the outcome counts as JSON.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import struct
import time

import numpy as np
import pytest

from tests.support.checkpoint_files import gguf_map, write_gguf, write_hf
from tests.support.checkpoint_mutants import (SHARDS, check_gguf_mutant, check_hf_mutant,
                                              hf_dtypes, mutate_gguf, mutate_hf)

N_CASES = int(os.environ.get("CHECKPOINT_FUZZ_CASES", "320"))
SEED = int(os.environ.get("CHECKPOINT_FUZZ_SEED", "38"))
CHUNKS = 4  # per format
REPORT = os.environ.get("CHECKPOINT_FUZZ_REPORT")

@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "seed.gguf"
    stored = write_gguf(path)
    data = path.read_bytes()
    return data, gguf_map(data), stored


@pytest.fixture(scope="module")
def hf_seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz") / "seed_hf"
    stored = write_hf(d, shards=2, dtypes=hf_dtypes)
    return d, {s: (d / s).read_bytes() for s in SHARDS}, stored


# -- the fuzz loop ----------------------------------------------------------------------------


def _run(fmt, chunk, make_case, n):
    rs = np.random.RandomState([SEED, chunk, 0 if fmt == "gguf" else 1])
    counts = collections.Counter()
    failures = []
    t0 = time.perf_counter()
    for case in range(n):
        try:
            what, outcome = make_case(rs, case)
        except Exception as e:  # noqa: BLE001 - a crash or a wrong load: report every one
            what = getattr(e, "what", "?")
            failures.append(f"{fmt} seed={SEED} chunk={chunk} case={case}: {what}: "
                            f"{type(e).__name__}: {str(e)[:300]}")
            continue
        counts[(what.split(" ")[0], outcome)] += 1
    elapsed = time.perf_counter() - t0
    summary = collections.Counter()
    for (_, outcome), k in counts.items():
        summary[outcome] += k
    print(f"\n{fmt} chunk {chunk}: {n} cases in {elapsed:.2f} s: {dict(summary)}")
    if REPORT:
        with open(f"{REPORT}.{fmt}.{chunk}.json", "w") as f:
            json.dump({"fmt": fmt, "chunk": chunk, "cases": n, "seconds": elapsed,
                       "outcomes": dict(summary), "failures": failures,
                       "by_op": {f"{op}: {out}": k for (op, out), k in sorted(counts.items())}},
                      f, indent=1)
    assert not failures, "\n".join(failures[:20])


def _per_chunk(chunk):
    half = N_CASES // 2
    return half // CHUNKS + (1 if chunk < half % CHUNKS else 0)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzz_gguf(tmp_path, gguf_seed, chunk):
    data, m, stored = gguf_seed
    path = tmp_path / "mutant.gguf"

    def case(rs, i):
        mutant, what = mutate_gguf(rs, data, m)
        try:
            return what, check_gguf_mutant(path, data, m, stored, mutant)
        except Exception as e:
            e.what = what
            raise

    _run("gguf", chunk, case, _per_chunk(chunk))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fuzz_safetensors(tmp_path, hf_seed, chunk):
    seed_dir, pristine, stored = hf_seed

    def case(rs, i):
        d = tmp_path / f"m{i}"
        shutil.copytree(seed_dir, d)
        what = mutate_hf(rs, d)
        try:
            return what, check_hf_mutant(d, pristine, stored)
        except Exception as e:
            e.what = what
            raise
        finally:
            shutil.rmtree(d, ignore_errors=True)

    _run("safetensors", chunk, case, _per_chunk(chunk))
