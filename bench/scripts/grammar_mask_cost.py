"""Host cost of structured-output masks per token at the real vocabulary (Qwen2.5: V = 151,936): xgrammar (what
engine/paged/grammar.py uses) against llguidance, for B = 1 and 64 requests a step, over JSON, a JSON Schema and a
regex. Per step and request: the mask of the next position (fill_next_token_bitmask / compute the mask), a token
drawn from the allowed ones, accepted; the batch's masks then applied to [B, V] fp32 logits on the CPU. Also the
speculative pattern the engine runs: masks for 1 + gamma positions given gamma drafts, then a rollback.

    python bench/scripts/grammar_mask_cost.py --model qwen2.5-coder-1.5b-instruct --out bench/results/grammar-mask-cost-cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
GRAMMARS = {"json_object": None, "json_schema": SCHEMA, "regex": r"[a-z]{3,8}(-[0-9]{2,4}){1,3}"}


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from tilespec.env import tilespec_home
    folder = tilespec_home() / "models" / name
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="model.gguf")


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    """The ids a bitmask row allows (bit i of word w: token 32 w + i)."""
    return np.flatnonzero(np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab])


def xgrammar_run(tokenizer, vocab: int, kind: str, batch: int, steps: int, gamma: int, rng) -> dict:
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = (compiler.compile_builtin_json_grammar() if kind == "json_object" else
                compiler.compile_json_schema(json.dumps(GRAMMARS[kind])) if kind == "json_schema" else
                compiler.compile_regex(GRAMMARS[kind]))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch * (1 + gamma), vocab)
    logits = torch.randn(batch * (1 + gamma), vocab)
    mask_s, apply_s, spec_s, tokens = [], [], [], 0
    for _ in range(steps):
        a = time.perf_counter()
        for i, m in enumerate(matchers):
            if m.is_terminated():
                m.reset()
            m.fill_next_token_bitmask(bitmask, i)
        b = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits[:batch], bitmask[:batch])
        c = time.perf_counter()
        drafts = []
        for i, m in enumerate(matchers):           # a token the grammar allows, then gamma more as drafts
            chain = []
            for _ in range(1 + gamma):
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(bitmask, i)
                ok = allowed_ids(bitmask[i], vocab)
                t = int(ok[rng.randrange(len(ok))])
                m.accept_token(t)
                chain.append(t)
            m.rollback(len(chain))
            drafts.append(chain)
        d = time.perf_counter()                    # the engine's verify masks: 1 + k rows per request, then rollback
        for i, (m, chain) in enumerate(zip(matchers, drafts)):
            k = len(chain) - 1
            for j in range(1 + max(k, 0)):
                m.fill_next_token_bitmask(bitmask, i * (1 + gamma) + j)
                if j < k:
                    m.accept_token(chain[j])
            if k > 0:
                m.rollback(k)
            if chain:
                m.accept_token(chain[0])
        e = time.perf_counter()
        mask_s.append(b - a)
        apply_s.append(c - b)
        spec_s.append(e - d)
        tokens += batch
    return {"library": "xgrammar", "grammar": kind, "batch": batch, "steps": steps, "gamma": gamma,
            "compile_s": compile_s, "mask_us_per_token_p50": statistics.median(mask_s) / batch * 1e6,
            "mask_ms_per_step_p50": statistics.median(mask_s) * 1e3, "apply_ms_per_step_p50":
            statistics.median(apply_s) * 1e3, "spec_masks_ms_per_step_p50": statistics.median(spec_s) * 1e3,
            "spec_masks_us_per_token_p50": statistics.median(spec_s) / batch * 1e6}


def llguidance_run(tokenizer, vocab: int, kind: str, batch: int, steps: int, rng) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = (llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}) if kind == "json_object" else
               llguidance.LLMatcher.grammar_from_json_schema(GRAMMARS[kind]) if kind == "json_schema" else
               llguidance.LLMatcher.grammar_from_regex(GRAMMARS[kind]))
    t0 = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t0
    bitmask = lgt.allocate_token_bitmask(batch, lltok.vocab_size)
    mask_s = []
    for _ in range(steps):
        a = time.perf_counter()
        for i, m in enumerate(matchers):
            if m.is_stopped():
                m.reset()
            lgt.fill_next_token_bitmask(m, bitmask, i)
        mask_s.append(time.perf_counter() - a)
        for i, m in enumerate(matchers):
            ok = allowed_ids(bitmask[i], vocab)
            if len(ok):
                m.consume_token(int(ok[rng.randrange(len(ok))]))
    return {"library": "llguidance", "grammar": kind, "batch": batch, "steps": steps, "compile_s": compile_s,
            "mask_us_per_token_p50": statistics.median(mask_s) / batch * 1e6,
            "mask_ms_per_step_p50": statistics.median(mask_s) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    rows = []
    for kind in GRAMMARS:
        for batch in (1, 64):
            rows.append(xgrammar_run(tokenizer, args.vocab, kind, batch, args.steps, args.gamma, random.Random(0)))
            print(json.dumps(rows[-1]), flush=True)
            try:
                rows.append(llguidance_run(tokenizer, args.vocab, kind, batch, args.steps, random.Random(0)))
                print(json.dumps(rows[-1]), flush=True)
            except Exception as err:            # record why, do not hide it
                rows.append({"library": "llguidance", "grammar": kind, "batch": batch,
                             "error": f"{type(err).__name__}: {err}"})
                print(rows[-1], flush=True)
    import xgrammar
    result = {"what": "host seconds of grammar masks per token at V = 151,936 (Qwen2.5 tokenizer), CPU",
              "cpu": platform.processor() or platform.machine(), "cpu_count": __import__("os").cpu_count(),
              "python": platform.python_version(), "torch": torch.__version__,
              "xgrammar": getattr(xgrammar, "__version__", None) or __import__("importlib.metadata").metadata.version("xgrammar"),
              "llguidance": __import__("importlib.metadata").metadata.version("llguidance"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": args.steps, "gamma": args.gamma, "rows": rows,
              "note": "2-core development machine shared with other jobs: for the order of magnitude and the "
                      "comparison of the two libraries, not a serving host's figure"}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
