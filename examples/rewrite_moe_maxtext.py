"""MaxText's MoE layer (``maxtext.layers.moe.RoutedMoE``, expert parallelism) rewritten by
``jax_flashcomm.rewrite``: its all-to-alls found and replaced.

    bash examples/maxtext_install.sh     # MaxText 0.2.5 into ~/.cache/jax_flashcomm/maxtext-0.2.5
    .venv/bin/python examples/rewrite_moe_maxtext.py [--bits 8] [--tokens 32] [--json OUT]

(or ``bash examples/maxtext_install.sh DIR`` and ``PYTHONPATH=DIR`` for another folder). MaxText
is imported from there as installed, nothing of it is copied or edited; jax 0.10.2's missing
``jax.experimental.xla_metadata.must_fuse_call`` is stubbed as in ``maxtext_adopt.py``.

The layer is built MaxText's way (``pyconfig.initialize`` on configs/base.yml, its mesh, its
logical axis rules): ``decoder_block="mixtral"``, 4 experts, top-2, emb 128, mlp 256,
``ici_expert_parallelism=4`` on 4 host devices, ``sparse_matmul=True`` with ``megablox=False``
(``jax.lax.ragged_dot``), dropless (``capacity_factor=-1``), f32. Its ``sparse_matmul`` runs
the experts in a ``jax.shard_map`` over the expert axis: the routed tokens go to the ranks of
their experts with ``jax.lax.ragged_all_to_all`` and come back with another; the group sizes
are ``all_gather``-ed (integers). XLA:CPU does not implement ragged-all-to-all, so the layer as
written cannot run here. Rewritten, its ragged all-to-alls are jax_flashcomm's, which run on CPU
over the p2p exchange.

Checks: the report lists the layer's collectives; the rewritten layer with ``bits=None``
equals MaxText's own dense path of the same weights (``sparse_matmul=False``: every expert on
every token, weighted by the router, no communication) within f32 summation order, and a NumPy
evaluation of the routed experts, and so do its input gradients (through the rewritten
all-to-alls' VJPs); with ``--bits`` the quantized layer's error against it.
``--json OUT`` writes the report rows and the differences
(``tests/rewrite/test_rewrite_moe_maxtext.py`` runs the script so and checks them; it skips
when MaxText is not installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

_FLAG = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if not f.startswith(_FLAG)] + [f"{_FLAG}=4"])
SITE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                    "jax_flashcomm", "maxtext-0.2.5")    # examples/maxtext_install.sh's default
if os.path.isdir(SITE) and SITE not in sys.path:
    sys.path.append(SITE)

import jax  # noqa: E402
import jax.experimental.xla_metadata as xm  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_flashcomm as fc  # noqa: E402

if not hasattr(xm, "must_fuse_call"):        # jax 0.10.2 lacks it; only flash attention uses it
    xm.must_fuse_call = lambda *a, **k: (lambda f: f)

EXPERTS, TOP_K, EMB, MLP, EP = 4, 2, 128, 256, 4


def available() -> bool:
    """Whether MaxText can be imported (installed by examples/maxtext_install.sh)."""
    try:
        import maxtext.layers.moe  # noqa: F401
    except ImportError:
        return False
    return True


def build(tokens: int = 32, sparse: bool = True):
    """MaxText's RoutedMoE, its config and mesh: ``(layer, config, mesh)``."""
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.layers import moe
    from maxtext.layers.initializers import nd_dense_init
    from maxtext.utils import maxtext_utils

    config = pyconfig.initialize(
        ["", os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")],
        run_name="rewrite_moe", log_config=False, enable_checkpointing=False,
        skip_jax_distributed_system=True, base_output_directory=tempfile.gettempdir(),
        jax_cache_dir="", decoder_block="mixtral", num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, base_emb_dim=EMB, base_mlp_dim=MLP,
        base_moe_mlp_dim=MLP, base_num_decoder_layers=1, base_num_query_heads=4,
        base_num_kv_heads=4, head_dim=32,
        ici_expert_parallelism=EP, ici_fsdp_parallelism=1, megablox=False,
        sparse_matmul=sparse, capacity_factor=-1.0, per_device_batch_size=1,
        max_target_length=tokens, dtype="float32", weight_dtype="float32",
        float32_gate_logits=True, attention="dot_product")
    mesh = maxtext_utils.get_mesh_from_config(config)
    layer = moe.RoutedMoE(config=config, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                          mesh=mesh, kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
                          kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0), intermediate_dim=MLP,
                          dtype=jnp.float32, weight_dtype=jnp.float32)
    return layer, config, mesh


def forward(layer):
    """``f(params, x)``: the layer's output as a function of its weights and inputs."""
    from flax import nnx

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def f(params, x):
        return nnx.merge(graphdef, params, rest)(x)[0]
    return f, params


def numpy_reference(params, x):
    """The routed experts in NumPy: top-k of the gate logits, softmax over them (mixtral),
    ``silu(x @ wi_0) * (x @ wi_1) @ wo`` per expert, weighted."""
    gate = np.asarray(params["gate"]["kernel"][...], np.float64)
    wi0, wi1, wo = (np.asarray(params[k][...], np.float64) for k in ("wi_0", "wi_1", "wo"))
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    logits = xs @ gate
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
    chosen = np.take_along_axis(logits, top, -1)
    w = np.exp(chosen - chosen.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(xs)
    for k in range(TOP_K):
        for e in range(EXPERTS):
            rows = top[:, k] == e
            h = xs[rows] @ wi0[e]
            h = h / (1 + np.exp(-h)) * (xs[rows] @ wi1[e])
            out[rows] += w[rows, k, None] * (h @ wo[e])
    return out.reshape(x.shape)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bits", type=int, default=8, help="the quantized run's bits (0: none)")
    ap.add_argument("--tokens", type=int, default=32, help="sequence length (batch 4)")
    ap.add_argument("--json", help="write the report rows and the differences here")
    args = ap.parse_args(argv)
    if not available():
        sys.exit("MaxText is not importable: run `bash examples/maxtext_install.sh` first")
    from flax.core.spmd import logical_axis_rules

    layer, config, mesh = build(args.tokens)
    dense_layer, _, _ = build(args.tokens, sparse=False)
    f, params = forward(layer)
    dense, _ = forward(dense_layer)        # its graph, called with the sparse layer's weights
    x = jax.random.normal(jax.random.key(1), (4, args.tokens, EMB), jnp.float32)
    exact = fc.rewrite(f, fc.CommConfig(bits=None))
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            ("data", "fsdp", "expert"))))
        print("MaxText RoutedMoE (sparse_matmul, ragged_dot), EP=4, report of rewrite(f, "
              "CommConfig(bits=None)):")
        report = exact.report(params, x)
        print(report)
        try:
            jax.jit(f).lower(params, x).compile()
            print("\nthe layer as written compiles here")
        except Exception as e:                    # XLA:CPU: ragged-all-to-all unimplemented
            print(f"\nthe layer as written does not compile here: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]}")
        got = np.asarray(jax.jit(exact)(params, x))
        ref = np.asarray(jax.jit(dense)(params, x))     # the same weights, MaxText's dense path
        # gradients through the rewritten all-to-alls (MaxText's shard_map: check_vma=False)
        weight = jax.random.normal(jax.random.key(2), ref.shape, jnp.float32)
        grad_of = lambda fn: jax.jit(jax.grad(lambda p, v: jnp.sum(fn(p, v) * weight),  # noqa: E731
                                              argnums=1))
        g_exact = np.asarray(grad_of(exact)(params, x))
        g_dense = np.asarray(grad_of(dense)(params, x))
    want = numpy_reference(params, x)
    result = dict(rows={"exact": [dataclasses.asdict(r) for r in report]},
                  exact_vs_dense=float(np.max(np.abs(got - ref))),
                  exact_vs_numpy=float(np.max(np.abs(got - want))),
                  dense_vs_numpy=float(np.max(np.abs(ref - want))),
                  max_abs=float(np.max(np.abs(ref))),
                  grad_exact_vs_dense=float(np.max(np.abs(g_exact - g_dense))),
                  grad_max_abs=float(np.max(np.abs(g_dense))))
    print(f"\nrewritten, bits=None vs MaxText's dense path: max |diff| "
          f"{np.max(np.abs(got - ref)):.3g} (max |y| {np.max(np.abs(ref)):.3g}); vs NumPy "
          f"(f64): {np.max(np.abs(got - want)):.3g}; dense vs NumPy: "
          f"{np.max(np.abs(ref - want)):.3g}")
    print(f"d(sum(y * w))/dx, rewritten bits=None vs the dense path: max |diff| "
          f"{result['grad_exact_vs_dense']:.3g} (max |grad| {result['grad_max_abs']:.3g})")
    if args.bits:
        quant = fc.rewrite(f, fc.CommConfig(bits=args.bits, min_bytes=0))
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            print(f"\nreport of rewrite(f, CommConfig(bits={args.bits}, min_bytes=0)):")
            qreport = quant.report(params, x)
            print(qreport)
            q = np.asarray(jax.jit(quant)(params, x))
        rel = np.linalg.norm(q - got) / np.linalg.norm(got)
        result["rows"]["quantized"] = [dataclasses.asdict(r) for r in qreport]
        result.update(quantized_vs_exact=float(np.max(np.abs(q - got))),
                      quantized_rel_l2=float(rel))
        print(f"\nint{args.bits} vs bits=None: max |diff| {np.max(np.abs(q - got)):.3g}, "
              f"relative L2 {rel:.3g}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
