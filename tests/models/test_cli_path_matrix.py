"""Every path option of every model CLI against the non-regular files: a FIFO, ``/dev/zero``,
a folder and a symlink loop. Each is refused at parse time, before anything is loaded or
measured: exit status 2, the argparse line last, no traceback, and never a hang (a FIFO opened
for reading blocks until a writer comes; the batch has a deadline)."""

import json
import os
import subprocess
import sys

import pytest

from tests.models.test_cli_errors import BATCH, ROOT, files  # noqa: F401  (the fixture)
from tests.support.devices import use_worker_xla_flags

KINDS = ("fifo", "zero", "dir", "loop")

# cli -> (the arguments the path option is added to, [(option, role)]); role "in": a file
# read, "out": a file written, "model": a checkpoint (a file or a folder with config.json).
CLIS = {
    "eval": (["--model", "{d}/tiny", "--text", "{d}/text.txt"],
             ["--model", "--text", "--json", "--comm-policy", "--config"]),
    "generate": (["--model", "{d}/tiny", "--prompt", "hi"],
                 ["--model", "--comm-policy", "--config"]),
    "compare": (["--model", "{d}/tiny", "--text", "{d}/text.txt", "--tp", "2"],
                ["--model", "--text", "--prompts", "--json", "--comm-policy"]),
    "calibrate": (["--model", "{d}/tiny", "--text", "{d}/text.txt", "--out", "{d}/p.json",
                   "--budget-ppl", "1", "--tp", "2"],
                  ["--model", "--text", "--out", "--sensitivity-from", "--plot"]),
    "demo": ([], ["--model"]),
    "check_tp": ([], ["--model", "--json"]),
    "corpus": ([], ["--out"]),
    "convert": (["{d}/tiny", "{d}/converted"], ["src"]),
}


def _path(folder, kind: str) -> str:
    return {"fifo": f"{folder}/fifo", "zero": "/dev/zero", "dir": f"{folder}/adir",
            "loop": f"{folder}/loop_a"}[kind]


def _cases(folder):
    out = []
    for cli, (base, options) in CLIS.items():
        for option in options:
            for kind in KINDS:
                args = [a.format(d=folder) for a in base]
                bad = _path(folder, kind)
                if option == "src":
                    args[0] = bad
                else:
                    if option in args:  # replace the option's value in the base
                        i = args.index(option)
                        del args[i:i + 2]
                    args += [option, bad]
                    if option == "--config":
                        args += ["--comm", "flash"]
                out.append((cli, option, kind, args))
    return out


_results: dict = {}


@pytest.fixture(scope="module")
def matrix_folder(files):  # noqa: F811
    fifo, a, b = files / "fifo", files / "loop_a", files / "loop_b"
    if not fifo.exists():
        os.mkfifo(fifo)
    if not a.is_symlink():
        a.symlink_to(b)
        b.symlink_to(a)
    return files


def _run(folder, cli):
    if cli not in _results:
        cases = [c for c in _cases(folder) if c[0] == cli]
        env = dict(os.environ)
        use_worker_xla_flags(env)
        r = subprocess.run([sys.executable, "-c", BATCH, cli, json.dumps([c[3] for c in cases])],
                           cwd=ROOT, env=env, text=True, capture_output=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        _results[cli] = {(c[1], c[2]): res for c, res in zip(cases, json.loads(r.stdout))}
    return _results[cli]


@pytest.mark.parametrize("cli,option", [(c, o) for c, (_, opts) in CLIS.items() for o in opts])
def test_non_regular_path_is_one_parse_error(matrix_folder, cli, option):
    results = _run(matrix_folder, cli)
    for kind in KINDS:
        code, out, err = results[(option, kind)]
        where = f"{cli} {option} {kind}"
        assert code == 2, (where, code, err[-1500:])
        assert "Traceback" not in err, (where, err[-1500:])
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"python -m models.{cli}: error: "), (where, last)
        assert _path(matrix_folder, kind) in last, (where, last)  # refused for that path
