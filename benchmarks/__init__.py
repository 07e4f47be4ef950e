"""The benchmarks: scripts run as modules from the repository root
(``.venv/bin/python -m benchmarks.codec``). A leaf of the repository: nothing in
``jax_flashcomm`` or ``models`` imports it. Helpers they share: :mod:`benchmarks.common`."""
