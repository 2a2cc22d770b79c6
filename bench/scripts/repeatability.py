"""Are greedy (T = 0) outputs bitwise repeatable on this device? The paper-scale eval of session 7 found 4-5 of 815
examples where `tiled` / `fused` differ from `hf` at T = 0, and one where `tiled` differs from `fused`, although the
methods share every code path but `verify()` (docs/eval.md). This decodes one batch of XSum prompts greedily with
each method, ``--repeats`` times, in one process, the way the eval does (batch of N, transformers γ heuristic from 5,
``compile=True``), and reports which pairs of (method, repeat) outputs differ and where.

    python3 bench/scripts/repeatability.py --json bench/results/repeatability-H100-DATE.json
    python3 bench/scripts/repeatability.py --deterministic ...   # torch deterministic algorithms + cuBLAS config

Same tokens for one method across repeats but different across methods: the methods see different logits (a shape
or path difference). Different tokens for one method across repeats: the forwards are not repeatable (a reduction
in run-dependent order). Random-init weights (``--random-init``) show the plumbing only: near ties are rarer.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time


def first_divergence(a: list, b: list) -> int | None:
    """Index of the first differing token of two sequences (the shorter length if one is a prefix), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(outputs: dict) -> list[dict]:
    """outputs {(method, repeat): [sequence per example]} -> one row per pair: how many examples differ and where."""
    rows = []
    for (ka, a), (kb, b) in itertools.combinations(sorted(outputs.items()), 2):
        div = [first_divergence(x, y) for x, y in zip(a, b)]
        diff = [(i, d) for i, d in enumerate(div) if d is not None]
        rows.append(dict(a=list(ka), b=list(kb), examples=len(div), differing=len(diff),
                         first_divergence=[dict(example=i, token=d) for i, d in diff]))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--methods", default="hf,tiled,fused")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--offset", type=int, default=80, help="first XSum example (the eval's chunk 5 starts at 80)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.batch < 1 or a.max_new_tokens < 1 or a.offset < 0:
        p.error("--repeats, --batch and --max-new-tokens must be >= 1 and --offset >= 0")
    unknown = [m for m in a.methods.split(",") if m not in ("hf", "reference", "tiled", "fused")]
    if unknown:
        p.error(f"--methods: {unknown} are not exact methods with a greedy mode (hf, reference, tiled, fused)")
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    import tilespec
    from tilespec.eval.config import EvalConfig
    from tilespec.eval.data import load_dataset, summarization_prompt
    from tilespec.eval.harness import make_decoder
    if a.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = tilespec.env.pick_device(a.device)
    dtype = tilespec.env.pick_dtype(a.dtype, device)
    target, tok = tilespec.load(a.target, device=device, dtype=dtype, role="target")
    draft, _ = tilespec.load(a.draft, device=device, dtype=dtype, role="draft")
    examples = load_dataset("summarization", "xsum", limit=a.offset + a.batch)[a.offset:a.offset + a.batch]
    tk = getattr(tok, "tokenizer", tok)
    ids = [list(tk(summarization_prompt(e["document"], 4000))["input_ids"]) for e in examples]
    outputs, seconds = {}, {}
    cfg = EvalConfig(device=str(device), dtype=str(dtype).replace("torch.", ""), temperature=0.0,
                     methods=tuple(a.methods.split(",")),
                     batch_size=a.batch, max_new_tokens=a.max_new_tokens)   # the eval's decoder settings
    for method in a.methods.split(","):
        dec = make_decoder(target, draft, method, cfg)
        for r in range(a.repeats):
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = dec.generate(ids, max_new_tokens=a.max_new_tokens, seed=0)
            seconds[f"{method}/{r}"] = time.perf_counter() - t0
            outputs[(method, r)] = [list(map(int, s)) for s in out.sequences]
    rows = compare(outputs)
    doc = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=str(dtype),
               torch=torch.__version__, commit=os.environ.get("TILESPEC_COMMIT", "unknown"),
               date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), target=a.target, draft=a.draft, batch=a.batch,
               offset=a.offset, max_new_tokens=a.max_new_tokens, deterministic=a.deterministic, seconds=seconds,
               pairs=rows, note="the first repeat of each method includes its graph captures / compilation")
    for r in rows:
        print(f"{r['a']} vs {r['b']}: {r['differing']}/{r['examples']} differ "
              + " ".join(f"ex{x['example']}@{x['token']}" for x in r["first_divergence"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
