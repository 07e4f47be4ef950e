"""What a run ran on, for the first line of its output and its JSON: the CPU model, its cores,
the vector features the kernel library sees, and the instruction-set build of the CPU codec
kernels in use (every speed figure depends on it: docs/benchmarks.md).

The models' CLIs print it, and the benchmarks import it from here (``benchmarks`` is a leaf
that nothing in ``models`` imports)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (:func:`jax_flashcomm.costs.cpu_name`)."""
    from jax_flashcomm.costs import cpu_name

    return cpu_name()


def describe() -> dict:
    """The machine as a dict: cpu, cores, features, isa (the build in use), isas (supported)."""
    info = {"cpu": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count()}
    try:
        from jax_flashcomm.codec import kernels

        if kernels.available("cpu"):
            info.update(isa=kernels.cpu_isa(), isas=kernels.cpu_isas(),
                        isa_chosen_by=kernels.isa_choice_made().get("how", ""),
                        features=kernels.cpu_features())
    except Exception as err:  # noqa: BLE001 - a report line must not fail the benchmark
        info["isa_error"] = str(err)
    return info


def first_line() -> str:
    """``CPU <model> (<cores> cores): kernels <isa> of [<isas>]; <features>``."""
    d = describe()
    isa = (f"CPU kernels {d['isa']} (builds this CPU runs: {', '.join(d['isas'])}; the "
           f"loader's: {d.get('isa_chosen_by') or 'n/a'}); "
           f"{d['features']}" if "isa" in d else "CPU kernels not built")
    return f"CPU {d['cpu']} ({d['cores']} cores, {d['machine']}): {isa}"
