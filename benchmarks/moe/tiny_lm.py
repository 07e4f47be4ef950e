"""A small MoE language model trained on real text, for measuring what quantized expert-parallel
communication does to a trained model's next-token choice.

The model is :func:`jax_flashcomm.nn.moe.moe_decoder_init`'s decoder (embedding, blocks of
RMSNorm, causal attention, RMSNorm, MoE of SwiGLU experts with top-k routing, tied logits) as a
byte-level language model (vocabulary 256: the UTF-8 bytes). It trains densely
(:func:`jax_flashcomm.nn.moe.moe_reference` in every block, ``axis_name=None``) in f32 with Adam
(written here in ``jnp``: global-norm clipping, linear warm-up, cosine decay) on the
``pydoc-topics`` text of :mod:`models.corpus` (the Python Language Reference's prose, ~285 000
bytes): the first 90% of its bytes train, the last 10% are held out. Random windows of
``context + 1`` bytes make each batch; the loss is the mean next-byte cross-entropy.

The parameters are saved as one ``.npz`` (with the model and training settings, which a load
checks). Train and save (about 7 minutes on 2 busy cores)::

    .venv/bin/python -m benchmarks.moe.tiny_lm --params ~/.cache/jax_flashcomm/moe_tiny_lm.npz

:mod:`benchmarks.moe.block_error` ``--trained`` loads them (training them first where the file
is missing or was trained with other settings).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

__all__ = ["MODEL", "TRAIN", "DEFAULT_PARAMS", "corpus_bytes", "split", "eval_windows",
           "init", "loss", "train", "bits_per_byte", "unigram_bits", "save", "load",
           "load_or_train"]

#: The model: :func:`~jax_flashcomm.nn.moe.moe_decoder_init`'s keywords, ``top_k`` and the
#: context (bytes a window predicts).
MODEL = dict(vocab=256, d_model=256, n_layers=4, n_heads=4, n_experts=8, ffn_dim=128,
             top_k=2, context=128)
#: The training: Adam steps, windows per batch, peak learning rate, warm-up steps, seed.
TRAIN = dict(steps=500, batch=16, lr=3e-3, warmup=40, clip=1.0, seed=0)
#: Where the parameters are kept by default (outside the repository).
DEFAULT_PARAMS = "~/.cache/jax_flashcomm/moe_tiny_lm.npz"
HELD_OUT = 0.1
LN2 = math.log(2)


def corpus_bytes(name: str | None = None) -> np.ndarray:
    """The UTF-8 bytes of :func:`models.corpus.load_text` (``uint8``)."""
    from models.corpus import load_text

    return np.frombuffer(load_text(name).encode("utf-8"), np.uint8)


def split(data: np.ndarray, held_out: float = HELD_OUT):
    """``(train, held)``: the first ``1 - held_out`` of ``data`` and the rest."""
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


def eval_windows(data: np.ndarray, n: int, length: int) -> np.ndarray:
    """``(n, length)`` int32: ``n`` evenly spaced windows of ``data`` (disjoint where it is
    long enough)."""
    starts = np.linspace(0, len(data) - length, n).astype(np.int64)
    return np.stack([data[s:s + length] for s in starts]).astype(np.int32)


def init(model: dict = MODEL, seed: int = 0):
    """``(params, n_heads)``: f32 random weights of ``model`` (``n_heads`` taken out)."""
    import jax

    from jax_flashcomm.nn import moe

    keys = ("vocab", "d_model", "n_layers", "n_heads", "n_experts", "ffn_dim")
    params = moe.moe_decoder_init(jax.random.key(seed), **{k: model[k] for k in keys})
    return params, params.pop("n_heads")


def loss(params, ids, model: dict = MODEL):
    """The mean next-byte cross-entropy (nats) of the dense model on ``ids`` ``(B, S + 1)``."""
    import jax
    import jax.numpy as jnp

    from jax_flashcomm.nn import moe

    logits = moe.moe_decoder_logits(params, ids[:, :-1], n_heads=model["n_heads"],
                                    top_k=model["top_k"])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def _adam_step(model, train_cfg):
    import jax
    import jax.numpy as jnp

    b1, b2, eps = 0.9, 0.95, 1e-8
    steps, warmup, peak = train_cfg["steps"], train_cfg["warmup"], train_cfg["lr"]

    def lr_at(t):
        warm = peak * (t + 1) / warmup
        cos = 0.5 * peak * (1 + jnp.cos(jnp.pi * (t - warmup) / max(1, steps - warmup)))
        return jnp.where(t < warmup, warm, 0.1 * peak + 0.9 * cos)

    @jax.jit
    def step(params, m, v, t, ids):
        value, grads = jax.value_and_grad(loss)(params, ids, model)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, train_cfg["clip"] / norm), grads)
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        tf = t.astype(jnp.float32) + 1
        lr = lr_at(t) * jnp.sqrt(1 - b2 ** tf) / (1 - b1 ** tf)
        params = jax.tree.map(lambda p, a, b: p - lr * a / (jnp.sqrt(b) + eps), params, m, v)
        return params, m, v, value

    return step


def train(model: dict = MODEL, train_cfg: dict = TRAIN, data: np.ndarray | None = None,
          log=print):
    """Train the dense model on ``data`` (default: :func:`corpus_bytes`'s training split).

    Returns:
      ``(params, history)``: the f32 parameters (without ``n_heads``) and the loss (nats) of
      every step.
    """
    import jax
    import jax.numpy as jnp

    if data is None:
        data = split(corpus_bytes())[0]
    params, _ = init(model, train_cfg["seed"])
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    step = _adam_step(model, train_cfg)
    rng = np.random.default_rng(train_cfg["seed"])
    length = model["context"] + 1
    history, start = [], time.perf_counter()
    for t in range(train_cfg["steps"]):
        starts = rng.integers(0, len(data) - length, train_cfg["batch"])
        ids = jnp.asarray(np.stack([data[s:s + length] for s in starts]).astype(np.int32))
        params, m, v, value = step(params, m, v, jnp.int32(t), ids)
        history.append(float(value))
        if log and (t % 50 == 0 or t == train_cfg["steps"] - 1):
            log(f"step {t:4d}  loss {history[-1] / LN2:.3f} bits/byte  "
                f"{time.perf_counter() - start:.0f} s")
    return params, history


def bits_per_byte(params, data: np.ndarray, model: dict = MODEL, windows: int = 64) -> float:
    """The dense model's mean next-byte cross-entropy in bits on ``windows`` evenly spaced
    windows of ``data``."""
    import jax
    import jax.numpy as jnp

    ids = jnp.asarray(eval_windows(data, windows, model["context"] + 1))
    return float(jax.jit(lambda p, i: loss(p, i, model))(params, ids)) / LN2


def unigram_bits(train_data: np.ndarray, held: np.ndarray) -> float:
    """The cross-entropy (bits per byte) of ``held`` under ``train_data``'s byte frequencies
    (add-one smoothed): what a model that ignores the context reaches."""
    counts = np.bincount(train_data, minlength=256) + 1.0
    p = counts / counts.sum()
    return float(-np.mean(np.log2(p[held])))


def _flatten(params):
    flat = {"embed": params["embed"], "norm": params["norm"]}
    for i, layer in enumerate(params["layers"]):
        for k, val in layer.items():
            if k == "moe":
                flat.update({f"layers.{i}.moe.{n}": w for n, w in val.items()})
            else:
                flat[f"layers.{i}.{k}"] = val
    return {k: np.asarray(v) for k, v in flat.items()}


def _unflatten(flat, n_layers):
    import jax.numpy as jnp

    layers = [{"moe": {}} for _ in range(n_layers)]
    for key, val in flat.items():
        parts = key.split(".")
        if parts[0] != "layers":
            continue
        layer = layers[int(parts[1])]
        (layer["moe"] if parts[2] == "moe" else layer)[parts[-1]] = jnp.asarray(val)
    return {"embed": jnp.asarray(flat["embed"]), "norm": jnp.asarray(flat["norm"]),
            "layers": layers}


def save(path, params, model: dict = MODEL, train_cfg: dict = TRAIN, meta: dict | None = None):
    """Write ``params`` and the settings (and ``meta``: losses...) to ``path`` (``.npz``)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    info = json.dumps({"model": dict(model), "train": dict(train_cfg), "meta": meta or {}})
    with open(path, "wb") as f:          # a file object: np.savez adds no ``.npz`` of its own
        np.savez(f, __info__=np.array(info), **_flatten(params))
    return path


def load(path):
    """``(params, info)`` from :func:`save`'s file; ``info``: ``{"model", "train", "meta"}``."""
    with np.load(Path(path).expanduser()) as z:
        flat = {k: z[k] for k in z.files}
    info = json.loads(str(flat.pop("__info__")))
    return _unflatten(flat, info["model"]["n_layers"]), info


def load_or_train(path=DEFAULT_PARAMS, model: dict = MODEL, train_cfg: dict = TRAIN,
                  log=print):
    """``(params, info)``: :func:`load`'s where ``path`` holds parameters of these settings,
    else trained (:func:`train`), measured (train and held-out bits per byte, the unigram
    baseline, the training time) and saved to ``path``."""
    path = Path(path).expanduser()
    if path.exists():
        params, info = load(path)
        if info["model"] == dict(model) and info["train"] == dict(train_cfg):
            return params, info
        if log:
            log(f"{path.name}: trained with other settings, training again")
    data = corpus_bytes()
    tr, held = split(data)
    start = time.perf_counter()
    params, history = train(model, train_cfg, tr, log=log)
    meta = {"train_seconds": round(time.perf_counter() - start, 1),
            "train_bits_per_byte": bits_per_byte(params, tr, model),
            "held_out_bits_per_byte": bits_per_byte(params, held, model),
            "unigram_bits_per_byte": unigram_bits(tr, held),
            "first_step_bits_per_byte": history[0] / LN2,
            "corpus_bytes": int(len(data)), "held_out_bytes": int(len(held))}
    save(path, params, model, train_cfg, meta)
    return params, {"model": dict(model), "train": dict(train_cfg), "meta": meta}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=DEFAULT_PARAMS, help="the .npz to load or write")
    ap.add_argument("--steps", type=int, default=TRAIN["steps"])
    args = ap.parse_args(argv)
    _, info = load_or_train(args.params, MODEL, {**TRAIN, "steps": args.steps})
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
