"""Offline generation on the paged engine: every prompt submitted to the same engine that serves, stepped until all
end (vLLM's ``LLM.generate`` in spirit) -> the decoder's :class:`~tilespec.engine.generation.GenerationOutput`.

Request i samples with ``seed + i`` (or ``seed[i]``), as :class:`~tilespec.engine.SpeculativeDecoder` does, so with
``coupled`` verification a seeded request's tokens are the same on both (tests/test_paged_engine.py).
:class:`Offline` gives an engine the decoder's ``generate`` / ``stream`` / ``warmup`` / ``last_stats``: what
``tilespec.generate`` and the CLI run on it."""
from __future__ import annotations

import time
from typing import Iterator, Optional, Sequence

import torch

from tilespec.verify.types import SamplingParams

from ..batch_request import BatchRequest
from ..generation import GenerationOutput, StepEvent
from ..metrics import RunStats, peak_memory


def _per_request(value, name: str, n: int) -> list:
    """A sampling field for ``n`` prompts: a scalar (every prompt) or one value per prompt (list, tuple or tensor),
    as the decoder takes them -> n values."""
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() else value.item()
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"sampling.{name} has {len(value)} values for {n} prompts: give one per prompt or a scalar")
    return list(value)


def _requests(engine, prompts, max_new_tokens: int, sampling: Optional[SamplingParams], seed) -> list:
    if not prompts:
        raise ValueError("no prompts: pass at least one token list")
    if engine.has_work:
        raise RuntimeError("the engine is serving other requests; offline generation needs an idle engine")
    s, n = sampling or SamplingParams(), len(prompts)
    fields = ("temperature", "top_k", "top_p", "min_p")
    values = {f: _per_request(getattr(s, f), f, n) for f in fields}
    if any(v != 1 for v in _per_request(s.lenience, "lenience", n)):
        raise ValueError(f"the paged engine verifies exactly (lenience 1), got lenience={s.lenience!r}: "
                         "use the decoder (SpeculativeDecoder, tilespec.generate(engine='decoder'))")
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [int(seed) + i for i in range(len(prompts))]
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    reqs = [BatchRequest(prompt=list(p), max_tokens=max_new_tokens, seed=sd, **{f: values[f][i] for f in fields})
            for i, (p, sd) in enumerate(zip(prompts, seeds))]
    for r in reqs:
        engine.check(r)                 # every request checked before any is queued
    return reqs


@torch.inference_mode()
def stream(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
           sampling: Optional[SamplingParams] = None, seed=0, tokenizer=None, on_finish=None) -> Iterator[StepEvent]:
    """:func:`generate` one engine step at a time: a :class:`StepEvent` per step (``tokens[i]``: request i's new
    tokens, by prompt index); ``on_finish`` gets the GenerationOutput at the end. A stream left unfinished cancels
    its requests, so the engine is idle again."""
    reqs = _requests(engine, prompts, max_new_tokens, sampling, seed)
    before, spec_steps = dict(engine.counters), 0
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    start, peak, index, done = time.perf_counter(), 0, {}, False
    try:
        for i, r in enumerate(reqs):
            index[engine.submit(r)] = i
        step = 0
        while engine.has_work:
            spec = engine.counters["spec_steps"]
            events = engine.step()
            spec_steps += engine.counters["spec_steps"] > spec      # this step verified drafts
            peak = max(peak, engine.kv_bytes_in_use())
            tokens: dict = {}
            for e in events:            # a step may land the step in flight too: two events of one request
                if e.tokens:
                    tokens.setdefault(index[e.rid], []).extend(e.tokens)
            yield StepEvent(step=step, tokens=tokens,
                            finished=[index[e.rid] for e in events if e.finish_reason is not None])
            step += 1
        done = True
    finally:
        if not done:                # abandoned (or failed): the engine is left idle for the next call
            for r in reqs:
                if r.rid >= 0 and r.finish_reason is None:
                    engine.cancel(r.rid)
            while engine.has_work:
                engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    output = _output(engine, reqs, before, spec_steps, time.perf_counter() - start, peak, tokenizer)
    if on_finish is not None:
        on_finish(output)


def generate(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
             sampling: Optional[SamplingParams] = None, seed=0, tokenizer=None) -> GenerationOutput:
    """``prompts``: token id lists (>= 1 token each); every request gets ``max_new_tokens`` and ``sampling`` (each
    field a scalar for every prompt or one value per prompt). Returns sequences (new tokens, prompt excluded) in prompt order, finish reasons, texts when a
    tokenizer is given, and RunStats (steps, request-steps, drafted / accepted / emitted, wall time, peak K/V bytes
    held, peak memory)."""
    done = []
    for _ in stream(engine, prompts, max_new_tokens, sampling, seed, tokenizer, on_finish=done.append):
        pass
    return done[0]


def _output(engine, reqs: list, before: dict, spec_steps: int, wall: float, peak: int, tokenizer) -> GenerationOutput:
    delta = {k: engine.counters[k] - before.get(k, 0) for k in engine.counters}
    drafter = engine.drafter
    context = drafter is not None and drafter.has_context
    request_steps = sum(r.steps for r in reqs)
    stats = RunStats(requests=len(reqs), new_tokens=sum(len(r.tokens) for r in reqs), steps=delta["steps"],
                     target_calls=delta["steps"], request_steps=request_steps, drafted=delta["drafted"],
                     accepted=delta["accepted"], emitted=request_steps + sum(r.accepted for r in reqs),
                     wall_time=wall, kv_cache_bytes=peak, peak_memory_bytes=peak_memory(engine.device),
                     method=engine.method if drafter is not None else "target-only",
                     runtime="paged-graphs" if engine.model.graphs else "paged",
                     drafter=drafter.name if drafter is not None else "",
                     context_steps=spec_steps if context else 0,
                     match_request_steps=delta["spec_steps"] if context else 0,
                     graphed_steps=delta["decode_graph_steps"])
    texts = None
    if tokenizer is not None:
        inner = getattr(tokenizer, "tokenizer", tokenizer)
        texts = [inner.decode(r.tokens, skip_special_tokens=True) for r in reqs]
    return GenerationOutput(sequences=[r.tokens for r in reqs], stats=stats, texts=texts,
                            finish_reasons=[r.finish_reason for r in reqs])


class Offline:
    """``engine`` (a PagedEngine) with one ``sampling`` behind SpeculativeDecoder's offline interface: generate,
    stream, warmup and last_stats (the stats of the last generation that finished)."""

    def __init__(self, engine, sampling: Optional[SamplingParams] = None, tokenizer=None, check=None):
        """``check(prompts, max_new_tokens, seed, sampling) -> seeds``: the caller's checks of a request, before
        anything is queued (tilespec.generate's: the decoder's, engine/inputs.check_request)."""
        self.engine, self.sampling, self.tokenizer, self.check = engine, sampling or SamplingParams(), tokenizer, check
        self.drafter = engine.drafter
        self.last_stats: Optional[RunStats] = None

    def stream(self, input_ids, *, max_new_tokens: int = 64, seed=0, on_finish=None) -> Iterator[StepEvent]:
        def finished(output: GenerationOutput) -> None:
            self.last_stats = output.stats
            if on_finish is not None:
                on_finish(output)
        prompts = _lists(input_ids)
        if self.check is not None:
            seed = self.check(prompts, max_new_tokens, seed, self.sampling)
        return stream(self.engine, prompts, max_new_tokens, self.sampling, seed, self.tokenizer, on_finish=finished)

    def generate(self, input_ids, *, max_new_tokens: int = 64, seed=0) -> GenerationOutput:
        done = []
        for _ in self.stream(input_ids, max_new_tokens=max_new_tokens, seed=seed, on_finish=done.append):
            pass
        return done[0]

    def warmup(self, prompt_len: int = 16, max_new_tokens: int = 8, batch: int = 1) -> RunStats:
        """One uncounted generation of a synthetic prompt (ids 1..7 repeated, so context drafters match)."""
        ids = [[1 + (j % 7) % (self.engine.vocab_out - 1) for j in range(prompt_len)] for _ in range(batch)]
        stats = self.generate(ids, max_new_tokens=max_new_tokens).stats
        self.last_stats = None
        return stats


def _lists(input_ids) -> list:
    return input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [list(p) for p in input_ids]
