"""Offline generation on the paged engine: every prompt submitted to the same engine that serves, stepped until all
end (vLLM's ``LLM.generate`` in spirit) -> the decoder's :class:`~tilespec.engine.generation.GenerationOutput`.

Request i samples with ``seed + i`` (or ``seed[i]``), as :class:`~tilespec.engine.SpeculativeDecoder` does, so with
``coupled`` verification a seeded request's tokens are the same on both (tests/test_paged_engine.py)."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from tilespec.verify.types import SamplingParams

from ..batch_request import BatchRequest
from ..generation import GenerationOutput
from ..metrics import RunStats


def _scalar(value, name: str):
    if isinstance(value, (list, tuple, torch.Tensor)):
        raise ValueError(f"offline generation on the paged engine takes one {name} for every prompt, got a sequence")
    return value


@torch.inference_mode()
def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
             sampling: Optional[SamplingParams] = None, seed=0, tokenizer=None) -> GenerationOutput:
    """``prompts``: token id lists (>= 1 token each); every request gets ``max_new_tokens`` and ``sampling``
    (scalars). Returns sequences (new tokens, prompt excluded) in prompt order, finish reasons, texts when a
    tokenizer is given, and RunStats (steps, drafted / accepted, wall time, peak K/V bytes held)."""
    if not prompts:
        raise ValueError("no prompts: pass at least one token list")
    if engine.has_work:
        raise RuntimeError("the engine is serving other requests; offline generation needs an idle engine")
    s = sampling or SamplingParams()
    values = {f: _scalar(getattr(s, f), f) for f in ("temperature", "top_k", "top_p", "min_p")}
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [int(seed) + i for i in range(len(prompts))]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    reqs = [BatchRequest(prompt=list(p), max_tokens=max_new_tokens, seed=sd, **values)
            for p, sd in zip(prompts, seeds)]
    for r in reqs:
        engine.check(r)                 # every request checked before any is queued
    before = dict(engine.counters)
    start, peak = time.perf_counter(), 0
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
        peak = max(peak, engine.kv_bytes_in_use())
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    delta = {k: engine.counters[k] - before.get(k, 0) for k in engine.counters}
    stats = RunStats(requests=len(reqs), new_tokens=sum(len(r.tokens) for r in reqs), steps=delta["steps"],
                     target_calls=delta["steps"], drafted=delta["drafted"], accepted=delta["accepted"],
                     wall_time=time.perf_counter() - start, kv_cache_bytes=peak, method=engine.method,
                     runtime="paged-graphs" if engine.model.graphs else "paged",
                     drafter=engine.drafter.name if engine.drafter is not None else "",
                     context_steps=delta["spec_steps"], graphed_steps=delta["decode_graph_steps"])
    texts = None
    if tokenizer is not None:
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        texts = [inner.decode(r.tokens, skip_special_tokens=True) for r in reqs]
    return GenerationOutput(sequences=[r.tokens for r in reqs], stats=stats, texts=texts,
                            finish_reasons=[r.finish_reason for r in reqs])
