"""Draft models on the paged engine (engine/paged/draft_model.py), CPU, fp32 tiny models: every draft is sampled from
the draft model's own law given the request's tokens (its paged K/V caught up, shared through the prefix cache,
recomputed after preemption), greedy tokens are target-only decoding's and the decoder's, seeded sampled tokens do
not depend on the batch, the sequence law is the target's (a planted q mismatch fails the same G-test), and every
block comes back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchRequest
from tilespec.engine.paged import draft_model
from tilespec.engine.paged.engine import PagedEngine
from tilespec.engine.paged.support import paged_reason
from tilespec.exactness.stats import fit_test
from tilespec.verify.types import SamplingParams

import test_paged_engine
from engine_models import exact_sequence_law, layer_skip, serve_in_two_waves, tiny_lm

target, greedy_reference, PROMPTS = test_paged_engine.target, test_paged_engine.greedy_reference, test_paged_engine.PROMPTS

SETTINGS = dict(max_batch=4, gamma=3, block_size=4, pricing=False)


@pytest.fixture(scope="module")
def draft(target):
    return layer_skip(target, 1)


def _asks(temperature: float, max_tokens: int = 12, prompts=PROMPTS) -> list:
    return [BatchRequest(prompt=p, max_tokens=max_tokens, temperature=temperature, seed=100 + i)
            for i, p in enumerate(prompts)]


@pytest.fixture
def law_checked(monkeypatch, draft):
    """Every draft token's logits checked against a full forward of the draft model over the request's tokens and
    the step's earlier drafts: the paged draft cache holds exactly the request's context."""
    seen, sample = {"rows": 0, "err": 0.0}, draft_model.PagedDrafts._sample
    earlier: dict = {}

    def checked(self, logits, seqs, seeds, positions):
        out = sample(self, logits, seqs, seeds, positions)
        for i, seq in enumerate(seqs):
            prior = earlier.setdefault(id(seq), [])
            if int(positions[i]) == len(seq.tokens):         # the step's first draft
                prior.clear()
            with torch.no_grad():
                want = draft(torch.tensor([seq.tokens + prior])).logits[0, -1].float()
            seen["rows"] += 1
            seen["err"] = max(seen["err"], float((want - logits[i]).abs().max()))
            prior.append(int(out[i]))
        return out

    monkeypatch.setattr(draft_model.PagedDrafts, "_sample", checked)
    return seen


@pytest.mark.parametrize("case", ["plain", "preempted", "priced", "no-prefix-cache", "with-ngram"])
def test_drafts_follow_the_draft_models_law_and_greedy_tokens_are_target_only(target, draft, greedy_reference,
                                                                             law_checked, case):
    """Greedy and sampled requests twice over (prefix hits), on a small pool (preemptions), priced (the draft gate
    leaves drafts idle: catch-up of many tokens), without the prefix cache, and as MODEL+ngram."""
    kwargs = {"preempted": dict(num_blocks=20, token_budget=24), "priced": dict(pricing=True),
              "no-prefix-cache": dict(prefix_caching=False)}.get(case, {})
    engine = PagedEngine(target, [draft, "ngram"] if case == "with-ngram" else draft,
                         **{**SETTINGS, "max_batch": 6, **kwargs})
    reqs = [BatchRequest(prompt=p, max_tokens=12, temperature=float(i % 2 == 0), seed=i)
            for i, p in enumerate(PROMPTS * 2)]
    tokens = serve_in_two_waves(engine, reqs)
    assert [t for i, t in enumerate(tokens) if i % 2] == [t for i, t in enumerate(greedy_reference * 2) if i % 2]
    assert law_checked["rows"] > 20 and law_checked["err"] < 1e-4
    assert engine.counters["drafted"] > 0 and engine.counters["accepted"] > 0
    assert (engine.counters["preemptions"] > 0) == (case == "preempted")
    assert (engine.blocks.hits > 0) == (case != "no-prefix-cache")


def test_greedy_tokens_equal_the_decoders_draft_model_path(target, draft, greedy_reference):
    ref = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams(temperature=0.0)).generate(
        PROMPTS, max_new_tokens=12).sequences
    assert ref == greedy_reference
    engine = PagedEngine(target, draft, **{**SETTINGS, "token_budget": 16})
    assert serve_in_two_waves(engine, _asks(0.0)) == ref
    out = PagedEngine(target, draft, max_batch=3, gamma=3, block_size=4).generate(
        PROMPTS, max_new_tokens=12, sampling=SamplingParams(temperature=0.0))      # priced, offline
    assert out.sequences == ref and out.stats.drafter


def test_sampled_tokens_do_not_depend_on_the_batch_or_the_prefix_cache(target, draft):
    """T = 1, per-request seeds, unpriced with room enough (each request verifies as many drafts per step whatever
    else runs): its tokens alone, in a batch, and with its prompt's blocks from the prefix cache (the draft's K/V
    from another request's prefill) are the same."""
    prompts = PROMPTS + [PROMPTS[3], PROMPTS[5]]              # two prompts twice: prefix hits
    together = serve_in_two_waves(PagedEngine(target, draft, **{**SETTINGS, "token_budget": 256}), _asks(1.0, 10, prompts))
    uncached = PagedEngine(target, draft, **{**SETTINGS, "token_budget": 256, "prefix_caching": False})
    assert serve_in_two_waves(uncached, _asks(1.0, 10, prompts)) == together
    alone = []
    for r in _asks(1.0, 10, prompts):
        alone += serve_in_two_waves(PagedEngine(target, draft, **{**SETTINGS, "max_batch": 1, "block_size": 8}), [r])
    assert alone == together


def test_overlap_with_a_draft_model_gives_the_synchronous_tokens(target, draft):
    """Requests that never draft (gamma 0) step overlapped while no drafting request runs; drafting steps are
    synchronous; the tokens are the synchronous engine's."""
    def asks():
        reqs = [BatchRequest(prompt=p, max_tokens=10, temperature=float(i % 2), seed=i, gamma=0)
                for i, p in enumerate(PROMPTS)]
        return reqs + [BatchRequest(prompt=[5, 6, 7], max_tokens=10, temperature=1.0, seed=9)]
    runs = {}
    for overlap in (False, True):
        engine = PagedEngine(target, draft, **SETTINGS, overlap=overlap, max_admission_wait=0.0)
        reqs = asks()
        for r in reqs[:-1]:
            engine.submit(r)
        for _ in range(6):                      # nobody drafts yet: overlapped steps
            engine.step()
        serve_in_two_waves(engine, reqs[-1:])               # the drafting request joins
        runs[overlap] = [r.tokens for r in reqs], engine.counters
    assert runs[True][0] == runs[False][0]
    assert runs[False][1]["steps_overlapped"] == 0 < runs[True][1]["steps_overlapped"]
    assert runs[True][1]["drafted"] > 0


def test_the_paged_engine_takes_llama_family_drafts_of_the_targets_vocabulary(target, draft):
    assert paged_reason(target, draft) is None and paged_reason(target, [draft, "ngram"]) is None
    assert "vocabulary" in paged_reason(target, tiny_lm(1, vocab=96, layers=1))
    engine = PagedEngine(target, draft, max_batch=2, gamma=3, block_size=4, num_blocks=8)
    assert engine.drafts.model.num_blocks == engine.blocks.num_blocks        # one block id: a slot in both caches
    with pytest.raises(ValueError, match="BatchEngine"):
        PagedEngine(target, tiny_lm(1, vocab=96, layers=1))


VOCAB, LENGTH, SAMPLES, PROMPT = 6, 3, 3000, [1, 4]
LAW = SamplingParams(temperature=0.8, top_k=4)


@pytest.fixture(scope="module")
def law_pair():
    torch.set_num_threads(1)
    model = tiny_lm(10, vocab=VOCAB, logit_scale=3.0)
    return model, tiny_lm(11, vocab=VOCAB, layers=1, logit_scale=3.0), exact_sequence_law(
        model, LAW, PROMPT, VOCAB, LENGTH)


def _law_p(pair) -> float:
    model, small, law = pair
    engine = PagedEngine(model, small, max_batch=256, gamma=2, block_size=4, pricing=False, eos_token_id=[])
    out = engine.generate([PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=LAW, seed=12345)
    assert 0.3 < out.stats.accepted / out.stats.drafted < 0.9        # accept and reject paths both exercised
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), law)
    return 0.0 if result.impossible else result.p_value


def test_sequence_law_is_the_targets(law_pair):
    """3000 sampled continuations (T = 0.8, top-k 4, gamma 2) against the exact law of the target: G-test."""
    assert _law_p(law_pair) > 1e-4


def test_a_planted_q_mismatch_fails_the_law_test(law_pair, monkeypatch):
    """The same test with verify() told a sharper q (the draft logits doubled: the law at half the temperature the
    drafts were sampled at) must fail: the test has the power to see a wrong q."""
    run = draft_model.PagedDrafts.run
    monkeypatch.setattr(draft_model.PagedDrafts, "run", lambda self, *a: (lambda q: None if q is None else 2 * q)(
        run(self, *a)))
    assert _law_p(law_pair) < 1e-4
