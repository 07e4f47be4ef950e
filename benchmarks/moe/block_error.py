"""The accuracy cost of quantized expert-parallel communication, per format and direction.

At EP=4 (4 CPU devices, one process), bf16 weights and activations, top-2 of 8 experts:

* block: the relative RMS error of one random-weight MoE block (:func:`jax_flashcomm.nn.moe_block`,
  both dispatch modes) with the dispatch quantized (int8 / fp8 / int4) and the combine exact
  (bf16) or quantized (int8 / fp8), against the same block with both directions exact;
* model: a tiny random-weight MoE decoder (:func:`jax_flashcomm.nn.moe.moe_decoder_logits`,
  ragged dispatch, every MoE block with the setting's configs): the share of positions whose
  top-1 token equals the exact model's, and the relative RMS error of the logits.

``exact (bf16)`` moves the bf16 rows as they are; every quantized setting forces quantizing
(``min_bytes=0``) with the library's defaults for its bits (int8: groups of 128 with a Hadamard
rotation, fp8: e4m3 groups). Prints the tables; ``--out`` writes the JSON. Re-run (~2 min on 2
cores)::

    .venv/bin/python -m benchmarks.moe.block_error --out moe_block_error.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

N = 4
MODULE = "benchmarks.moe.block_error"
FORMATS = {"exact": None, "int8": dict(bits=8), "fp8": dict(format="fp8"), "int4": dict(bits=4)}
BLOCK = [(d, c) for d in ("exact", "int8", "fp8", "int4") for c in ("exact", "int8", "fp8")
         if (d, c) != ("exact", "exact")]
MODEL = [("int8", "exact"), ("fp8", "exact"), ("int8", "int8"), ("fp8", "fp8"),
         ("int4", "exact")]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _config(name):
    import jax_flashcomm as fc

    return None if FORMATS[name] is None else fc.CommConfig(min_bytes=0, **FORMATS[name])


def _rel(y, ref):
    import numpy as np

    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)))


def block_rows(mesh, args):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from flax import nnx

    from jax_flashcomm import nn

    m = nn.EPMoE(args.d_model, args.ffn, args.experts, ep=N, dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(0))
    w = m.weights()
    specs = {k: P("ep") if k in ("gate_up", "down") else P() for k in w}
    w = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in w.items()}
    x = jax.random.normal(jax.random.key(1), (N * args.tokens, args.d_model), jnp.bfloat16)
    x = jax.device_put(x, NamedSharding(mesh, P("ep")))

    def run(mode, d, c):
        f = jax.jit(jax.shard_map(
            lambda w, x: nn.moe_block(w, x, "ep", top_k=2, mode=mode,
                                      capacity_factor=float(args.experts),
                                      dispatch_config=_config(d), combine_config=_config(c)),
            mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
        return f(w, x)

    exact = {mode: run(mode, "exact", "exact") for mode in nn.DISPATCH_MODES}
    f32 = nn.moe_reference({k: v.astype(jnp.float32) for k, v in m.weights().items()},
                           jnp.asarray(jax.device_get(x), jnp.float32), top_k=2)
    rows = [{"dispatch": "exact (bf16)", "combine": "exact (bf16)",
             **{f"{mode} rel RMS": _rel(exact[mode], f32) for mode in nn.DISPATCH_MODES},
             "against": "f32 dense reference"}]
    for d, c in BLOCK:
        rows.append({"dispatch": d, "combine": c if c != "exact" else "exact (bf16)",
                     **{f"{mode} rel RMS": _rel(run(mode, d, c), exact[mode])
                        for mode in nn.DISPATCH_MODES},
                     "against": "exact EP block"})
    return rows


def model_rows(mesh, args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.nn import moe

    params = moe.moe_decoder_init(jax.random.key(2), vocab=args.vocab, d_model=args.d_model,
                                  n_layers=args.layers, n_experts=args.experts,
                                  ffn_dim=args.ffn, dtype=jnp.bfloat16)
    heads = params.pop("n_heads")
    specs = moe.moe_decoder_specs(params)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    ids = jax.random.randint(jax.random.key(3), (N * args.batch, args.seq), 0, args.vocab)
    ids = jax.device_put(ids, NamedSharding(mesh, P("ep")))

    def logits(d, c):
        f = jax.jit(jax.shard_map(
            lambda p, i: moe.moe_decoder_logits(p, i, "ep", n_heads=heads, top_k=2,
                                                mode="ragged", dispatch_config=_config(d),
                                                combine_config=_config(c)),
            mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
        return np.asarray(f(placed, ids), np.float32)

    exact = logits("exact", "exact")
    top1 = exact.argmax(-1)
    f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    dense = np.asarray(moe.moe_decoder_logits(f32, jax.device_get(ids), n_heads=heads, top_k=2))
    rows = [{"dispatch": "exact (bf16)", "combine": "exact (bf16)",
             "top-1 = exact": float(np.mean(dense.argmax(-1) == top1)),
             "logits rel RMS": _rel(exact, dense), "positions": int(top1.size),
             "against": "f32 dense model"}]
    for d, c in MODEL:
        y = logits(d, c)
        rows.append({"dispatch": d, "combine": c if c != "exact" else "exact (bf16)",
                     "top-1 = exact": float(np.mean(y.argmax(-1) == top1)),
                     "logits rel RMS": _rel(y, exact), "positions": int(top1.size),
                     "against": "exact EP model"})
    return rows


def _table(rows, keys):
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.2e}" if isinstance(r[k], float) and "top-1" not in k
                 else f"{100 * r[k]:.2f}%" if "top-1" in k else str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (block)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=256, help="each expert's hidden width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (model)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", help="write the JSON record here")
    args = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError(f"{MODULE}: run it as a script (it sets the device count)")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={N}").strip()
    import jax

    mesh = jax.make_mesh((N,), ("ep",), devices=jax.devices()[:N])
    block = block_rows(mesh, args)
    model = model_rows(mesh, args)
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    print(f"MoE block, EP={N}, top-2 of {args.experts} experts, d={args.d_model}, "
          f"{args.tokens} tokens per rank, bf16")
    print(_table(block, ["dispatch", "combine", "ragged rel RMS", "capacity rel RMS",
                         "against"]))
    print(f"\nTiny MoE decoder ({args.layers} layers, d={args.d_model}, vocab {args.vocab}), "
          f"EP={N}, {N * args.batch} x {args.seq} positions, bf16, f32 logits")
    print(_table(model, ["dispatch", "combine", "top-1 = exact", "logits rel RMS", "against"]))
    print(f"\nmachine: {machine}")
    if args.out:
        record = {"command": f".venv/bin/python -m {MODULE}", "machine": machine,
                  "ep": N, "args": {k: v for k, v in vars(args).items() if k != "out"},
                  "block": block, "model": model}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
