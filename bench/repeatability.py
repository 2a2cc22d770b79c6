"""Are greedy (T = 0) outputs bitwise repeatable on this device, and where do the methods part? The paper-scale eval
found 4-5 of 815 examples where `tiled` / `fused` differ from `hf` at T = 0 (and one where `tiled`
differs from `fused`), although the methods share every code path but `verify()` (docs/eval.md).

This decodes the same chunk of the eval (the same examples: the eval's ``random.Random(0)`` subsample of
``--limit`` examples, sliced at ``--offset``; the eval's prompts, batch, seeds, γ heuristic from 5 and
``compile=True``) with each method, ``--repeats`` times, in one process, and reports which pairs of
(method, repeat) outputs differ and where. ``--order interleaved`` (default) runs repeat r of every method before
repeat r + 1, so "first method in the process" and "method" are not confounded. ``--committed FILE`` also compares
every run with the committed eval record of that chunk. ``--probe`` runs the target eagerly (transformers, model
dtype, and fp32) on each divergent prefix and records its top logits there: a gap of about one bf16 ulp says the
split is a near tie that rounding decides.

    python3 -m bench.repeatability --dataset xsum --offset 80 --committed \\
        bench/results/eval-scale-text-h100.json --probe --json bench/results/repeatability-bf16-h100.json

Same tokens for one method across repeats but different across methods: the methods see different logits (a shape
or path difference). Different tokens for one method across repeats: the forwards are not repeatable.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

from tilespec.env import git_commit

EXACT_GREEDY = ("hf", "reference", "tiled", "fused")
TARGET_ONLY = "target"     # the engine's target-only greedy decoding (no draft): the ground truth of every method
EVAL_LIMITS = {"xsum": 304, "cnndm": 199}     # the paper-scale eval's sample sizes (its subsample depends on them)


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


def run_order(methods: list, repeats: int, order: str) -> list[tuple]:
    """The (method, repeat) runs in execution order: interleaved (every method's repeat r, then r + 1) or grouped."""
    if order == "interleaved":
        return [(m, r) for r in range(repeats) for m in methods]
    return [(m, r) for m in methods for r in range(repeats)]


def tokens(sequence) -> list[int]:
    """A chunk record's sequence (token ids joined by spaces, or a list) as a list of ints."""
    return [int(t) for t in (sequence.split() if isinstance(sequence, str) else sequence)]


def committed_chunk(path: str, offset: int, batch: int, dataset: str) -> dict:
    """{method: [sequence per example]} of examples offset..offset+batch-1 in the first run of ``dataset`` in a
    committed eval-scale record (eval-scale-text-h100.json holds T=0 before T=1 of each dataset)."""
    run = next(r for r in json.load(open(path))["runs"] if r.get("dataset") == dataset)
    out = {}
    for method, chunks in run["raw"].items():
        by_idx = {i: s for c in chunks for i, s in zip(c["idx"], c["sequences"])}
        if all(i in by_idx for i in range(offset, offset + batch)):
            out[method] = [tokens(by_idx[i]) for i in range(offset, offset + batch)]
    return out


def probe(model, sequences: dict, rows: list, prompts: list, top: int = 3) -> list[dict]:
    """For every differing example of every pair: the model's top logits after prompt + the common prefix of new
    tokens (one eager forward per distinct prefix; ``prompts[example]``: its prompt token ids, since the runs'
    sequences hold the new tokens only) and the two tokens the runs chose there. ``gap_ulps``: the top-2 logit gap
    in units of the bf16 spacing at the top logit (about 1 or less: a near tie that rounding decides)."""
    import torch

    seen, out = {}, []
    for r in rows:
        for d in r["first_divergence"]:
            ex, tok_i = d["example"], d["token"]
            a, b = sequences[tuple(r["a"])][ex], sequences[tuple(r["b"])][ex]
            if tok_i >= min(len(a), len(b)):
                continue                        # one run stopped where the other went on
            key = (ex, tuple(a[:tok_i]))
            if key not in seen:
                dev = next(model.parameters()).device
                ids_in = list(prompts[ex]) + list(a[:tok_i])
                with torch.inference_mode():
                    logits = model(input_ids=torch.tensor([ids_in], device=dev, dtype=torch.long)).logits[0, -1].float()
                vals, ids = logits.topk(top)
                ulp = 2.0 ** (math.floor(math.log2(max(abs(float(vals[0])), 1e-30))) - 7)   # bf16: 8 significant bits
                seen[key] = dict(example=ex, token=tok_i, top_ids=ids.tolist(), top_logits=vals.tolist(),
                                 logit={int(t): float(logits[t]) for t in (a[tok_i], b[tok_i])},
                                 gap_ulps=float(vals[0] - vals[1]) / ulp)
            out.append(dict(seen[key], a=r["a"], b=r["b"], a_token=a[tok_i], b_token=b[tok_i]))
    return out


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--methods", default="hf,tiled,fused")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--order", choices=("interleaved", "grouped"), default="interleaved")
    p.add_argument("--dataset", choices=sorted(EVAL_LIMITS), default="xsum")
    p.add_argument("--limit", type=int, default=None, help="the eval's sample size (default: 304 XSum, 199 CNN/DM)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--offset", type=int, default=80, help="first example of the chunk (XSum chunk 6 starts at 80)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--committed", default=None, help="eval-scale JSON whose record of this chunk to compare with")
    p.add_argument("--probe", action="store_true", help="top logits of the target at every divergence")
    p.add_argument("--fresh", action="store_true",
                   help="drop every cached compiled runner (graphs, K/V buffers) before each run: outputs that change "
                        "with --fresh depend on what earlier runs left in the shared buffers")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.limit = a.limit or EVAL_LIMITS[a.dataset]
    if a.repeats < 1 or a.batch < 1 or a.max_new_tokens < 1 or a.offset < 0 or a.offset + a.batch > a.limit:
        p.error("--repeats, --batch and --max-new-tokens must be >= 1, and 0 <= --offset <= --limit - --batch")
    unknown = [m for m in a.methods.split(",") if m not in EXACT_GREEDY + (TARGET_ONLY,)]
    if unknown:
        p.error(f"--methods: {unknown} are not exact methods with a greedy mode ({', '.join(EXACT_GREEDY)}) "
                f"or {TARGET_ONLY!r} (target-only decoding)")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import copy

    import torch

    import tilespec
    from tilespec.engine.leases import release_compiled
    from tilespec.bench.config import EvalConfig
    from tilespec.datasets import load_dataset
    from tilespec.bench.harness import decode_chunk, make_decoder
    from tilespec.bench.tasks import TextTask
    if a.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = tilespec.env.pick_device(a.device)
    dtype = tilespec.env.pick_dtype(a.dtype, device)
    target, tok = tilespec.load(a.target, device=device, dtype=dtype, role="target")
    draft, _ = tilespec.load(a.draft, device=device, dtype=dtype, role="draft")
    methods = a.methods.split(",")
    cfg = EvalConfig(device=str(device), dtype=str(dtype).replace("torch.", ""), temperature=0.0,
                     methods=tuple(m for m in methods if m != TARGET_ONLY) or ("fused",), batch_size=a.batch,
                     max_new_tokens=a.max_new_tokens)
    task = TextTask(getattr(tok, "tokenizer", tok), cfg.max_article_chars)
    idx = list(range(a.offset, a.offset + a.batch))
    examples = load_dataset("summarization", a.dataset, limit=a.limit, seed=cfg.seed)
    prepared = [task.prepare(examples[i], device, dtype) for i in idx]

    def decoder(m):   # target-only: no draft (its verify method is never called)
        return make_decoder(target, None, "fused", cfg) if m == TARGET_ONLY else make_decoder(target, draft, m, cfg)

    decoders = {m: decoder(m) for m in methods}
    outputs, seconds = {}, {}
    for m, r in run_order(methods, a.repeats, a.order):
        if a.fresh:
            release_compiled()
            decoders[m] = decoder(m)
        t0 = time.perf_counter()
        with torch.inference_mode():
            rec = decode_chunk(decoders[m], task, prepared, idx, [cfg.seed + i for i in idx], a.max_new_tokens)
        seconds[f"{m}/{r}"] = time.perf_counter() - t0
        outputs[(m, r)] = [tokens(s) for s in rec["sequences"]]
    committed = committed_chunk(a.committed, a.offset, a.batch, a.dataset) if a.committed else {}
    for m, seqs in committed.items():
        outputs[(f"committed-{m}", 0)] = seqs
    rows = compare(outputs)
    probes = {}
    if a.probe:
        prompts = [p.ids for p in prepared]
        probes[str(dtype)] = probe(target, outputs, rows, prompts)
        if dtype != torch.float32:
            decoders.clear()
            fp32 = copy.deepcopy(target).float()
            probes["torch.float32"] = probe(fp32, outputs, rows, prompts)
            del fp32
    doc = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=str(dtype),
               torch=torch.__version__, commit=git_commit() or "unknown",
               date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), target=a.target, draft=a.draft, dataset=a.dataset,
               limit=a.limit, batch=a.batch, offset=a.offset, max_new_tokens=a.max_new_tokens, order=a.order,
               run_order=[list(x) for x in run_order(methods, a.repeats, a.order)], committed=a.committed,
               deterministic=a.deterministic, fresh=a.fresh, seconds=seconds, pairs=rows, probes=probes,
               note="the first run of each method includes its graph captures / compilation; 'committed-M' rows are "
                    "the committed eval record of the same chunk")
    for r in rows:
        print(f"{r['a']} vs {r['b']}: {r['differing']}/{r['examples']} differ "
              + " ".join(f"ex{x['example']}@{x['token']}" for x in r["first_divergence"]))
    for name, ps in probes.items():
        for x in ps:
            print(f"probe {name} ex{x['example']}@{x['token']} {x['a']}->{x['a_token']} {x['b']}->{x['b_token']}: "
                  f"gap {x['gap_ulps']:.2f} bf16 ulps, logits {x['logit']} top {list(zip(x['top_ids'], [round(v, 4) for v in x['top_logits']]))}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
