"""Continuous batching (engine/batching.py) on CPU: requests joining and leaving a fixed batch give the tokens they
give alone, for target-only, ngram, draft-model and draft-model+ngram decoding (heads: test_batching_heads.py), on
the transformers and native runtimes, across defragmentations and chunked prefills."""
from __future__ import annotations

import random

import pytest

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batch_step import row_count
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.verify.types import SamplingParams

from engine_models import layer_skip, no_eos_lm

DRAFTS = ["none", "ngram", "model"]


@pytest.fixture(scope="module")
def target():
    return no_eos_lm()


def _draft(target, name):
    if name == "model+ngram":       # context drafts where a request matches, the model's otherwise
        return [layer_skip(target, 1), "ngram"]
    return {"none": None, "ngram": "ngram", "model": layer_skip(target, 1)}[name]


def _drive(engine, requests, stagger: bool = True):
    """Submit half the requests, run two iterations, submit the rest, run to completion."""
    half = len(requests) // 2 if stagger else len(requests)
    for r in requests[:half]:
        engine.submit(r)
    engine.step()
    engine.step()
    for r in requests[half:]:
        engine.submit(r)
    while engine.has_work:
        engine.step()


@pytest.mark.parametrize("runtime", [False, "native"])
@pytest.mark.parametrize("draft", DRAFTS + ["model+ngram"])
def test_greedy_tokens_equal_the_decoder_target_only(target, draft, runtime):
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3], list(range(20, 34)), [40, 41, 40, 41, 40]]
    ref = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        prompts, max_new_tokens=10).sequences
    engine = BatchEngine(target, _draft(target, draft), max_batch=3, gamma=3, max_len=48, compile=runtime,
                         prefill_chunk=4)
    reqs = [BatchRequest(prompt=p, max_tokens=10, temperature=0.0) for p in prompts]
    _drive(engine, reqs)
    assert [r.tokens for r in reqs] == ref
    assert all(r.finish_reason == "length" for r in reqs) and engine.running == 0
    assert draft == "none" or engine.counters["accepted"] > 0


@pytest.mark.parametrize("draft", DRAFTS + ["model+ngram"])
def test_seeded_request_alone_equals_amid_traffic_and_defrags(target, draft):
    """The same sampled request (seed 7, T=1, top-p 0.9) alone, amid 9 other requests with other parameters, and
    amid them in caches so small that they defragment: the same tokens."""
    def run(others: int, capacity=None):
        engine = BatchEngine(target, _draft(target, draft), max_batch=4, gamma=3, max_len=48, capacity=capacity,
                             prefill_chunk=3)
        rng = random.Random(1)
        reqs = [BatchRequest(prompt=[rng.randrange(3, 120) for _ in range(rng.randrange(1, 20))],
                             max_tokens=rng.randrange(1, 25), temperature=rng.choice([0.0, 0.7, 1.0]), seed=i)
                for i in range(others)]
        x = BatchRequest(prompt=[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
        reqs.insert(others // 2, x)
        _drive(engine, reqs)
        assert all(len(r.tokens) == r.max_tokens for r in reqs)
        return x.tokens, engine.counters["defrags"]

    alone, _ = run(0)
    crowd, _ = run(9)
    tight, defrags = run(9, capacity=60)
    assert alone == crowd == tight and len(alone) == 20
    assert defrags >= 1


def test_steps_run_over_the_smallest_power_of_two_rows_holding_the_live_ones():
    assert [row_count([0], 8), row_count([0, 2], 8), row_count([4], 8), row_count([9], 12)] == [1, 4, 8, 12]


def test_cancel_frees_the_row_and_bad_requests_fail_clearly(target):
    engine = BatchEngine(target, "ngram", max_batch=2, gamma=2, max_len=32)
    a, b, c = (BatchRequest(prompt=[5, 6, 7], max_tokens=20, temperature=0.0) for _ in range(3))
    for r in (a, b, c):
        engine.submit(r)
    engine.step()
    assert engine.running == 2 and len(engine.waiting) == 1
    engine.cancel(a.rid)
    assert a.finish_reason == "cancelled" and engine.running == 1
    while engine.has_work:
        engine.step()
    assert b.tokens == c.tokens and len(c.tokens) == 20
    for bad, match in [(BatchRequest(prompt=[], max_tokens=4), "empty"),
                       (BatchRequest(prompt=[1] * 30, max_tokens=4), "positions"),
                       (BatchRequest(prompt=[500], max_tokens=4), "vocabulary"),
                       (BatchRequest(prompt=[1], max_tokens=0), "max_tokens"),
                       (BatchRequest(prompt=[1], max_tokens=4, top_p=0.0), "top_p")]:
        with pytest.raises(ValueError, match=match):
            engine.submit(bad)


@pytest.mark.parametrize("draft", ["ngram", "model", "model+ngram"])
def test_warm_up_runs_every_row_count_and_leaves_the_engine_as_it_was(target, draft):
    """batch_warmup.warm_up (forced on CPU, where nothing is captured) drives steps of every row count drafting and
    target-only, greedy and sampled; the counters are restored and later requests get the tokens of a fresh
    engine's. A step's draft width does not depend on the matches' lengths or the requests' remaining budgets:
    context drafts are padded to γ and a runner drafts γ tokens or none."""
    from tilespec.engine import batch_step
    from tilespec.engine.batch_warmup import row_counts, warm_up

    widths = []
    real = batch_step.step_rows

    def spy(target_, draft_, fast, state, rows, drafts, *args, **kw):
        widths.append((rows, None if drafts.context is None else drafts.context.shape[1], drafts.gamma))
        return real(target_, draft_, fast, state, rows, drafts, *args, **kw)

    def run(warm: bool):
        engine = BatchEngine(target, _draft(target, draft), max_batch=4, gamma=3, max_len=48, compile="native")
        if warm:
            import tilespec.engine.batching as batching
            batching.step_rows, saved = spy, batching.step_rows
            try:
                assert warm_up(engine, force=True) > 0
            finally:
                batching.step_rows = saved
            assert engine.counters["steps"] == 0 and not engine.has_work
        reqs = [BatchRequest(prompt=[5, 6, 7, 8, 5, 6, 7, 8], max_tokens=12, temperature=t, seed=3) for t in (0, 1)]
        _drive(engine, reqs)
        return [r.tokens for r in reqs]

    assert run(True) == run(False)
    assert row_counts(4) == [1, 2, 4] and row_counts(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="max_batch"):
        row_counts(0)
    assert {rows for rows, _, _ in widths} == {1, 2, 4}
    assert any(g > 0 or k for _, k, g in widths) and any(g == 0 and k is None for _, k, g in widths)
    assert all(k is None or k >= 3 for _, k, _ in widths)          # context drafts padded to γ = 3
    assert all(g in (0, 3) for _, _, g in widths)                   # a runner drafts γ or nothing
    if draft == "model+ngram":                                      # runner-only, context-only and mixed steps
        assert {(k is not None, g > 0) for _, k, g in widths} >= {(False, True), (True, False), (True, True)}
