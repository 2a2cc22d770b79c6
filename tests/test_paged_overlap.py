"""Overlapped decode steps (engine/paged/overlap.py): the next step planned while the last one's tokens are in
flight gives every request the tokens of the synchronous engine, with stops, length budgets, cancellations,
admissions, prefix sharing, drafts and logprobs in the mix, and leaks no block."""
from __future__ import annotations

import random

import pytest
import torch

import test_paged_engine
from tilespec.engine.batching import BatchRequest
from tilespec.engine.paged.engine import PagedEngine
from tilespec.engine.paged.overlap import InFlight, placeholder, resolve
from tilespec.engine.paged.pricing import DraftGate

target = test_paged_engine.target


def _requests(seed: int, logprobs: bool = False, stops=None) -> list:
    """Ten requests: shared prefixes, repeats, greedy and sampled; ``stops``: request i's stop ids (else none)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 100) for _ in range(9)]
    reqs = []
    for i in range(10):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 12))]
        if i % 4 == 1:
            prompt = [7, 8, 9, 7, 8, 9, 7, 8]        # repeats: the ngram drafter finds drafts
        reqs.append(BatchRequest(prompt=prompt, max_tokens=rng.randrange(1, 24), seed=100 + i,
                                 temperature=0.0 if i % 2 else 1.0, stop_token_ids=(stops or {}).get(i, ()),
                                 logprobs=2 if logprobs and i == 3 else None))
    return reqs


def _serve(engine, reqs, cancel_at: int = -1):
    """Submit in three waves between steps; cancel request 5 at step ``cancel_at``; step until idle."""
    out, steps = {}, 0
    waves = [reqs[:4], reqs[4:7], reqs[7:]]
    while waves or engine.has_work:
        if waves and steps % 3 == 0:
            for r in waves.pop(0):
                engine.submit(r)
        for e in engine.step():
            out.setdefault(e.rid, []).extend(e.tokens)
        if steps == cancel_at:
            engine.cancel(reqs[5].rid)
        engine.blocks.check()
        steps += 1
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1      # every block back
    return out


@pytest.mark.parametrize("draft", [None, "ngram"])
@pytest.mark.parametrize("cancel_at", [-1, 4])
def test_overlap_gives_the_synchronous_tokens(target, draft, cancel_at):
    probe = _requests(1)
    _serve(PagedEngine(target, None, max_batch=8, block_size=4, overlap=False), probe)
    stops = {i: (r.tokens[len(r.tokens) // 2],) for i, r in enumerate(probe) if i % 2 == 0 and len(r.tokens) > 2}
    runs = {}
    for overlap in (False, True):
        reqs = _requests(1, logprobs=draft is None, stops=stops)
        engine = PagedEngine(target, draft, max_batch=8, gamma=3, block_size=4, token_budget=64, overlap=overlap,
                             max_admission_wait=0.0)
        if engine.gate is not None:     # single-step explorations: these requests end within a stretch of drafting
            engine.gate = DraftGate(stretch=1)
        events = _serve(engine, reqs, cancel_at)
        runs[overlap] = [(r.tokens, r.finish_reason) for r in reqs], events, engine.counters
    (sync, sync_events, sync_counters), (over, over_events, counters) = runs[False], runs[True]
    assert over == sync
    assert sum(reason == "stop" for _, reason in sync) >= 2
    assert over_events == sync_events            # the events carry the same tokens, nothing twice
    assert sync_counters["steps_overlapped"] == 0 < counters["steps_overlapped"]
    assert counters["generated_tokens"] == sync_counters["generated_tokens"]


def test_a_length_budget_in_flight_is_not_scheduled_again(target):
    engine = PagedEngine(target, None, max_batch=2, block_size=4)
    req = BatchRequest(prompt=[3, 4, 5], max_tokens=2, temperature=0.0)
    engine.submit(req)
    while engine.has_work:
        engine.step()
    assert len(req.tokens) == 2 and req.finish_reason == "length"
    assert engine.counters["steps"] == 2          # prefill (token 1), one decode (token 2): no wasted third step


def test_resolve_replaces_placeholders_on_the_device():
    flight = InFlight.launch([None, None], torch.tensor([[11, -1], [22, -1]]))
    ids = torch.tensor([5, placeholder(1), placeholder(0), 6])
    resolve(ids, flight)
    assert ids.tolist() == [5, 22, 11, 6]
    assert flight.wait() == [11, 22]


def test_a_drain_that_ends_the_batch_admits_the_waiting(target):
    """The step in flight is landed first (the drafter runs this step) and its only request ends there: the waiting
    request is admitted by the same step, not refused as if the cache could not hold it."""
    engine = PagedEngine(target, "ngram", max_batch=4, gamma=3, block_size=4)
    probe = BatchRequest(prompt=[3, 4, 5], max_tokens=8, temperature=0.0)
    engine.submit(probe)
    while engine.has_work:
        engine.step()
    first = BatchRequest(prompt=[3, 4, 5], max_tokens=8, temperature=0.0, stop_token_ids=(probe.tokens[2],))
    engine.admission.admit = lambda now, waiting, running: running == 0      # defer while anything runs
    drafting = [False]
    engine.gate.drafting = lambda rows, explore=True: drafting[0]
    engine.submit(first)
    while len(first.tokens) < 2:
        engine.step()
    second = BatchRequest(prompt=[9, 10, 11], max_tokens=4, temperature=0.0)
    engine.submit(second)
    assert engine._inflight is not None          # the step drawing the stop token is in flight
    drafting[0] = True
    while engine.has_work:
        engine.step()
    assert first.finish_reason == "stop" and first.tokens == probe.tokens[:3]
    assert second.finish_reason == "length" and len(second.tokens) == 4


def test_admissions_and_prompt_chunks_stay_in_flight(target):
    """Arrivals while the batch decodes, and prompts longer than the step's budget (chunked over several steps):
    the mixed steps are left in flight like decode steps, and every request gets the synchronous engine's tokens."""
    long_prompts = [[(7 * i + j) % 97 + 1 for j in range(18 + 3 * i)] for i in range(4)]
    runs = {}
    for overlap in (False, True):
        engine = PagedEngine(target, None, max_batch=4, block_size=4, token_budget=16, overlap=overlap,
                             max_admission_wait=0.0)
        reqs = [BatchRequest(prompt=p, max_tokens=6, seed=i, temperature=1.0 if i % 2 else 0.0)
                for i, p in enumerate(long_prompts)]
        mixed_in_flight, step = 0, 0
        pending = list(reqs)
        while pending or engine.has_work:
            if pending and step % 4 == 0:
                engine.submit(pending.pop(0))
            engine.step()
            flight = engine._inflight
            mixed_in_flight += flight is not None and flight.sample.mixed
            engine.blocks.check()
            step += 1
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1
        runs[overlap] = [r.tokens for r in reqs], mixed_in_flight
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0 < runs[True][1]


def test_drafting_steps_without_drafts_are_timed(target):
    """The drafter runs but finds nothing (no repeats): each such step is launched in flight and drained by the next
    drafting call; the draft gate still gets its wall time as a drafting sample, so it can learn drafting loses."""
    engine = PagedEngine(target, "ngram", max_batch=4, gamma=3, block_size=4, max_admission_wait=0.0)
    engine.gate.drafting = lambda rows, explore=True: True
    seen = []
    engine.gate.observe = lambda rows, drafting, made, wall: seen.append((rows, drafting, made, wall))
    for i in range(2):
        rid = engine.submit(BatchRequest(prompt=[11 + i, 40, 77, 5], max_tokens=12, temperature=0.0))
        engine.seqs[rid].context.propose = lambda *args: []          # the drafter finds nothing
    while engine.has_work:
        engine.step()
    drafting = [s for s in seen if s[1]]
    assert len(drafting) >= 5 and all(made >= 1 and wall > 0 for _, _, made, wall in drafting)
