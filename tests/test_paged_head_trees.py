"""A trained head's dynamic token trees on the paged engine (engine/paged/head_tree.py), CPU, fp32 tiny models:
greedy tokens are target-only decoding's (prefix hits, no prefix caching, preemption); every proposed tree is the
decoder's propose_tree over the head recomputed from scratch on the request's context; seeded sampled tokens do not
depend on the batch; the T = 1 sequence law is the target's; every block comes back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.drafters.head_tree import propose_tree
from tilespec.engine.drafters.trees import tree_drafter, tree_shape
from tilespec.engine.paged import head_tree as paged_head_tree
from tilespec.engine.paged import tree as paged_tree
from tilespec.engine.paged.engine import PagedEngine
from tilespec.exactness.stats import fit_test
from tilespec.verify.types import SamplingParams

import test_batching_heads
import test_paged_head
from engine_models import serve_in_two_waves
from test_paged_head import LAW, LENGTH, PROMPT as LAW_PROMPT, PROMPTS, SAMPLES, VOCAB, _asks, reference_q
from tiers import fast_first

trained = test_batching_heads.trained       # a 4-layer qwen2 target, a head trained on it (draft vocabulary 96)
target_only = test_paged_head.target_only   # its greedy tokens of the prompts twice over, target-only
law_pair = test_paged_head.law_pair         # a sharp 6-token target, a random head, the exact sequence law
SETTINGS = dict(max_batch=4, gamma=3, block_size=16, pricing=False)


def head_tree(head, shape=(3, 3, 10), chains=None, scheme="specinfer"):
    """The head's dynamic trees of ``shape``, or its ``chains`` = (K, L) sampled chains verified by ``scheme``."""
    return tree_drafter(HeadDrafter(head), tree_shape(None if chains else shape, chains, scheme), SamplingParams(),
                        "constant")


class Spy:
    """Records each drafted tree (the request's tokens, parents, node tokens) and counts moved path nodes."""

    def __init__(self, monkeypatch):
        self.trees, self.moved = [], 0
        run, compact = paged_head_tree.PagedHeadTrees.run, paged_tree.TreeVerify._compact

        def spied_run(runner, items, sampling, prev=None):
            out = run(runner, items, sampling, prev)
            self.trees += [(list(it.seq.tokens), it.seq.req, list(it.seq.context.parents), list(it.seq.drafts))
                           for it in items if it.samples and it.seq.drafts]
            return out

        def spied_compact(runner, sampling, trees, paths, emitted):
            self.moved += sum(p[j] != j for p, k in zip(paths, emitted) for j in range(1, k))
            return compact(runner, sampling, trees, paths, emitted)
        monkeypatch.setattr(paged_head_tree.PagedHeadTrees, "run", spied_run)
        monkeypatch.setattr(paged_tree.TreeVerify, "_compact", spied_compact)


@pytest.mark.parametrize("case", fast_first(["plain", "chains", "preempted", "no-prefix-cache"], 3))
def test_greedy_tokens_equal_target_only(trained, target_only, monkeypatch, case):
    """Dynamic trees of 10 nodes (and 2 sampled chains of 3: 7 nodes, greedy chains are the head's argmax)."""
    target, head = trained[0], trained[1]
    spy = Spy(monkeypatch)
    kwargs = {"preempted": dict(num_blocks=5, token_budget=64), "no-prefix-cache": dict(prefix_caching=False)}
    drafter = head_tree(head, chains=(2, 3) if case == "chains" else None)
    engine = PagedEngine(target, drafter, **{**SETTINGS, **kwargs.get(case, {})})
    assert isinstance(engine.drafts, paged_head_tree.PagedHeadTrees) and engine.depth == 3
    assert engine.gamma == (6 if case == "chains" else 9)
    assert serve_in_two_waves(engine, _asks(PROMPTS * 2, lambda i: 0)) == target_only
    assert engine.counters["accepted"] > 0 and spy.trees and spy.moved > 0
    assert (engine.counters["preemptions"] > 0) == (case == "preempted")


class DenseHead:
    """The head over a contiguous cache [1, H_kv, C, D], as the decoder's head runner drives it (``entries``)."""

    def __init__(self, head, k, v):
        self.head, self.k, self.v = head, k, v

    def entries(self, feat, tokens, positions, mask, write_pos):
        return self.head.entries(feat, tokens, positions, mask, write_pos, self.k, self.v)


def _reference_tree(target, head, tokens: list, branch: int, depth: int, nodes: int) -> tuple:
    """propose_tree as the decoder runs it, from the head recomputed over the whole context: transformers' hidden
    states of tokens[:-1], the head's entries at every position (a contiguous cache) -> (parents, tokens)."""
    n, slots = len(tokens) - 1, max((depth - 1) * branch, 1)
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens[:n]]), output_hidden_states=True)
        feats = head.fuse(torch.cat([out.hidden_states[i] for i in head.cfg.feature_layers], dim=-1))
        k, v = head.new_cache(1, n + slots, "cpu", torch.float32)
        mask = (torch.arange(n + slots)[None] <= torch.arange(n)[:, None])[None, None]
        h = head.entries(feats, torch.tensor([tokens[1:]]), torch.arange(n)[None], mask, torch.tensor(0), k, v)
        valid = torch.arange(n + slots)[None] < n
        tree = propose_tree(DenseHead(head, k, v), h[:, -1], torch.tensor([tokens[-1]]), valid,
                            torch.tensor([len(tokens)]), torch.tensor(n), branch, depth, nodes)
    return tree.parents[0].tolist(), tree.tokens[0].tolist()


def test_trees_are_the_decoders_over_the_full_context(trained, monkeypatch):
    """Every tree the paged head drafts (two waves: prefix hits, entries recomputed from cached features; sampled
    and greedy rows) equals propose_tree over the head recomputed from scratch, nodes deeper than the request's
    remaining tokens allow dropped."""
    target, head = trained[0], trained[1]
    spy = Spy(monkeypatch)
    serve_in_two_waves(PagedEngine(target, head_tree(head), **{**SETTINGS, "max_batch": 6}),
                       _asks(PROMPTS * 2, lambda i: i % 2, max_tokens=12))
    assert len(spy.trees) > 30
    ties = 0
    for tokens, req, parents, drafts in spy.trees:
        want_parents, want_tokens = _reference_tree(target, head, tokens, 3, 3, 10)
        cap = min(3, req.max_tokens - (len(tokens) - len(req.prompt)) - 1)
        want_parents, want_tokens = paged_head_tree.within_depth(want_parents, want_tokens, cap)
        assert parents == want_parents
        for m, (got, want) in enumerate(zip(drafts, want_tokens[1:]), start=1):
            if got != want:     # only a tie of the head's law may order two candidates either way
                assert m not in parents, "a swapped node has children"
                ties += 1
                law = torch.log_softmax(reference_q(target, head, tokens, _path(parents, [0] + drafts, m)[:-1]), -1)
                column = {int(t): i for i, t in enumerate(head.vocab_ids)}
                assert abs(float(law[column[got]] - law[column[want]])) < 1e-5
    assert ties <= 2


def _path(parents: list, tokens: list, m: int) -> list:
    """The tokens from depth 1 down to node m."""
    out = []
    while m > 0:
        out.append(tokens[m])
        m = parents[m]
    return out[::-1]


@pytest.mark.parametrize("chains", [None, (2, 3)])
def test_sampled_tokens_do_not_depend_on_the_batch(trained, monkeypatch, chains):
    """T = 1, seeds per request, pricing off, room enough: dynamic trees and sampled chains (their noise keyed by
    seed and position) give each request the tokens it gets alone."""
    target, head = trained[0], trained[1]
    spy = Spy(monkeypatch)
    together = _asks(PROMPTS, lambda i: 1.0)
    serve_in_two_waves(PagedEngine(target, head_tree(head, chains=chains), **{**SETTINGS, "token_budget": 256}),
                       together)
    alone = []
    for r in _asks(PROMPTS, lambda i: 1.0):
        serve_in_two_waves(PagedEngine(target, head_tree(head, chains=chains),
                                       **{**SETTINGS, "max_batch": 1, "block_size": 32}), [r])
        alone.append(r.tokens)
    assert [r.tokens for r in together] == alone and spy.moved > 0


@pytest.mark.parametrize("draft", fast_first([dict(shape=(2, 2, 4)), dict(chains=(2, 2)),
                                               dict(chains=(3, 2), scheme="spectr")], 1))
def test_sequence_law_is_the_targets(law_pair, monkeypatch, draft):
    """4000 sampled continuations (T = 1, top-k 4) through the head's trees of 2 x 2 (4 nodes), 2 sampled chains of
    2 (specinfer) and 3 of 2 (spectr) against the target's exact law: G-test; accepted paths off their depth's index
    (moved K/V and features) among them."""
    target, head, law = law_pair
    spy = Spy(monkeypatch)
    engine = PagedEngine(target, head_tree(head, **draft), max_batch=256, gamma=2, block_size=16, pricing=False,
                         eos_token_id=[])
    out = engine.generate([LAW_PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=LAW, seed=2024)
    per_tree = engine.counters["accepted"] / engine.counters["spec_steps"]
    assert 0.05 < per_tree < 1.8 and spy.moved > 0       # accepts and rejects: drafts accepted per tree of depth 2
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), law)
    assert not result.impossible and result.p_value > 1e-4, result


def test_sampled_chains_told_a_wrong_law_fail_the_law_test(law_pair, monkeypatch):
    """The chains' law test with select_tree told a sharper draft law than the chains were sampled from (each
    node's law squared, renormalised) must fail: the test sees a wrong q in the multi-draft selection."""
    target, head, law = law_pair
    propose = paged_head_tree.propose_chains

    def sharper(*args):
        tree = propose(*args)
        probs = tree.draft_probs ** 2
        tree.draft_probs = probs / probs.sum(-1, keepdim=True)
        return tree
    monkeypatch.setattr(paged_head_tree, "propose_chains", sharper)
    engine = PagedEngine(target, head_tree(head, chains=(2, 2)), max_batch=256, gamma=2, block_size=16,
                         pricing=False, eos_token_id=[])
    out = engine.generate([LAW_PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=LAW, seed=2024)
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), law)
    assert result.impossible or result.p_value < 1e-4, result


def test_frontiers_past_the_mask_bits_are_refused(trained):
    """Each frontier forward feeds every frontier so far as new tokens: (depth - 1) x branch must fit 64 bits."""
    with pytest.raises(ValueError, match="64 ancestor bits"):
        PagedEngine(trained[0], head_tree(trained[1], (33, 3, 12)), **SETTINGS)
