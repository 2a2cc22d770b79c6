"""Warm-up of continuous batching (engine/batching.py): compile and capture every step shape before serving.

Why: on the native runtime each step shape -- the step's row count (a power of two), whether it drafts, greedy or
sampled -- is a compiled forward and a captured CUDA graph of its own, made the first time a step needs it. Made
while serving, that first use stalls every live request for seconds (measured: a 2.4 s gap in the first streamed
request of an n-gram server). :func:`warm_up` drives synthetic requests through the engine's own step for every row
count up to ``max_batch``, greedy and sampled (temperature 1, the OpenAI default), drafting and target-only, then
restores the engine's counters and its load switch, so serving starts with every graph in place.

Context drafts are padded to the engine's γ (batch_step.choose_drafts), so a row count has one verify shape
whatever the matches' lengths; the warm-up prompts repeat a pattern so a context drafter matches them (and, for a
context drafter beside a draft runner, also do not, alone and mixed in one step).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .batch_request import BatchRequest


def row_counts(max_batch: int) -> list:
    """The step row counts the engine uses: powers of two below ``max_batch``, and ``max_batch`` (>= 1)."""
    if not (isinstance(max_batch, int) and max_batch >= 1):
        raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    out, n = [], 1
    while n < max_batch:
        out.append(n)
        n *= 2
    return out + [max_batch]


def warm_up(engine, log: Optional[Callable] = None, temperatures: tuple = (0.0, 1.0), force: bool = False) -> float:
    """Run every step shape of ``engine`` once (see the module docstring); returns the seconds it took. A no-op
    (0.0) on an engine with work in flight, and unless the engine's target runner captures CUDA graphs (``force``:
    run anyway, e.g. to test it on CPU)."""
    if engine.has_work or not (force or getattr(engine.target, "mode", None) == "native-graphs"):
        return 0.0
    t0 = time.perf_counter()
    switch, counters = engine.switch, dict(engine.counters)
    engine.switch = None              # the synthetic steps (and their compile time) are not load measurements
    span = max(engine.vocab - engine.pad - 1, 1)
    pattern = [engine.pad + 1 + (i * 7) % span for i in range(8)] * 3             # a context drafter matches it
    plain = [engine.pad + 1 + (i * i * 13 + i) % span for i in range(24)]          # (almost surely) it does not
    tokens = 3 * (engine.gamma + 1) + 2
    caps = (None, 0) if engine.gamma > 0 else (0,)   # drafting (the engine's γ), then target-only steps
    # a context drafter with a draft runner (head+ngram, MODEL+ngram) also drafts with the runner alone (no match)
    # and mixes both in one step (some rows match): warm those steps too
    both = engine.drafter is not None and engine.drafter.has_context and engine.drafting is not None
    kinds = ("pattern", "plain", "mixed") if both else ("pattern",)
    try:
        for rows in row_counts(engine.max_batch):
            for temperature in temperatures:
                for cap in caps:
                    for kind in kinds:
                        for i in range(rows):
                            match = kind == "pattern" or (kind == "mixed" and i % 2 == 0)
                            engine.submit(BatchRequest(prompt=list(pattern if match else plain), max_tokens=tokens,
                                                       temperature=temperature, seed=i, gamma=cap))
                        while engine.has_work:
                            engine.step()
            if log is not None:
                log(f"warm-up: {rows} row(s) ready ({time.perf_counter() - t0:.1f} s)")
    finally:
        engine.switch = switch
        engine.counters.update(counters)
    return time.perf_counter() - t0
