"""The benchmarks: scripts run as modules from the repository root
(``.venv/bin/python -m benchmarks.codec.cpu_speed``), grouped by what they measure:
:mod:`benchmarks.codec`, :mod:`benchmarks.collectives`, :mod:`benchmarks.llm`,
:mod:`benchmarks.autotune`, :mod:`benchmarks.gpu`; :mod:`benchmarks.evidence` runs the ones
behind the README's headline table. A leaf of the repository: nothing in ``jax_flashcomm`` or
``models`` imports it. Helpers they share: :mod:`benchmarks.shared`."""
