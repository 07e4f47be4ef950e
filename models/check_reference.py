"""TP=1 logits of models/ against an independent implementation: Hugging Face transformers on
PyTorch, loading the same GGUF file.

Two steps, because torch is a heavy optional dependency kept out of this project's install:

    # 1. in an environment with torch + transformers + gguf (not this project's .venv):
    refvenv/bin/python models/reference_hf.py --gguf PATH --text FILE --window 512 \\
        --max-windows 6 --prompts-json models/prompts.json --out ref.npz
    # 2. here:
    .venv/bin/python -m models.check_reference --ref ref.npz [--model smollm2] [--tp 1] [--json OUT]

Step 2 scores the reference's own token ids (so both sides see the same tokens), and reports
max |delta logit| over the windows whose logits the reference saved, both perplexities over the
same windows, whether our tokenizer gives the reference's ids for the text and the prompts, and
how many greedy tokens match.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from models import cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.check_reference",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", required=True, help="the npz of models/reference_hf.py")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--text", default=None, help="the text the reference tokenized")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def _main(args) -> int:
    cli.set_devices(args.tp)
    import jax
    import numpy as np

    from models.engine import Engine, Sampling
    from models.eval import nll_fn
    from models.machine import first_line
    from models.llama.params import load_model

    ref = np.load(args.ref)
    missing = [k for k in ("token_ids", "perplexity", "nll") if k not in ref.files]
    if missing:
        raise ValueError(f"{args.ref}: not a models/reference_hf.py file (no "
                         f"{', '.join(missing)})")
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    engine = Engine(model, mesh, cache_len=max(1024, ref["token_ids"].shape[1]))
    nll = nll_fn()
    windows = ref["token_ids"]
    ours_nll, max_delta, rel = [], 0.0, 0.0
    for i, w in enumerate(windows):
        tokens = w[None].astype(np.int32)
        logits = engine.score(tokens)
        ours_nll.append(np.asarray(nll(logits, tokens))[0].astype(np.float64))
        if "logits" in ref.files and i < ref["logits"].shape[0]:
            d = np.abs(np.asarray(logits)[0] - ref["logits"][i]).max()
            max_delta = max(max_delta, float(d))
            rel = max(rel, float(d / np.abs(ref["logits"][i]).max()))
        print(f"window {i + 1}/{len(windows)}", file=sys.stderr)
    ppl_ours = math.exp(float(np.concatenate(ours_nll).mean()))
    ppl_ref = float(ref["perplexity"])
    out = {"machine": first_line(), "windows": int(len(windows)),
           "window": int(windows.shape[1]), "max_abs_delta_logit": max_delta,
           "max_rel_delta_logit": rel, "perplexity_ours": ppl_ours,
           "perplexity_reference": ppl_ref,
           "max_abs_delta_token_nll": float(np.abs(np.concatenate(ours_nll)
                                                   - ref["nll"].reshape(-1)).max())}
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            ids = ckpt.tokenizer.encode(f.read())
        n = windows.size
        out["tokenizer_equal_on_text"] = bool(np.array_equal(np.asarray(ids[:n]),
                                                              windows.reshape(-1)))
    prompts = sorted(k for k in ref.files if k.startswith("prompt_ids_"))
    matches = []
    for key in prompts:
        i = key.rsplit("_", 1)[1]
        prompt_ids = [int(t) for t in ref[key]]
        theirs = [int(t) for t in ref[f"generated_ids_{i}"]]
        mine = list(engine.generate(prompt_ids, len(theirs), sampling=Sampling()))
        same = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs))
        matches.append({"prompt": i, "tokens": len(theirs), "equal_prefix": same,
                        "ours": ckpt.tokenizer.decode(mine),
                        "reference": ckpt.tokenizer.decode(theirs)})
    out["greedy"] = matches
    print(out["machine"])
    print(f"max |delta logit| {max_delta:.3e} (relative to max |logit|: {rel:.2e}); "
          f"perplexity ours {ppl_ours:.5f} vs transformers {ppl_ref:.5f}")
    for m in matches:
        print(f"prompt {m['prompt']}: {m['equal_prefix']}/{m['tokens']} greedy tokens equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
