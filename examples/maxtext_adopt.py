"""MaxText adoption check: MaxText's own Transformer, rewritten by ``jax_flashcomm.rewrite``.

    bash examples/maxtext_install.sh       # MaxText 0.2.5 into ~/.cache/jax_flashcomm/maxtext-0.2.5
    .venv/bin/python examples/maxtext_adopt.py [--quick] [--json OUT] [--only NAME,...] \\
        [--timeout S] [--list]

(or ``bash examples/maxtext_install.sh DIR`` and ``PYTHONPATH=DIR`` for another folder).

Built MaxText's way (``pyconfig.initialize`` on configs/base.yml or configs/inference/vllm.yml,
``get_mesh_from_config``, ``create_nnx_abstract_model``, ``create_nnx_sharded_model``, random
weights, calls under ``jax.set_mesh`` and ``logical_axis_rules``): 2 layers, emb 256, mlp 512,
vocab 1024, batch 4 x seq 32, ``ici_tensor_parallelism=4`` (base.yml's ``tensor`` axis, vllm.yml's
``model`` axis), ``attention="dot_product"``, 4 host devices. A configuration is
``shard_mode/rules/dtype/block``: auto|explicit, base.yml's|vllm.yml's logical axis rules,
f32|bf16 (bf16: the config's weight_dtype), llama2 (4 heads)|mistral with GQA (8 query, 4 KV
heads: MaxText refuses fewer KV heads than TP). One subprocess each; a stage that aborts it or
times out is recorded, then the rest rerun without that variant. Per variant (exact:
``CommConfig(bits=None)``; int8: ``CommConfig(bits=8, min_bytes=0, spikes=1)``, one outlier
per group of 128 kept exact, p2p FFI calls on CPU; int8-xla: the same over XLA collectives):
``jax.jit(rewrite(f))`` called first on a fresh object, ``rw.report``, ``jax.jit(rw)``
compiled, the eager call, the accuracy over 8 random batches against the as-written jit (top-1
strict, and tie-aware: bf16 logits tie, and a pick among the tied maxima agrees). HLO
collectives are counted per step (loop trip counts applied), in the decoder (a DecoderLayer frame
or the layer scan's body) or outside, with per-rank operand bytes (a p2p call: its wire buffers).
``closure``: the report with MaxText's RNG state closed over rather than passed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

_FLAG = "--xla_force_host_platform_device_count"
os.environ["XLA_FLAGS"] = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                                   if not f.startswith(_FLAG)] + [f"{_FLAG}=4"])

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                    "jax_flashcomm", "maxtext-0.2.5")    # examples/maxtext_install.sh's default
if os.path.isdir(SITE) and SITE not in os.environ.get("PYTHONPATH", ""):
    sys.path.append(SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), SITE]))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hlo_collectives import hlo_collectives  # noqa: E402  (examples/hlo_collectives.py)
from maxtext_summary import BATCHES, VARIANTS, markdown, summarize  # noqa: E402
DIMS = dict(base_num_decoder_layers=2, base_emb_dim=256, base_mlp_dim=512, vocab_size=1024,
            max_target_length=32, per_device_batch_size=1, ici_tensor_parallelism=4,
            ici_fsdp_parallelism=1, attention="dot_product")
BLOCKS = {"llama2": dict(decoder_block="llama2", base_num_query_heads=4, base_num_kv_heads=4,
                         head_dim=64),
          "mistral": dict(decoder_block="mistral", base_num_query_heads=8, base_num_kv_heads=4,
                          head_dim=32)}
RULES = {"base": "base.yml", "vllm": "inference/vllm.yml"}
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
ALL = [f"{m}/{r}/{d}/{b}" for b in BLOCKS for r in RULES for m in ("auto", "explicit")
       for d in DTYPES]
QUICK = ["auto/base/f32/llama2", "auto/base/bf16/llama2", "explicit/base/f32/llama2",
         "auto/vllm/f32/mistral"]
def _error(e):
    lines = [ln for ln in "".join(traceback.format_exception(type(e), e, e.__traceback__))
             .splitlines() if ln.strip() and not ln.startswith(("For simplicity", "-----"))]
    ours = [f"{fr.filename[fr.filename.rindex('jax_flashcomm/'):]}:{fr.lineno} ({fr.name})"
            for fr in traceback.extract_tb(e.__traceback__) if "/jax_flashcomm/" in fr.filename]
    return dict(ok=False, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:2000]}",
                tb_first=lines[1:3], tb_last=lines[-3:], flashcomm_frames=ours[-4:])


def _compare(y, y0):
    import numpy as np
    a, b = np.asarray(y, np.float32), np.asarray(y0, np.float32)
    return dict(max_abs=float(np.max(np.abs(a - b))), bit_equal=bool(np.array_equal(a, b)),
                rel_l2=float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
                top1=float(np.mean(np.argmax(a, -1) == np.argmax(b, -1))))


def build(name):
    """MaxText's model for one configuration: the forward, its arguments and the context."""
    import jax
    import jax.experimental.xla_metadata as xm
    if not hasattr(xm, "must_fuse_call"):        # jax 0.10.2 lacks it; only flash attention uses it
        xm.must_fuse_call = lambda *a, **k: (lambda f: f)
    import jax_flashcomm
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils, sharding
    mode, rules, dtype, block = name.split("/")
    kw = dict(DIMS, **BLOCKS[block], dtype=DTYPES[dtype], shard_mode=mode)
    if dtype == "f32":
        kw["weight_dtype"] = "float32"
    config = pyconfig.initialize(
        ["", os.path.join(os.path.dirname(pyconfig.__file__), RULES[rules])],
        run_name="maxtext_adopt", log_config=False, enable_checkpointing=False,
        skip_jax_distributed_system=True, base_output_directory=tempfile.gettempdir(),
        jax_cache_dir="", **kw)                  # base.yml's persistent cache would skew timings
    mesh = maxtext_utils.get_mesh_from_config(config)
    create, abstract = model_creation_utils.create_nnx_abstract_model(config, mesh)
    model = maxtext_utils_nnx.create_nnx_sharded_model(abstract, create, mesh=mesh)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    b, s, jnp = 4, DIMS["max_target_length"], jax.numpy

    def make_inputs(seed):
        inputs = (jax.random.randint(jax.random.key(seed), (b, s), 0, DIMS["vocab_size"]),
                  jnp.broadcast_to(jnp.arange(s), (b, s)), jnp.ones((b, s), jnp.int32))
        return tuple(jax.device_put(x, sharding.get_input_data_sharding(config, mesh))
                     for x in inputs)
    inputs = make_inputs(0)

    def fwd(params, rest, tokens, positions, segment_ids):
        return nnx.merge(graphdef, params, rest)(tokens, positions, segment_ids,
                                                 enable_dropout=False, model_mode=MODEL_MODE_TRAIN)

    def fwd_closed(params, tokens, positions, segment_ids):
        return fwd(params, rest, tokens, positions, segment_ids)

    def scope(stack):                            # MaxText's train-step context
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(logical_axis_rules(config.logical_axis_rules))
    embed = [str(v.sharding.spec) for p, v in jax.tree_util.tree_leaves_with_path(params)
             if "token_embedder" in jax.tree_util.keystr(p)]
    info = dict(mesh={k: int(v) for k, v in mesh.shape.items() if v > 1},
                axis_types=sorted({str(t) for t in mesh.axis_types}),
                weight_dtype=str(config.weight_dtype), scan_layers=bool(config.scan_layers),
                embedding_spec=embed, flashcomm=os.path.dirname(jax_flashcomm.__file__))
    return dict(jax=jax, fc=jax_flashcomm, mesh=mesh, fwd=fwd, fwd_closed=fwd_closed,
                batch=lambda seed: (params, rest, *make_inputs(seed)),
                args=(params, rest, *inputs), closed=(params, *inputs), scope=scope, info=info)


class _Stages:
    """One configuration's results, stage by stage; the results file is rewritten after every
    stage (a stage that aborts the process leaves it naming that stage as ``current``)."""

    def __init__(self, name, out):
        self.name, self.out = name, out
        self.res = dict(config=name, stages={}, current=None)

    def stage(self, key, fn):
        res = self.res
        res["current"] = key
        with open(self.out, "w") as f:
            json.dump(res, f, default=str)
        t = time.perf_counter()
        try:
            got = dict(ok=True, **(fn() or {}))
        except Exception as e:                   # noqa: BLE001  (every failure is a finding)
            got = _error(e)
            print(f"[{self.name}] {key}: {got['error']}", flush=True)
        got["seconds"] = round(time.perf_counter() - t, 3)
        res["stages"][key], res["current"] = got, None
        with open(self.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return got["ok"]


def _timed_compile(ctx, y, f, key):
    """``f`` jitted, lowered and compiled on the configuration's arguments, then called (its
    result in ``y[key]``): the compile time and the HLO's collectives."""
    jax, args = ctx["jax"], ctx["args"]
    t = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    seconds = round(time.perf_counter() - t, 3)
    y[key] = jax.block_until_ready(compiled(*args))
    return dict(trace_compile_s=seconds, hlo=hlo_collectives(compiled.as_text(), ctx["mesh"]))


def _accuracy(ctx, rw):
    """Over BATCHES batches of 4 x 32 tokens against the as-written jit: the relative L2 error
    of the logits, top-1 agreement (strict, and among the reference's tied maxima)."""
    import numpy as np

    jax, fwd = ctx["jax"], ctx["fwd"]
    ref, got, sq, err, hits, tied, n = jax.jit(fwd), jax.jit(rw), 0.0, 0.0, 0, 0, 0
    for seed in range(1, BATCHES + 1):
        a = np.asarray(ref(*ctx["batch"](seed)), np.float64)
        b = np.asarray(got(*ctx["batch"](seed)), np.float64)
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        sq, err = sq + np.sum(a * a), err + np.sum((a - b) ** 2)
        pick = b.argmax(-1)
        hits += int(np.sum(a.argmax(-1) == pick))
        # bf16 logits tie: a pick among the reference's tied maxima agrees
        tied += int(np.sum(a[np.arange(len(a)), pick] == a.max(-1)))
        n += len(a)
    return dict(tokens=n, rel_l2=float(np.sqrt(err / sq)), top1=hits / n, top1_ties=tied / n)


def _variant_stages(ctx, y, name, v, config):
    """The stages of one variant (its ``CommConfig``): ``[(key, fn)]`` in the order they run."""
    jax, fc, mesh, fwd, args = (ctx[k] for k in ("jax", "fc", "mesh", "fwd", "args"))
    policy = fc.RewritePolicy(config=config)
    rw = fc.rewrite(fwd, policy)

    def jit_first():
        jf = jax.jit(fc.rewrite(fwd, policy))        # a fresh object: nothing ran before
        y["jit_first"] = jax.block_until_ready(jf(*args))
        return dict(vs_as_written=_compare(y["jit_first"], y["as_written"]),
                    hlo=hlo_collectives(jf.lower(*args).compile().as_text(), mesh))

    def report():
        jax.clear_caches()                           # nothing reused from jit_first
        t = time.perf_counter()
        rep = rw.report(*args)
        seconds = round(time.perf_counter() - t, 3)
        print(f"--- {name} {v}: rw.report(*args) ---\n{rep}", flush=True)
        return dict(report_s=seconds, rows=len(rep), counts=dict(rep.counts()),
                    report_compile_s=rep.compile_seconds)

    def compile_rw():
        got = _timed_compile(ctx, y, rw, "jit")
        return dict(got, vs_as_written=_compare(y["jit"], y["as_written"]))

    def eager():
        y["eager"] = jax.block_until_ready(rw(*args))
        return dict(vs_as_written=_compare(y["eager"], y["as_written"]),
                    **{f"{k}_vs_eager": _compare(y[k], y["eager"])
                       for k in ("jit_first", "jit") if k in y})

    return [("jit_first", jit_first), ("report", report), ("compile", compile_rw),
            ("eager", eager), ("accuracy", lambda: _accuracy(ctx, rw))]


def run_one(name, out, skip):
    """One configuration, stage by stage; the results file is rewritten after every stage."""
    stages = _Stages(name, out)
    ctx = {}
    if not stages.stage("build", lambda: ctx.update(build(name)) or ctx["info"]):
        return
    jax, fc = ctx["jax"], ctx["fc"]
    y = {}

    def as_written():
        jax.clear_caches()
        got = _timed_compile(ctx, y, ctx["fwd"], "as_written")
        return dict(got, logits=f"{y['as_written'].dtype}{list(y['as_written'].shape)}")

    with contextlib.ExitStack() as stack:
        ctx["scope"](stack)
        if not stages.stage("as_written", as_written):
            return
        int8 = dict(bits=8, min_bytes=0, spikes=1)     # one outlier kept exact per group
        configs = {"exact": fc.CommConfig(bits=None), "int8": fc.CommConfig(**int8),
                   "int8-xla": fc.CommConfig(**int8, transport="xla")}
        for v in (v for v in VARIANTS if v not in skip):
            for key, fn in _variant_stages(ctx, y, name, v, configs[v]):
                y.pop(key, None)
                stages.stage(f"{v}.{key}", fn)
            y.pop("jit", None)

        closed, fwd_closed = ctx["closed"], ctx["fwd_closed"]
        if "closure" not in skip and stages.stage("closure.as_written", lambda: dict(
                vs_passed=_compare(jax.jit(fwd_closed)(*closed), y["as_written"]))):
            stages.stage("closure.report", lambda: dict(rows=len(fc.rewrite(
                fwd_closed, fc.RewritePolicy(config=configs["exact"])).report(*closed))))


def _git():
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True).stdout
    diff = git("diff", "HEAD", "--", "jax_flashcomm")
    return dict(head=git("rev-parse", "--short", "HEAD").strip(),
                jax_flashcomm_tree=git("rev-parse", "--short", "HEAD:jax_flashcomm").strip(),
                jax_flashcomm_modified=[ln[3:] for ln in git(
                    "status", "--porcelain", "--", "jax_flashcomm").splitlines()],
                jax_flashcomm_diff_sha1=hashlib.sha1(diff.encode()).hexdigest()[:12] if diff
                else None)


def run_config(name, timeout, tmp):
    """One configuration in subprocesses: after an abort or a timeout in a variant's stage, the
    stage is recorded and the configuration rerun without that variant."""
    out = os.path.join(tmp, name.replace("/", "_") + ".json")
    err = out[:-5] + ".stderr"
    merged, skip = dict(config=name, stages={}, runs=[]), []
    while True:
        if os.path.exists(out):
            os.remove(out)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--out", out,
               "--skip", ",".join(skip)]
        t = time.perf_counter()
        with open(err, "w") as ef:
            try:
                rc = subprocess.run(cmd, stderr=ef, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        part = dict(stages={}, current=None)
        if os.path.exists(out):
            with open(out) as f:
                part = json.load(f)
        for k, v in part["stages"].items():
            merged["stages"].setdefault(k, v)
        merged["runs"].append(dict(rc=rc, wall_s=round(time.perf_counter() - t, 1), skip=skip[:]))
        if rc == 0:
            return merged
        with open(err, errors="replace") as f:
            text = f.read()
        lines = [ln.strip()[:400] for ln in text.splitlines() if ln.strip()]
        key = [ln for ln in lines if re.match(r"(F\d{4} |Fatal|.*Check failed)", ln)][:2]
        passes = list(dict.fromkeys(re.findall(r"xla::(?:\w+::)*?(\w+)::RunImpl\(", text)))
        key += [f"in XLA passes (innermost first): {', '.join(passes)}"] if passes else []
        what = (f"timed out after {timeout} s" if rc == "timeout" else f"exited with rc {rc}"
                + (" (SIGABRT: 134 in a shell)" if rc == -6 else ""))
        cur = part.get("current")
        merged["stages"][cur or "process"] = dict(
            ok=False, error=f"process {what} in this stage" if cur else f"process {what}",
            stderr=key or lines[-4:])
        variant = (cur or "").split(".")[0]
        if variant not in VARIANTS or variant in skip:
            return merged
        skip.append(variant)


def portable(text: str) -> str:
    """``text`` with this checkout's and the home folder's paths written relative."""
    return text.replace(ROOT + os.sep, "").replace(ROOT, ".").replace(
        os.path.expanduser("~"), "~")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--only", help="comma-separated configuration names (see --list)")
    p.add_argument("--list", action="store_true", help="print the configuration names")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--json-items", action="store_true",
                   help="with --json: also each collective instruction of each compiled HLO")
    p.add_argument("--timeout", type=float, default=300, help="seconds per subprocess")
    p.add_argument("--markdown", metavar="JSON",
                   help="print the docs' table from a --json file of an earlier run, and stop")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        return run_one(a.one, a.out, set(filter(None, a.skip.split(",")))) or 0
    if a.markdown:
        with open(a.markdown) as f:
            return print(markdown(json.load(f))) or 0
    if a.list:
        return print("\n".join(ALL)) or 0
    names = a.only.split(",") if a.only else QUICK if a.quick else ALL
    if [n for n in names if n not in ALL]:
        p.error(f"unknown configurations {[n for n in names if n not in ALL]}; see --list")
    import importlib.metadata as md
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    meta = dict(command=" ".join([sys.executable] + sys.argv), git=_git(), cpu=cpu,
                versions={k: md.version(k) for k in ("jax", "jaxlib", "flax", "maxtext")},
                pythonpath=os.environ.get("PYTHONPATH", ""), cpus=os.cpu_count(),
                xla_flags=os.environ["XLA_FLAGS"])
    print(f"maxtext_adopt: {len(names)} configurations; {json.dumps(meta)}", flush=True)
    t0, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t = time.perf_counter()
            print(f"\n===== {name}", flush=True)
            results.append(run_config(name, a.timeout, tmp))
            print(f"===== {name}: {time.perf_counter() - t:.1f} s, exit codes "
                  f"{[x['rc'] for x in results[-1]['runs']]}", flush=True)
    meta["wall_s"], meta["git_at_end"] = round(time.perf_counter() - t0, 1), _git()
    if {**meta["git_at_end"], "head": 0} != {**meta["git"], "head": 0}:
        print(f"NOTE: jax_flashcomm changed during the run: {meta['git_at_end']}")
    summarize(results)
    print(f"\nwall time {meta['wall_s']} s for {len(names)} configurations")
    if a.json:
        if not a.json_items:          # the per-instruction lists: in the log's HLO, not here
            for r in results:
                for stage in r["stages"].values():
                    (stage.get("hlo") or {}).pop("items", None)
        with open(a.json, "w") as f:
            f.write(portable(json.dumps(dict(meta=meta, results=results), indent=1,
                                        default=str)))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
