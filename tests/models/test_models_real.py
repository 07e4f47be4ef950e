"""The TP Llama on the real SmolLM2-135M-Instruct GGUF (fetched once into the model cache) and
on a safetensors checkpoint the test writes; the CLIs' outputs and errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jax_flashcomm.nn import TPComm
from models.engine import Engine
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint, tiny_tensors
from tests.support.devices import use_worker_xla_flags

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=600):
    env = dict(os.environ)
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def smollm2():
    from models.checkpoints import open_checkpoint

    return open_checkpoint("smollm2")


def _logits(ckpt, tp, tokens, kind="exact", dtype=jnp.float32):
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    model, _ = load_model(None, tp=tp, mesh=mesh, comm=TPComm.from_kind(kind), dtype=dtype, ckpt=ckpt)
    return np.asarray(Engine(model, mesh, cache_len=64).score(tokens), np.float64)


@pytest.mark.model
def test_gguf_tp3_equals_tp1(smollm2):
    """SmolLM2 from its GGUF at TP=3 (3 query heads, 1 KV head per rank) is within TP=1's own
    f32 rounding error of the f64 logits (tolerance derived as in tests/models/test_models.py)."""
    from models.corpus import load_text

    tokens = np.asarray([smollm2.tokenizer.encode(load_text())[:24]], np.int32)
    f32 = _logits(smollm2, 1, tokens)
    with jax.enable_x64(True):
        f64 = _logits(smollm2, 1, tokens, dtype=jnp.float64)
    e1 = np.abs(f32 - f64).max()
    tp3 = _logits(smollm2, 3, tokens)
    assert 0 < e1 < 1e-4 * np.abs(f64).max()
    assert np.abs(tp3 - f64).max() <= 2 * e1
    # and the model predicts real text far better than chance (ln 49152 = 10.8 nats)
    logp = jax.nn.log_softmax(f32[0, :-1], axis=-1)
    assert -np.mean(np.take_along_axis(np.asarray(logp), tokens[0, 1:, None], axis=-1)) < 5


@pytest.mark.model
def test_generate_cli_real_model():
    r = _run("models.generate", "--model", "smollm2", "--tp", "3", "--comm", "flash",
             "--bits", "8", "--prompt", "What is the capital of France?",
             "--max-new-tokens", "12", "--greedy")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stdout and "tokens/s" in r.stdout and "bytes" in r.stdout


@pytest.mark.model
def test_eval_cli_json(tmp_path):
    text = tmp_path / "text.txt"
    subprocess.run([sys.executable, "-m", "models.corpus", "--out", str(text)], cwd=ROOT,
                   check=True)
    out = tmp_path / "eval.json"
    r = _run("models.eval", "--model", "smollm2", "--text", str(text), "--tp", "3", "--comm",
             "flash", "--rs-bits", "4", "--ag-bits", "8", "--window", "64", "--max-windows",
             "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["tokens"] == 2 * 63
    assert 1 < result["perplexity"] < 100
    assert result["options"]["rs_bits"] == 4 and result["options"]["ag_bits"] == 8


@pytest.mark.model
@pytest.mark.parametrize("args,message", [
    (["--comm", "fast"], "unknown --comm 'fast'"),
    (["--tp", "2"], "TP size 2 does not divide the 9 query heads"),
    (["--cache-len", "16"], "longer than the KV cache"),
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
])
def test_cli_errors(args, message):
    r = _run("models.generate", "--prompt", "Hello there, how are you?", "--max-new-tokens",
             "4", *args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def _write_safetensors(path: Path, shards: int):
    tensors = tiny_tensors()
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY.to_hf()))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_checkpoint_runs_tp(tmp_path, shards):
    """A Hugging Face directory (one file or sharded) gives the same model as the tensors it
    was written from, placed at TP=4."""
    _write_safetensors(tmp_path / "ckpt", shards)
    tokens = np.arange(12, dtype=np.int32)[None] % TINY.vocab_size
    from_dir = _logits_path(str(tmp_path / "ckpt"), 4, tokens)
    from_dict = _logits(DictCheckpoint(), 4, tokens)
    np.testing.assert_array_equal(from_dir, from_dict)


def _logits_path(path, tp, tokens):
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    model, _ = load_model(path, tp=tp, mesh=mesh)
    return np.asarray(Engine(model, mesh, cache_len=64).score(tokens), np.float64)


def test_wrong_shape_in_safetensors_is_a_clear_error(tmp_path):
    _write_safetensors(tmp_path / "ckpt", 1)
    tensors = tiny_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:50]
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path / "ckpt"), tp=2, mesh=mesh)
