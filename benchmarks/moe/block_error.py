"""The accuracy cost of quantized expert-parallel communication, per format and direction.

At EP=4 (4 CPU devices, one process), bf16 weights and activations, top-2 of 8 experts:

* block: the relative RMS error of one random-weight MoE block (:func:`jax_flashcomm.nn.moe_block`,
  both dispatch modes) with the dispatch quantized (int8 / fp8 / int4) and the combine exact
  (bf16) or quantized (int8 / fp8), against the same block with both directions exact;
* model: a tiny random-weight MoE decoder (:func:`jax_flashcomm.nn.moe.moe_decoder_logits`,
  ragged dispatch, every MoE block with the setting's configs): the share of positions whose
  top-1 token equals the exact model's, and the relative RMS error of the logits.

``--trained`` measures a trained model instead: the byte-level MoE LM of
:mod:`benchmarks.moe.tiny_lm` (loaded from ``--params``, default
``~/.cache/jax_flashcomm/moe_tiny_lm.npz``, trained and saved first where missing), in bf16 at
EP=4 on evenly spaced windows of its held-out text, both dispatch modes (capacity at
``--capacity-factor``, 1.25 by default), dispatch int8 / fp8 / int4 and combine exact / int8 /
fp8: per setting, the share of positions whose top-1 byte equals the exact EP model's, the mean
KL divergence from the exact EP model's next-byte distribution, the logits' relative RMS error
and the cross-entropy of the held-out text; the first row of each mode is the exact EP model
against the f32 dense model.

``exact (bf16)`` moves the bf16 rows as they are; every quantized setting forces quantizing
(``min_bytes=0``) with the library's defaults for its bits (int8: groups of 128 with a Hadamard
rotation, fp8: e4m3 groups). Prints the tables; ``--out`` writes the JSON (with ``--trained``
also its page beside it). Re-run (~2 min on 2 cores; ``--trained`` ~2 min once trained, the
training ~8 min)::

    .venv/bin/python -m benchmarks.moe.block_error --out moe_block_error.json
    .venv/bin/python -m benchmarks.moe.block_error --trained --out docs/results/moe_top1.json
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
TRAINED = [(d, c) for d in ("int8", "fp8", "int4") for c in ("exact", "int8", "fp8")]


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


def ep_logits(mesh, params, ids, heads, dispatch="exact", combine="exact", **block):
    """f32 logits (numpy) of :func:`~jax_flashcomm.nn.moe.moe_decoder_logits` at EP=``N`` on
    ``mesh``: ``params`` global (without ``n_heads``), ``ids`` ``(B, S)`` split over the ranks,
    ``dispatch`` / ``combine`` names of :data:`FORMATS`, ``block`` :func:`moe_block`'s keywords
    (``top_k``, ``mode``...)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.nn import moe

    specs = moe.moe_decoder_specs(params)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    f = jax.jit(jax.shard_map(
        lambda p, i: moe.moe_decoder_logits(p, i, "ep", n_heads=heads, dispatch_config=_config(
            dispatch), combine_config=_config(combine), **block),
        mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
    return np.asarray(f(placed, jax.device_put(ids, NamedSharding(mesh, P("ep")))), np.float32)


def _log_softmax(x):
    import numpy as np

    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(y, ref, labels=None) -> dict:
    """How logits ``y`` compare with ``ref`` (both ``(..., vocab)``): the share of positions with
    the same top-1 token, the mean KL(ref || y) in bits, the relative RMS error, and with
    ``labels`` (``y``'s shape less the vocab) ``y``'s cross-entropy in bits per token."""
    import numpy as np

    lr, ly = _log_softmax(ref), _log_softmax(y)
    out = {"top-1 = exact": float(np.mean(np.argmax(y, -1) == np.argmax(ref, -1))),
           "KL bits": float(np.mean(np.sum(np.exp(lr) * (lr - ly), -1)) / np.log(2)),
           "logits rel RMS": _rel(y, ref)}
    if labels is not None:
        picked = np.take_along_axis(ly, np.asarray(labels)[..., None], -1)
        out["bits/byte"] = float(-np.mean(picked) / np.log(2))
    return out


def model_rows(mesh, args):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_flashcomm.nn import moe

    params = moe.moe_decoder_init(jax.random.key(2), vocab=args.vocab, d_model=args.d_model,
                                  n_layers=args.layers, n_experts=args.experts,
                                  ffn_dim=args.ffn, dtype=jnp.bfloat16)
    heads = params.pop("n_heads")
    ids = jax.random.randint(jax.random.key(3), (N * args.batch, args.seq), 0, args.vocab)
    exact = ep_logits(mesh, params, ids, heads, top_k=2, mode="ragged")
    f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    dense = np.asarray(moe.moe_decoder_logits(f32, ids, n_heads=heads, top_k=2))
    rows = [{"dispatch": "exact (bf16)", "combine": "exact (bf16)",
             "top-1 = exact": agreement(exact, dense)["top-1 = exact"],
             "logits rel RMS": _rel(exact, dense), "positions": int(ids.size),
             "against": "f32 dense model"}]
    for d, c in MODEL:
        y = ep_logits(mesh, params, ids, heads, d, c, top_k=2, mode="ragged")
        rows.append({"dispatch": d, "combine": c if c != "exact" else "exact (bf16)",
                     "top-1 = exact": agreement(y, exact)["top-1 = exact"],
                     "logits rel RMS": _rel(y, exact), "positions": int(ids.size),
                     "against": "exact EP model"})
    return rows


def trained_rows(mesh, args):
    """The trained byte-level MoE LM (:mod:`benchmarks.moe.tiny_lm`) in bf16 at EP=``N`` on
    ``args.windows`` held-out windows: per dispatch mode and :data:`TRAINED` setting, the
    logits against the exact EP model's (the first row of each mode: the exact EP model
    against the f32 dense model). Returns ``(rows, info)``, ``info`` the training's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.moe import tiny_lm
    from jax_flashcomm.nn import moe

    cfg = tiny_lm.MODEL
    params, info = tiny_lm.load_or_train(args.params)
    held = tiny_lm.split(tiny_lm.corpus_bytes())[1]
    win = tiny_lm.eval_windows(held, args.windows, cfg["context"] + 1)
    ids, labels = win[:, :-1], win[:, 1:]
    dense = np.asarray(jax.jit(lambda p, i: moe.moe_decoder_logits(
        p, i, n_heads=cfg["n_heads"], top_k=cfg["top_k"]))(params, ids))
    bf16 = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    top2 = np.sort(dense, -1)[..., -2:]
    info = {**info, "f32 dense": agreement(dense, dense, labels),
            "top-2 margin median": float(np.median(top2[..., 1] - top2[..., 0]))}
    rows = []
    for mode in args.modes:
        block = dict(top_k=cfg["top_k"], mode=mode, capacity_factor=args.capacity_factor)
        exact = ep_logits(mesh, bf16, ids, cfg["n_heads"], **block)
        rows.append({"mode": mode, "dispatch": "exact (bf16)", "combine": "exact (bf16)",
                     **agreement(exact, dense, labels), "against": "f32 dense model"})
        for d, c in TRAINED:
            y = ep_logits(mesh, bf16, ids, cfg["n_heads"], d, c, **block)
            rows.append({"mode": mode, "dispatch": d,
                         "combine": c if c != "exact" else "exact (bf16)",
                         **agreement(y, exact, labels), "against": "exact EP model"})
    return rows, info


def _cell(key, v):
    if "top-1" in key:
        return f"{100 * v:.2f}%"
    if "bits/byte" in key:
        return f"{v:.3f}"
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def _table(rows, keys):
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(k, r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _trained_report(rows, info, args, machine):
    from benchmarks.moe import tiny_lm

    cfg, meta = tiny_lm.MODEL, info["meta"]
    loss = [{"text": "train (first 90%)", "bits/byte": meta["train_bits_per_byte"]},
            {"text": "held out (last 10%)", "bits/byte": meta["held_out_bits_per_byte"]},
            {"text": "held out, unigram baseline", "bits/byte": meta["unigram_bits_per_byte"]},
            {"text": "measured windows, f32 dense", "bits/byte": info["f32 dense"]["bits/byte"]}]
    head = (f"Trained byte-level MoE LM ({cfg['n_layers']} layers, d={cfg['d_model']}, "
            f"{cfg['n_heads']} heads, top-{cfg['top_k']} of {cfg['n_experts']} experts of "
            f"width {cfg['ffn_dim']}, {info['train']['steps']} Adam steps of "
            f"{info['train']['batch']} x {cfg['context']} bytes, "
            f"{meta['train_seconds']:.0f} s), EP={N}, bf16, {args.windows} held-out windows "
            f"x {cfg['context']} = {args.windows * cfg['context']} positions; "
            f"median top-2 logit margin {info['top-2 margin median']:.2f}")
    keys = ["dispatch", "combine", "top-1 = exact", "KL bits", "logits rel RMS", "bits/byte",
            "against"]
    parts = [head, "", "Loss (bits per byte):", "", _table(loss, ["text", "bits/byte"])]
    for mode in args.modes:
        cf = f", capacity factor {args.capacity_factor}" if mode == "capacity" else ""
        parts += ["", f"Dispatch mode {mode}{cf}:", "",
                  _table([r for r in rows if r["mode"] == mode], keys)]
    return "\n".join(parts + ["", f"machine: {machine}"])


def _write_trained(path, rows, info, args, machine, tables):
    from benchmarks.shared.results import write_page

    argv = " ".join(a for a in sys.argv[1:] if not a.startswith("--params"))
    record = {"command": f"python -m {MODULE} {argv}".strip(), "cpu": cpu_name(),
              "machine": machine, "ep": N, "windows": args.windows, "modes": args.modes,
              "capacity_factor": args.capacity_factor, "training": info, "rows": rows}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    write_page(path, record, tables=tables.rsplit("\nmachine:", 1)[0])


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
    ap.add_argument("--trained", action="store_true",
                    help="measure the trained MoE LM of benchmarks.moe.tiny_lm instead")
    ap.add_argument("--params", default=None,
                    help="--trained: its parameters (.npz; trained and saved if missing)")
    ap.add_argument("--windows", type=int, default=64, help="--trained: held-out windows")
    ap.add_argument("--modes", nargs="+", default=["ragged", "capacity"],
                    help="--trained: dispatch modes")
    ap.add_argument("--capacity-factor", type=float, default=1.25,
                    help="--trained: the capacity mode's factor")
    ap.add_argument("--out", help="write the JSON record here (--trained: and its page)")
    args = ap.parse_args(argv)
    if "jax" in sys.modules:
        raise RuntimeError(f"{MODULE}: run it as a script (it sets the device count)")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={N}").strip()
    import jax

    mesh = jax.make_mesh((N,), ("ep",), devices=jax.devices()[:N])
    machine = f"{cpu_name()}, {os.cpu_count()} cores"
    if args.trained:
        from benchmarks.moe import tiny_lm

        args.params = args.params or tiny_lm.DEFAULT_PARAMS
        rows, info = trained_rows(mesh, args)
        tables = _trained_report(rows, info, args, machine)
        print(tables)
        if args.out:
            _write_trained(args.out, rows, info, args, machine, tables)
        return
    block = block_rows(mesh, args)
    model = model_rows(mesh, args)
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
