"""Every model CLI × the bad arguments of issue 38: argparse's convention, exit status 2, the
last stderr line ``python -m models.X: error: <message>``, no traceback, nothing on stdout (the
check runs before any model is loaded). docs/models.md, "CLI errors"."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiny_llama import TINY
from tests.support.devices import use_worker_xla_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_errors")
    (d / "text.txt").write_text("Some text to score. " * 50, encoding="utf-8")
    (d / "empty.txt").write_text("", encoding="utf-8")
    (d / "adir").mkdir()
    (d / "bad.json").write_text("{bad json", encoding="utf-8")
    (d / "notalist.json").write_text('{"a": 1}', encoding="utf-8")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "afile").write_text("x", encoding="utf-8")
    np.savez(d / "ref.npz", token_ids=np.zeros((1, 8), np.int32))
    tiny = d / "tiny"  # 8 query heads, 2 KV heads: TP 3 does not split them
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY.to_hf()))
    return d


# (case id, bad arguments, what the error line says); {d} is the files folder
BAD = {
    "tp0": (["--tp", "0"], "--tp must be >= 1"),
    "tp-heads": (["--model", "{d}/tiny", "--tp", "3"], "TP size 3 does not divide the 8 query"),
    "model-missing": (["--model", "/nonexistent/m.gguf"], "no such model file or directory"),
    "settings": (["--settings", "bogus"], "unknown setting 'bogus'"),
    "max-new-tokens": (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    "window": (["--window", "0"], "--window must be >= 2"),
    "max-windows": (["--max-windows", "0"], "--max-windows must be >= 1"),
    "text-missing": (["--text", "{d}/missing.txt"], "no such file"),
    "text-dir": (["--text", "{d}/adir"], "not a file"),
    "text-empty": (["--text", "{d}/empty.txt"], "no windows to score"),
    "text-not-utf8": (["--text", "{d}/latin1.txt"], "UTF-8"),
    "prompts-missing": (["--prompts", "{d}/missing.json"], "no such file"),
    "prompts-bad-json": (["--prompts", "{d}/bad.json"], "not JSON"),
    "prompts-not-a-list": (["--prompts", "{d}/notalist.json"], "JSON list of prompt strings"),
    "json-no-folder": (["--json", "/nonexistent/x.json"], "no such folder"),
    "json-is-dir": (["--json", "{d}/adir"], "is a folder"),
}

# CLI -> (arguments that make the rest valid, the BAD cases that apply to its options)
WINDOWED = ["tp0", "tp-heads", "model-missing", "window", "max-windows", "text-missing",
            "text-dir", "text-empty", "text-not-utf8", "json-no-folder", "json-is-dir"]
CLIS = {
    "generate": (["--prompt", "hi"], ["tp0", "tp-heads", "model-missing", "max-new-tokens"]),
    "eval": (["--text", "{d}/text.txt"], WINDOWED),
    "check_rewrite": (["--text", "{d}/text.txt"], WINDOWED),
    "compare": (["--text", "{d}/text.txt"],
                WINDOWED + ["settings", "max-new-tokens", "prompts-missing",
                            "prompts-bad-json", "prompts-not-a-list"]),
    "demo": ([], ["tp0", "tp-heads", "model-missing", "settings", "max-new-tokens", "window"]),
    "check_tp": ([], ["tp0", "tp-heads", "model-missing", "json-no-folder", "json-is-dir"]),
    "calibrate": (["--budget-ppl", "1", "--out", "{d}/p.json"],
                  ["tp0", "model-missing", "text-missing", "window"]),
    "check_reference": (["--ref", "{d}/ref.npz"],
                        ["tp0", "tp-heads", "model-missing", "text-missing", "text-dir",
                         "json-no-folder", "json-is-dir"]),
}
# CLI-specific cases: (cli, id, arguments, message)
EXTRA = [
    ("compare", "nothing-to-compare", [], "nothing to compare"),
    ("compare", "devices", ["--text", "{d}/text.txt", "--devices", "1"], "--devices 1 is fewer"),
    ("check_tp", "tp-list", ["--tp", "3,x"], "not a comma-separated list"),
    ("check_tp", "tp-list-heads", ["--model", "{d}/tiny", "--tp", "1,2,3"], "TP size 3"),
    ("check_tp", "kinds", ["--kinds", "exact,fast"], "unknown 'fast'"),
    ("check_tp", "tokens", ["--tokens", "1"], "--tokens must be >= 2"),
    ("check_reference", "ref-missing", ["--ref", "{d}/missing.npz"], "no such file"),
    ("check_reference", "ref-not-npz", ["--ref", "{d}/text.txt"], "not an npz file"),
    ("check_rewrite", "comm", ["--text", "{d}/text.txt", "--comm", "exact"], "leave --comm"),
    ("generate", "temperature", ["--prompt", "hi", "--temperature", "-1"], ">= 0.0"),
    ("generate", "top-p", ["--prompt", "hi", "--top-p", "0"], "--top-p must be > 0"),
    ("generate", "top-p-above-1", ["--prompt", "hi", "--top-p", "2"], "--top-p must be <= 1"),
    ("generate", "temperature-nan", ["--prompt", "hi", "--temperature", "nan"],
     "--temperature must be a finite number"),
    ("generate", "seed-too-large", ["--prompt", "hi", "--seed", str(10**23)],
     "--seed must be <="),
    ("generate", "cache-len", ["--prompt", "hi", "--cache-len", "0"], "--cache-len must be"),
    ("eval", "comm", ["--text", "{d}/text.txt", "--comm", "fast"], "unknown --comm 'fast'"),
    ("eval", "config-nested", ["--text", "{d}/text.txt", "--comm", "flash", "--config",
                               "[" * 20_000 + "]" * 20_000], "nested too deep"),
    ("convert", "src-missing", ["{d}/missing.gguf", "{d}/out"], "no such model file"),
    ("convert", "outdir-is-file", ["{d}/tiny", "{d}/afile"], "is not a folder"),
    ("convert", "max-shard-mb", ["{d}/tiny", "{d}/out", "--max-shard-mb", "0"],
     "--max-shard-mb must be > 0"),
    ("calibrate", "budget", ["--budget-ppl", "-1", "--out", "{d}/p.json"],
     "--budget-ppl must be >= 0"),
    ("calibrate", "candidates", ["--budget-ppl", "1", "--out", "{d}/p.json", "--candidates",
                                 "overlap"], "not a quantized all-reduce setting"),
    ("eval", "comm-policy-missing", ["--text", "{d}/text.txt", "--comm-policy",
                                     "{d}/missing.json"], "no such file"),
    ("eval", "comm-policy-bad", ["--text", "{d}/text.txt", "--comm-policy", "{d}/bad.json"],
     "--comm-policy: "),
    ("corpus", "out-no-folder", ["--out", "/nonexistent/x.txt"], "no such folder"),
    ("corpus", "out-is-dir", ["--out", "{d}/adir"], "is a folder"),
]

CASES = [(cli, case, [*base, *BAD[case][0]], BAD[case][1])
         for cli, (base, cases) in CLIS.items() for case in cases] + EXTRA


def run_cli(cli: str, args, timeout: float = 120):
    env = dict(os.environ)
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    return subprocess.run([sys.executable, "-m", f"models.{cli}", *args], cwd=ROOT, env=env,
                          text=True, capture_output=True, timeout=timeout)


# One fresh interpreter per CLI runs all of its bad-argument cases, each as ``python -m`` would
# (``main(argv)``, then ``sys.exit`` of what it returns), with stdout and stderr captured and
# any exception but SystemExit printed as a traceback: a process per case cost ~2 s of imports.
BATCH = """
import contextlib, importlib, io, json, sys, traceback
cli, cases = sys.argv[1], json.loads(sys.argv[2])
main = importlib.import_module("models." + cli).main
results = []
for args in cases:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code if isinstance(code, int) else 1, out.getvalue(), err.getvalue()])
sys.__stdout__.write(json.dumps(results))
"""
_batches: dict = {}


def run_batched(cli: str, args, folder) -> subprocess.CompletedProcess:
    """``run_cli(cli, args)``'s result, from one interpreter per CLI for all its CASES."""
    if cli not in _batches:
        cases = [[a.format(d=folder) for a in c[2]] for c in CASES if c[0] == cli]
        env = dict(os.environ)
        use_worker_xla_flags(env)
        r = subprocess.run([sys.executable, "-c", BATCH, cli, json.dumps(cases)], cwd=ROOT,
                           env=env, text=True, capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        _batches[cli] = {tuple(c): res for c, res in zip(cases, json.loads(r.stdout))}
    code, out, err = _batches[cli][tuple(args)]
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_error(r, cli: str, message: str):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m models.{cli}: error: "), last
    assert message in last, last


@pytest.mark.parametrize("cli,case,args,message", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_argument_is_one_error_line(files, cli, case, args, message):
    r = run_batched(cli, [a.format(d=files) for a in args], files)
    assert_one_error(r, cli, message)
    assert r.stdout == "", r.stdout[-500:]  # refused before the run printed anything


def test_matrix_covers_every_cli():
    import pkgutil

    import models

    # reference_hf runs in another environment (torch + transformers), not this project's
    mains = {m.name for m in pkgutil.iter_modules(models.__path__) if not m.ispkg
             and "def main(" in (ROOT / "models" / f"{m.name}.py").read_text()
             and m.name != "reference_hf"}
    assert mains == {c for c, *_ in CASES}


@pytest.mark.parametrize("cli,args", [
    ("eval", ["--text", "{d}/text.txt", "--window", "4096"]),
    ("compare", ["--text", "{d}/text.txt", "--window", "4096", "--settings", "exact",
                 "--tp", "1"]),
    ("generate", ["--prompt", "hi"]),
])
def test_run_errors_are_one_error_line(files, cli, args):
    """What only the run finds (here: the tiny checkpoint has config.json but no weights; a
    text shorter than one window) is the same one line, exit status 2."""
    r = run_cli(cli, ["--model", str(files / "tiny"), *[a.format(d=files) for a in args]])
    assert_one_error(r, cli, "")


def test_demo_without_benchmarks(files):
    """models.demo starts when ``benchmarks`` cannot be imported (it imports none of it)."""
    code = ("import runpy, sys; sys.modules['benchmarks'] = None; "
            "sys.argv = ['models.demo', '--model', sys.argv[1], '--tp', '1', '--settings', "
            "'exact']; runpy.run_module('models.demo', run_name='__main__')")
    env = dict(os.environ)
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    r = subprocess.run([sys.executable, "-c", code, str(files / "tiny")], cwd=ROOT, env=env,
                       text=True, capture_output=True, timeout=120)
    assert "benchmarks" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    # it got past every import to the model load, which fails: the tiny folder has no weights
    assert_one_error(r, "demo", "safetensors")


@pytest.mark.model
@pytest.mark.parametrize("cli,args", [
    ("generate", ["--prompt", "hi", "--tp", "2"]), ("demo", ["--tp", "2"]),
    ("compare", ["--text", "{d}/text.txt", "--tp", "2"]),
    ("eval", ["--text", "{d}/text.txt", "--tp", "2"]),
    ("check_tp", ["--tp", "2"]),
])
def test_tp2_on_smollm2_reads_only_the_header(files, cli, args):
    """--tp 2 on SmolLM2 (9 query heads, 3 KV heads): refused from the GGUF header alone."""
    r = run_cli(cli, [a.format(d=files) for a in args])
    assert_one_error(r, cli, "TP size 2 does not divide the 9 query heads")
    assert r.stdout == ""


# (what to make at {p}, the --config value, what the error line says)
CONFIG_PATHS = [("fifo", "{p}", "--config {p}: not a regular file"),
                ("dir", "{d}", "--config {d}: not a regular file"),
                ("none", "[1]", "expected a JSON object"),
                ("none", "/dev/zero", "--config /dev/zero: not a regular file")]


@pytest.mark.parametrize("make, args, message", [
    ("fifo", ["--model", "{p}"], "not a regular file or a checkpoint directory"),
    *((make, ["--model", "{d}/tiny", "--comm", "flash", "--config", value], message)
      for make, value, message in CONFIG_PATHS),
    ("fifo", ["--model", "{d}/tiny", "--text", "{d}/text.txt", "--json", "{p}"],
     "--json {p}: not a regular file"),
    ("fifo", ["--model", "{d}/tiny", "--text", "{d}/text.txt", "--comm-policy", "{p}"],
     "--comm-policy {p}: not a file"),
])
def test_non_regular_paths_are_refused_at_parse_time(files, tmp_path, make, args, message):
    """A FIFO, a device or a folder as a path option: exit 2 with one argparse line, before
    anything is loaded (a FIFO used to hang the run, or block it after the whole job)."""
    pipe = tmp_path / "pipe"
    if make == "fifo":
        os.mkfifo(pipe)
    args = args if "--text" in args else ["--text", "{d}/text.txt", *args]
    argv = [a.format(d=files, p=pipe) for a in args]
    got = subprocess.run([sys.executable, "-m", "models.eval", *argv], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert got.returncode == 2, got.stderr[-2000:]
    last = got.stderr.strip().splitlines()[-1]
    assert message.format(d=files, p=pipe) in last and "Traceback" not in got.stderr
