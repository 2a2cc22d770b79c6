"""Trained draft heads on the paged engine (engine/paged/head.py), CPU, fp32 tiny models: greedy tokens are
target-only decoding's (batched, prompts of many lengths, prefix hits, preemption, pricing, head+ngram), every
draft's law equals the head recomputed over the whole sequence from transformers' hidden states (what the decoder's
head drafter computes), the sequence law at T > 0 is the target's (a planted q mismatch fails the same G-test), and
the engine choice takes heads, their dynamic trees and sampled chains, while a draft model's chains stay refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine.batching import BatchRequest
from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.drafters.trees import tree_drafter, tree_shape
from tilespec.engine.paged import head as paged_head
from tilespec.engine.paged.engine import PagedEngine
from tilespec.engine.paged.pricing import DraftGate
from tilespec.engine.paged.support import choose_engine, paged_reason
from tilespec.exactness.stats import fit_test
from tilespec.heads import DraftHead, config_for
from tilespec.verify.types import SamplingParams

import test_batching_heads
from engine_models import exact_sequence_law, serve_in_two_waves, tiny_lm
from tiers import fast_first

trained = test_batching_heads.trained       # a 4-layer qwen2 target, a head trained on it (draft vocabulary 96)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9], [3, 4], list(range(20, 41)), [40, 41, 40, 41, 40] * 3,
           list(range(60, 77)) + [7, 7]]
SETTINGS = dict(max_batch=4, gamma=3, block_size=4, pricing=False)


def _asks(prompts, temperature, max_tokens: int = 14) -> list:
    return [BatchRequest(prompt=p, max_tokens=max_tokens, temperature=float(temperature(i)), seed=100 + i)
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def target_only(trained):
    target = trained[0]
    return serve_in_two_waves(PagedEngine(target, None, max_batch=4, block_size=4), _asks(PROMPTS * 2, lambda i: 0))


@pytest.mark.parametrize("case", fast_first(["plain", "preempted", "priced", "with-ngram", "folder"], 3))
def test_greedy_tokens_equal_target_only(trained, target_only, case):
    """T = 0, two waves of the prompts (the second finds the first's blocks in the prefix cache): the paged engine
    drafting with the head gives target-only's tokens; on a small pool (preemptions), priced, as head+ngram, and with
    the head loaded from its folder."""
    target, head, folder, _ = trained
    draft = {"with-ngram": HeadDrafter(head, context="ngram"), "folder": str(folder) + "+ngram"}.get(
        case, HeadDrafter(head))
    kwargs = {"preempted": dict(num_blocks=22, token_budget=24), "priced": dict(pricing=True)}.get(case, {})
    engine = PagedEngine(target, draft, **{**SETTINGS, **kwargs})
    assert isinstance(engine.drafts, paged_head.PagedHead)
    assert serve_in_two_waves(engine, _asks(PROMPTS * 2, lambda i: 0)) == target_only
    assert engine.counters["drafted"] > 0 and engine.counters["accepted"] > 0
    assert (engine.counters["preemptions"] > 0) == (case == "preempted")
    assert engine.blocks.hits > 0


def reference_q(target, head, tokens: list, drafts: list) -> torch.Tensor:
    """The head's draft logits [N] (its draft vocabulary; q over V is their fixed scatter) after ``tokens`` (the
    last one pending) and the step's earlier ``drafts``, recomputed from scratch as the decoder's head drafter
    computes them: transformers' hidden states of tokens[:-1], the head's entries over every position (SDPA, a
    contiguous cache), then one drafted entry per earlier draft (its feature the head's own output)."""
    n, cap = len(tokens) - 1, len(tokens) - 1 + len(drafts)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens[:n]]), output_hidden_states=True)
        feats = head.fuse(torch.cat([out.hidden_states[i] for i in head.cfg.feature_layers], dim=-1))
        k, v = head.new_cache(1, cap, "cpu", torch.float32)
        mask = (torch.arange(cap)[None] <= torch.arange(n)[:, None])[None, None]
        h = head.entries(feats, torch.tensor([tokens[1:]]), torch.arange(n)[None], mask, torch.tensor(0), k, v)
        h = h[:, -1]
        for j, d in enumerate(drafts):
            slot = n + j
            mask = (torch.arange(cap) <= slot)[None, None, None]
            h = head.entries(h[:, None], torch.tensor([[d]]), torch.tensor([[slot]]), mask, torch.tensor(slot),
                             k, v)[:, 0]
        return head.logits(h)[0]


@pytest.fixture
def law_checked(monkeypatch, trained):
    """Every head draft's logits checked against :func:`reference_q` over the request's tokens and the step's
    earlier drafts: the paged feature and head caches hold exactly the request's context."""
    target, head = trained[0], trained[1]
    seen, sample, earlier = {"rows": 0, "err": 0.0}, paged_head.PagedHead._sample, {}

    def checked(self, small, seqs, seeds, positions):
        out = sample(self, small, seqs, seeds, positions)
        for i, seq in enumerate(seqs):
            prior = earlier.setdefault(id(seq), [])
            if int(positions[i]) == len(seq.tokens):         # the step's first draft
                prior.clear()
            want = reference_q(target, head, seq.tokens, prior)
            seen["rows"] += 1
            seen["err"] = max(seen["err"], float((want - small[i]).abs().max()))
            prior.append(int(out[i]))
        return out

    monkeypatch.setattr(paged_head.PagedHead, "_sample", checked)
    return seen


@pytest.mark.parametrize("case", ["plain", "preempted", "priced", "piecewise"])
def test_drafts_follow_the_heads_full_recompute(trained, law_checked, case):
    """Greedy and sampled requests twice over (prefix hits: entries recomputed from cached features), on a small
    pool (preemptions: recomputed again), priced (the draft gate leaves the head idle: long catch-ups over features
    that overlapped steps wrote), and with steps padded to their shapes, mixed ones run piece by piece
    (piecewise.py writes the features)."""
    target, head = trained[0], trained[1]
    kwargs = {"preempted": dict(num_blocks=22, token_budget=24), "priced": dict(pricing=True)}.get(case, {})
    engine = PagedEngine(target, HeadDrafter(head), **{**SETTINGS, "max_batch": 6, **kwargs})
    if case == "piecewise":
        engine.fixed_shapes = engine.model.piecewise = True
    if case == "priced":        # single-step explorations: in these short requests the gate turns the head off soon
        engine.gate = DraftGate(stretch=1)
    serve_in_two_waves(engine, _asks(PROMPTS * 2, lambda i: i % 2, max_tokens=12))
    assert law_checked["rows"] > 30 and law_checked["err"] < 1e-4, law_checked
    assert engine.counters["accepted"] > 0 and (engine.counters["preemptions"] > 0) == (case == "preempted")
    assert (engine.counters["steps_overlapped"] > 0) == (case == "priced")
    assert bool(engine.model._pieces) == (case == "piecewise")


VOCAB, LENGTH, SAMPLES, PROMPT = 6, 4, 4000, [1, 4, 2, 1, 4, 3, 5, 1, 4]
LAW = SamplingParams(temperature=1.0, top_k=4)


@pytest.fixture(scope="module")
def law_pair():
    """A sharp 6-token target and a random head over a reduced draft vocabulary (q = 0 outside it), as
    tests/test_heads.py builds one, with the target's exact law of 3-token continuations."""
    torch.set_num_threads(1)
    target = tiny_lm(10, vocab=VOCAB, logit_scale=6.0)
    head = DraftHead(config_for(target, draft_vocab=4), vocab_ids=torch.tensor([0, 2, 3, 5]))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    head.bind(target).eval().requires_grad_(False)
    return target, head, exact_sequence_law(target, LAW, PROMPT, VOCAB, LENGTH)


def _law_p(pair) -> float:
    target, head, law = pair
    engine = PagedEngine(target, HeadDrafter(head), max_batch=256, gamma=2, block_size=16, pricing=False,
                         eos_token_id=[])        # the prompt within a block: its twins are admitted together
    out = engine.generate([PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=LAW, seed=2024)
    assert 0.1 < out.stats.accepted / out.stats.drafted < 0.9        # accept and reject paths both exercised
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), law)
    return 0.0 if result.impossible else result.p_value


def test_sequence_law_is_the_targets(law_pair):
    """4000 sampled continuations (T = 1, top-k 4, gamma 2) against the target's exact law: G-test."""
    assert _law_p(law_pair) > 1e-4


def test_a_planted_q_mismatch_fails_the_law_test(law_pair, monkeypatch):
    """The same test with verify() told a sharper q than the drafts were sampled from (the head's logits doubled)
    must fail: the test has the power to see a wrong q."""
    run = paged_head.PagedHead.run
    monkeypatch.setattr(paged_head.PagedHead, "run", lambda self, *a: (lambda q: None if q is None else 2 * q)(
        run(self, *a)))
    assert _law_p(law_pair) < 1e-4


def test_the_paged_engine_takes_heads_and_their_trees_and_refuses_a_draft_models_chains(trained):
    from engine_models import layer_skip
    from tilespec.engine.drafters import resolve_drafter
    target, head = trained[0], trained[1]
    trees = [tree_drafter(HeadDrafter(head), tree_shape(*shape), SamplingParams(), "constant")
             for shape in (((2, 2, 4), None), (None, (2, 2)))]
    for draft in (HeadDrafter(head), HeadDrafter(head, context="ngram"), "head", "head+ngram", *trees):
        assert paged_reason(target, draft) is None, draft
    assert choose_engine(target, "head", "auto", "batch") == "paged"
    assert all(choose_engine(target, t, "auto", "batch") == "paged" for t in trees)   # test_paged_head_trees.py
    chains = tree_drafter(resolve_drafter(layer_skip(target, 1)), tree_shape(None, (2, 2)), SamplingParams(),
                          "constant")
    assert "drafts a token tree the paged engine has no runner for" in paged_reason(target, chains)
    assert choose_engine(target, chains, "auto", "batch") == "batch"
    with pytest.raises(ValueError, match="token tree.*BatchEngine"):
        PagedEngine(target, chains)
    engine = PagedEngine(target, HeadDrafter(head), max_batch=2, gamma=3, block_size=4, num_blocks=8)
    assert engine.drafts.features.shape == (8 * 4, head.cfg.hidden) and engine.model.feature_layers
    with pytest.raises(ValueError, match="trained head"):       # its sampled drafts cannot be cut to a grammar
        engine.check(BatchRequest(prompt=[1], max_tokens=2, grammar=("json_object", "")))
    assert PagedEngine(target, None, max_batch=2, block_size=4).model.feature_layers == ()     # no head: no capture
