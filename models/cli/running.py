"""How a model CLI runs: its ``main`` (:func:`run_main`), the one-line errors of what only the
run finds (:func:`run_checked`), and the devices, mesh and model its options imply
(:func:`setup`).

The device count must be set before JAX's backends start, so :func:`setup` sets it before it
builds anything (``jax_num_cpu_devices``).
"""

from __future__ import annotations

import argparse
import sys
import zipfile

from models.cli.checks import check

#: The errors a run meets in its inputs (CheckpointError, ChatTemplateError, a text too short,
#: FileNotFoundError, JSON and UTF-8 errors are subclasses): one line, exit status 2.
RUN_ERRORS = (ValueError, OSError, zipfile.BadZipFile)


def fail(parser: argparse.ArgumentParser, message) -> int:
    """Print ``<prog>: error: <message>`` (on one line) to stderr; return exit status 2."""
    text = " ".join(str(message).split()) or type(message).__name__
    print(f"{parser.prog}: error: {text}", file=sys.stderr, flush=True)
    return 2


def run_checked(parser: argparse.ArgumentParser, body, *args, **kwargs) -> int:
    """``body(*args, **kwargs)`` (an exit status); a :data:`RUN_ERRORS` error instead prints
    one ``<prog>: error: ...`` line and returns 2."""
    try:
        return body(*args, **kwargs)
    except RUN_ERRORS as e:
        sys.stdout.flush()
        return fail(parser, e)


def run_main(parser: argparse.ArgumentParser, body, argv=None) -> int:
    """A CLI's ``main``: parse ``argv``, :func:`~models.cli.check` the options, then
    ``body(args)`` under :func:`run_checked`.

    Returns:
      The exit status: ``body``'s, or 2 for an error of the run.
    """
    args = parser.parse_args(argv)
    check(parser, args)
    return run_checked(parser, body, args)


def set_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices (before JAX's backends start: the first jax.devices())."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backends already started
        raise RuntimeError(f"set_devices({n}) must run before JAX's backends start: {e}") from e


def setup(args):
    """``(model, checkpoint, mesh, comm)`` for the checked options: the devices, the mesh, the
    model (with ``--comm-policy``, each all-reduce set to its site's config; ``comm`` is the
    policy's default)."""
    from models.cli.settings import comm_from_args, load_policy

    set_devices(args.devices or args.tp)
    import jax
    import jax.numpy as jnp

    from models.llama.modeling import policy_comms, set_comm
    from models.llama.params import load_model

    comm = comm_from_args(args)
    if len(jax.devices()) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices, jax has {len(jax.devices())}")
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh, comm=comm, dtype=dtype)
    if getattr(args, "comm_policy", None) is not None:
        policy = getattr(args, "policy", None) or load_policy(args.comm_policy)
        comm, overrides = policy_comms(policy, ckpt.config.n_layers,
                                       fuse_norm=getattr(args, "fuse_norm", False))
        set_comm(model, comm, overrides=overrides)
    return model, ckpt, mesh, comm
