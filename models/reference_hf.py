"""Reference logits, perplexity and greedy generations from Hugging Face transformers on CPU.

    refvenv/bin/python models/reference_hf.py --gguf PATH --text FILE --window 512 \\
        --max-windows 6 --out ref.npz [--logit-windows 2] \\
        [--prompts-json models/prompts.json --max-new-tokens 32]

An independent implementation to check ``models/`` against: transformers loads the same GGUF
file (dequantized to float32, llama.cpp's Q/K row permutation undone by its GGUF loader) and its
own tokenizer converted from the GGUF metadata. Runs in a separate venv with torch, transformers,
gguf, accelerate (transformers needs it to load a GGUF) and numpy; it imports neither jax nor
this package (torch is never a project dependency).

The text is tokenized without BOS or other special tokens and cut into the first
``--max-windows`` consecutive non-overlapping windows of ``--window`` tokens. Each window runs
alone (no cache between windows); position t predicts token t+1, giving window-1 negative
log-likelihoods per window (float64 log-softmax of the float32 logits), and
perplexity = exp(mean NLL over all of them).

The npz holds: token_ids (W, window) int32, nll (W, window-1) float64, perplexity, logits
(logit-windows, window, vocab) float32, the versions, the model config values, the tokenizer's
vocab size, and with --prompts-json: prompts (JSON), prompt_ids_i / generated_ids_i int32 (the
chat-templated prompt, or for a GGUF without a chat template the prompt after the tokenizer's
BOS, and the greedy new tokens of prompt i).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def config_values(cfg) -> dict:
    """The Llama shape and numerics values of a transformers config, as npz-ready scalars."""
    rope = getattr(cfg, "rope_theta", None)
    if rope is None:  # transformers >= 5 keeps it in rope_parameters (per layer type: Gemma 3)
        params = getattr(cfg, "rope_parameters", None) or {}
        rope = params.get("rope_theta", (params.get("full_attention") or {}).get("rope_theta"))
    return {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
            "vocab_size": cfg.vocab_size, "rope_theta": float(rope),
            "rms_eps": float(cfg.rms_norm_eps)}


@torch.no_grad()
def score(model, ids: np.ndarray, keep_logits: bool):
    """NLL (window-1,) float64 of one window run alone, and its logits if asked."""
    logits = model(torch.from_numpy(ids[None].astype(np.int64))).logits[0].float()
    logp = torch.log_softmax(logits.double(), dim=-1)
    target = torch.from_numpy(ids[1:].astype(np.int64))
    nll = -logp[:-1].gather(1, target[:, None])[:, 0]
    return nll.numpy(), (logits.numpy() if keep_logits else None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--text", required=True,
                   help="UTF-8 text file (.venv/bin/python -m models.corpus)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=6)
    p.add_argument("--logit-windows", type=int, default=2)
    p.add_argument("--prompts-json", help="JSON list of user prompts to generate from")
    p.add_argument("--max-prompts", type=int, default=None,
                   help="use only the first N prompts of --prompts-json")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    gguf = Path(args.gguf).resolve()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    print(f"loaded {gguf.name} in {time.perf_counter() - t0:.1f}s; transformers "
          f"{transformers.__version__}, torch {torch.__version__}", flush=True)

    ids = tok(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = min(args.max_windows, len(ids) // args.window)
    windows = np.asarray(ids[:n * args.window], np.int32).reshape(n, args.window)
    nlls, logits = [], []
    for w in range(n):
        t = time.perf_counter()
        nll, lg = score(model, windows[w], keep_logits=w < args.logit_windows)
        nlls.append(nll)
        if lg is not None:
            logits.append(lg)
        print(f"window {w + 1}/{n}: mean nll {nll.mean():.4f} ppl {math.exp(nll.mean()):.3f} "
              f"({time.perf_counter() - t:.1f}s)", flush=True)
    nll = np.stack(nlls)
    ppl = float(np.exp(nll.mean()))
    print(f"perplexity {ppl:.4f} over {nll.size} predictions ({len(ids)} text tokens)")

    out = dict(token_ids=windows, nll=nll, perplexity=np.float64(ppl),
               logits=np.stack(logits) if logits else np.zeros((0, args.window, 0), np.float32),
               transformers_version=transformers.__version__, torch_version=torch.__version__,
               tokenizer_vocab_size=np.int64(len(tok)), window=np.int64(args.window),
               **{k: np.asarray(v) for k, v in config_values(model.config).items()})
    if args.prompts_json:
        prompts = json.loads(Path(args.prompts_json).read_text(encoding="utf-8"))
        prompts = prompts[:args.max_prompts]
        out["prompts"] = json.dumps(prompts)
        for i, prompt in enumerate(prompts):
            if tok.chat_template:
                chat = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
                pids = tok(chat, add_special_tokens=False, return_tensors="pt")["input_ids"]
            else:  # a base model without a chat template: the prompt itself after BOS
                pids = tok(prompt, add_special_tokens=True, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                gen = model.generate(pids, attention_mask=torch.ones_like(pids), do_sample=False,
                                     max_new_tokens=args.max_new_tokens,
                                     pad_token_id=tok.eos_token_id)
            new = gen[0, pids.shape[1]:].numpy().astype(np.int32)
            out[f"prompt_ids_{i}"] = pids[0].numpy().astype(np.int32)
            out[f"generated_ids_{i}"] = new
            print(f"prompt {i}: {prompt!r} -> {tok.decode(new, skip_special_tokens=True)!r}",
                  flush=True)
    np.savez(args.out, **out)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f}s total")


if __name__ == "__main__":
    main()
