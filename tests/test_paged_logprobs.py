"""Logprobs on the paged engine: every emitted token's raw log-probability and its top alternatives equal the
target's own log-softmax over the full sequence, with and without drafts, greedy and sampled, and the tokens are
unchanged by asking; bad values and the engine that cannot report them give clear errors."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.engine.paged.engine import PagedEngine

import test_paged_engine
from test_paged_engine import PROMPTS

target = test_paged_engine.target      # the paged tests' tiny model (a module fixture)


def _events(engine, reqs):
    got = {}
    for r in reqs:
        engine.submit(r)
        got[r.rid] = []
    while engine.has_work:
        for e in engine.step():
            got[e.rid] += [(t, lp) for t, lp in zip(e.tokens, e.logprobs or [None] * len(e.tokens))]
    return [got[r.rid] for r in reqs]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_logprobs_are_the_targets_log_softmax_at_each_emitted_token(target, draft):
    asks = [BatchRequest(prompt=p, max_tokens=10, temperature=t, seed=i, logprobs=k)
            for i, (p, t, k) in enumerate(zip(PROMPTS, [0.0, 1.0, 0.0, 1.0, 0.0, 0.0], [3, 0, 5, 2, 20, None]))]
    plain = [BatchRequest(prompt=r.prompt, max_tokens=10, temperature=r.temperature, seed=r.seed) for r in asks]
    engine = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, token_budget=16, pricing=False)
    got = _events(engine, asks)
    again = _events(PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4, token_budget=16, pricing=False),
                    plain)
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in g] for g in again]     # asking changes no token
    if draft:
        assert engine.counters["accepted"] > 0           # accepted drafts are among the reported tokens
    for req, events in zip(asks, got):
        if req.logprobs is None:
            assert all(lp is None for _, lp in events)
            continue
        seq = torch.tensor([req.prompt + req.tokens])
        with torch.no_grad():
            ref = torch.log_softmax(target(seq).logits[0].float(), -1)[len(req.prompt) - 1:-1]     # [new, V]
        assert len(events) == len(req.tokens) == 10
        for j, (tok, (chosen, top)) in enumerate(events):
            assert chosen == pytest.approx(ref[j, tok].item(), abs=1e-4)
            assert len(top) == req.logprobs
            if top:
                values, ids = ref[j].topk(req.logprobs)
                assert [i for i, _ in top] == ids.tolist()
                assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
                if req.temperature == 0.0:
                    assert top[0][0] == tok           # greedy: the chosen token is the top one


def test_logprobs_values_are_checked_and_the_batch_engine_refuses_them(target):
    engine = PagedEngine(target, None, max_batch=2, block_size=4, token_budget=16)
    for bad in (-1, 21, 2.5):
        with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
            engine.submit(BatchRequest(prompt=[1, 2], max_tokens=2, logprobs=bad))
    with pytest.raises(ValueError, match="paged engine"):
        BatchEngine(target, None, max_batch=2).check(BatchRequest(prompt=[1, 2], max_tokens=2, logprobs=1))
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=2, prompt_logprobs=21))
    with pytest.raises(ValueError, match="paged engine"):
        BatchEngine(target, None, max_batch=2).check(BatchRequest(prompt=[1, 2], max_tokens=2, prompt_logprobs=0))


@pytest.mark.parametrize("preempt", [False, True])
def test_prompt_logprobs_are_the_targets_log_softmax_over_the_prompt(target, preempt):
    """Every prompt token after the first: its raw log-probability and top alternatives, across prefill chunks, though
    the same prompt is already in the prefix cache, and through a preemption; the first event carries them, and
    asking changes no token."""
    prompt = list(range(20, 50))                                             # 30 tokens: 4 chunks of <= 8
    engine = PagedEngine(target, None, max_batch=3, block_size=4, token_budget=8,
                         num_blocks=14 if preempt else None)
    warm = BatchRequest(prompt=prompt, max_tokens=4, temperature=0.0)        # caches the prompt's blocks
    _events(engine, [warm])
    asks = [BatchRequest(prompt=prompt, max_tokens=6, temperature=0.0, prompt_logprobs=3),
            BatchRequest(prompt=list(range(60, 80)), max_tokens=12, temperature=0.0, prompt_logprobs=0)]
    firsts = {}
    for r in asks:
        engine.submit(r)
    while engine.has_work:
        for e in engine.step():
            if e.prompt_logprobs is not None:
                assert e.rid not in firsts                                  # only the first event
                firsts[e.rid] = e.prompt_logprobs
        engine.blocks.check()
    if preempt:
        assert engine.counters["preemptions"] > 0
    assert asks[0].tokens == warm.tokens + asks[0].tokens[4:]               # greedy: the same continuation
    for req in asks:
        with torch.no_grad():
            ref = torch.log_softmax(target(torch.tensor([req.prompt])).logits[0].float(), -1)[:-1]   # [P - 1, V]
        got = firsts[req.rid]
        assert len(got) == len(req.prompt) - 1
        for j, (chosen, top) in enumerate(got):
            assert chosen == pytest.approx(ref[j, req.prompt[j + 1]].item(), abs=1e-4)
            assert [i for i, _ in top] == ref[j].topk(req.prompt_logprobs).indices.tolist()
