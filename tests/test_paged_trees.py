"""Token trees on the paged engine (engine/paged/tree.py), CPU, fp32 tiny models: context trees (the tree form of
ngram) give target-only decoding's greedy tokens with and without prefix caching, under mixed arrival, cancellation
and preemption; oracle trees whose accepted path sits on a later branch (so its K/V are moved inside the blocks)
too, with each emitted token's logprobs the target's; seeded sampled tokens do not depend on the batch; the sequence
law at T > 0 is the target's (a wrong selection fails the same G-test); every block comes back; the engine choice
takes context trees and still refuses a head's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchRequest
from tilespec.engine.drafters import resolve_drafter
from tilespec.engine.drafters.context_tree import trie
from tilespec.engine.drafters.trees import tree_drafter, tree_shape
from tilespec.engine.paged import tree as paged_tree
from tilespec.engine.paged.engine import PagedEngine
from tilespec.engine.paged.support import choose_engine, paged_reason
from tilespec.exactness.stats import fit_test
from tilespec.multidraft.tree_distinct import select_distinct
from tilespec.verify.types import SamplingParams

from engine_models import exact_sequence_law, no_eos_lm, serve_in_two_waves, tiny_lm
from tiers import fast_first

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3], list(range(20, 54)), [40, 41, 40, 41, 40] * 4,
           list(range(20, 44)) + [7, 7], [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]]
MAX_TOKENS = 12


def context_tree(shape=(3, 3, 8), base="ngram"):
    return tree_drafter(resolve_drafter(base), tree_shape(shape, None), SamplingParams(), "constant")


@pytest.fixture(scope="module")
def target():
    return no_eos_lm()


@pytest.fixture(scope="module")
def greedy_reference(target):
    return SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0)).generate(
        PROMPTS, max_new_tokens=MAX_TOKENS).sequences


def _asks(temperature: float = 0.0, **kw) -> list:
    return [BatchRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=temperature, seed=100 + i, **kw)
            for i, p in enumerate(PROMPTS)]


class Spy:
    """Counts the tree rows verified and the accepted path nodes that sat off their depth's index (moved K/V)."""

    def __init__(self, monkeypatch):
        self.trees = self.moved = 0
        compact = paged_tree.TreeVerify._compact

        def spy(engine_trees, sampling, trees, paths, emitted):
            self.trees += len(trees)
            self.moved += sum(p[j] != j for p, k in zip(paths, emitted) for j in range(1, k))
            return compact(engine_trees, sampling, trees, paths, emitted)
        monkeypatch.setattr(paged_tree.TreeVerify, "_compact", spy)


@pytest.mark.parametrize("prefix_caching,base,deterministic,pricing", fast_first([
    (True, "ngram", False, False), (True, "suffix", False, False), (True, "ngram", False, True),
    (False, "ngram", False, False), (True, "ngram", True, False)], 3))
def test_greedy_tokens_equal_target_only(target, greedy_reference, monkeypatch, prefix_caching, base,
                                         deterministic, pricing):
    """Mixed arrival (a request alone, one cancelled, then two waves), chunked prefills beside tree rows; the
    deterministic mode (the attention kernel's tree variant in Triton's interpreter); pricing on (the draft gate)."""
    spy = Spy(monkeypatch)
    engine = PagedEngine(target, context_tree(base=base), max_batch=3, gamma=3, block_size=8, token_budget=24,
                         prefix_caching=prefix_caching, pricing=pricing, deterministic=deterministic)
    assert engine.trees is not None and engine.gamma == 7 and engine.depth == 3
    reqs = _asks()
    cancelled = BatchRequest(prompt=list(range(60, 90)), max_tokens=5, temperature=0.0)
    engine.submit(reqs[0])
    engine.step()
    engine.submit(cancelled)
    engine.step()
    engine.cancel(cancelled.rid)
    assert serve_in_two_waves(engine, reqs[1:]) == greedy_reference[1:]
    assert reqs[0].tokens == greedy_reference[0]
    assert engine.counters["accepted"] > 0 and spy.trees > 0
    assert all(r.finish_reason == "length" for r in reqs)


def test_preemption_changes_no_token(target, greedy_reference):
    """A pool far too small for the batch and its trees: requests are preempted and recomputed, tokens unchanged."""
    engine = PagedEngine(target, context_tree(), max_batch=7, gamma=3, block_size=8, num_blocks=12, token_budget=64,
                         pricing=False)
    assert serve_in_two_waves(engine, reqs := _asks()) == greedy_reference
    assert engine.counters["preemptions"] > 0 and engine.counters["accepted"] > 0
    assert all(len(r.tokens) == MAX_TOKENS for r in reqs)


class OracleState(paged_tree.TreeState):
    """Proposes a decoy chain first and the target's greedy continuation second, with a wrong leaf hanging off the
    latter's first node: the accepted path is nodes 4, 5, 6 of 8 (the decoy holds 1 .. 3), so every accepted
    draft's K/V moves, across block edges too."""

    def __init__(self, prompt, shape, reference: dict):
        super().__init__(prompt, shape)
        self.prompt, self.reference = list(prompt), reference

    def propose(self, row: int, cap: int) -> list:
        done = len(self.history) - len(self.prompt)
        true = self.reference[tuple(self.prompt)][done:done + cap]
        if not true:
            self.parents = [-1]
            return []
        decoy = [(t + 1) % 128 for t in true]
        self.parents, tokens = trie(self.history[-1], [decoy, true, [true[0], (true[0] + 5) % 128]], 8)
        return tokens[1:]


@pytest.fixture
def oracle(monkeypatch, greedy_reference):
    reference = {tuple(p): r for p, r in zip(PROMPTS, greedy_reference)}
    monkeypatch.setattr(paged_tree.PagedTrees, "start",
                        lambda self, prompts: OracleState(prompts[0], self.shape, reference))
    return Spy(monkeypatch)


def test_an_accepted_later_branch_is_compacted(target, greedy_reference, oracle):
    engine = PagedEngine(target, context_tree(), max_batch=4, gamma=3, block_size=8, token_budget=48, pricing=False)
    assert serve_in_two_waves(engine, _asks()) == greedy_reference
    assert oracle.moved == engine.counters["accepted"] > 2 * len(PROMPTS)      # every accepted draft was moved


def test_logprobs_of_tree_tokens_are_the_targets(target, greedy_reference, oracle):
    reqs = _asks(logprobs=3)
    engine = PagedEngine(target, context_tree(), max_batch=4, gamma=3, block_size=8, token_budget=48, pricing=False)
    got = {}
    for r in reqs:
        engine.submit(r)
        got[r.rid] = []
    while engine.has_work:
        for e in engine.step():
            got[e.rid] += list(zip(e.tokens, e.logprobs))
    assert oracle.moved > 0
    for req in reqs:
        assert req.tokens == greedy_reference[PROMPTS.index(req.prompt)]
        with torch.no_grad():
            ref = torch.log_softmax(target(torch.tensor([req.prompt + req.tokens])).logits[0].float(), -1)
        ref = ref[len(req.prompt) - 1:-1]
        for j, (tok, (chosen, top)) in enumerate(got[req.rid]):
            assert chosen == pytest.approx(ref[j, tok].item(), abs=1e-4)
            assert [i for i, _ in top] == ref[j].topk(3).indices.tolist() and top[0][0] == tok


def test_sampled_tokens_do_not_depend_on_the_batch(target, monkeypatch):
    """T = 1, per-request seeds, pricing off and room enough: each request's tokens equal those it gets alone."""
    spy = Spy(monkeypatch)
    together = _asks(1.0)
    serve_in_two_waves(PagedEngine(target, context_tree(), max_batch=4, gamma=3, block_size=8, token_budget=256,
                                   pricing=False), together)
    alone = []
    for r in _asks(1.0):
        serve_in_two_waves(PagedEngine(target, context_tree(), max_batch=1, gamma=3, block_size=16, pricing=False),
                           [r])
        alone.append(r.tokens)
    assert [r.tokens for r in together] == alone
    assert spy.trees > 0


VOCAB, LENGTH, SAMPLES, LAW_PROMPT = 6, 4, 4000, [1, 4, 2, 1, 4, 3, 5, 1, 4]
LAW = SamplingParams(temperature=1.0, top_k=4)


@pytest.fixture(scope="module")
def law_target():
    torch.set_num_threads(1)
    target = tiny_lm(10, vocab=VOCAB, logit_scale=6.0)
    return target, exact_sequence_law(target, LAW, LAW_PROMPT, VOCAB, LENGTH)


def _law_p(law_target) -> float:
    """4000 sampled continuations through context trees (the prompt's suffix 1 4 matches twice: two branches)."""
    target, law = law_target
    engine = PagedEngine(target, context_tree((2, 3, 7)), max_batch=256, gamma=3, block_size=16, pricing=False,
                         eos_token_id=[])
    out = engine.generate([LAW_PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=LAW, seed=2024)
    assert 0.1 < out.stats.accepted / out.stats.drafted < 0.9
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), law)
    return 0.0 if result.impossible else result.p_value


def test_sequence_law_is_the_targets(law_target, monkeypatch):
    spy = Spy(monkeypatch)
    assert _law_p(law_target) > 1e-4
    assert spy.moved > 0        # the second branch was accepted: compacted paths are part of the law


def test_a_selection_that_forgets_the_rejected_mass_fails_the_law_test(law_target, monkeypatch):
    """The same test with the tree selection's renormalisation by the rejected siblings' mass dropped (the
    exactness suite's power check for distinct trees) must fail: the test sees a wrong accept rule."""
    def wrong(tree, logits, sampling, seed, offsets, sampler, max_depth, **unused):   # scheme, max_width: iid only
        return select_distinct(tree, logits, None, sampling, seed, offsets, sampler, renormalise=False,
                               max_depth=max_depth)
    monkeypatch.setattr(paged_tree, "select_tree", lambda tree, logits, **kw: wrong(tree, logits, **kw))
    assert _law_p(law_target) < 1e-4


def test_the_engine_choice_takes_context_trees(target):
    for base in ("ngram", "suffix"):
        assert paged_reason(target, context_tree(base=base)) is None
        assert choose_engine(target, context_tree(base=base), "auto", "batch") == "paged"
    with pytest.raises(ValueError, match="gamma 8 must be below block_size 8"):
        PagedEngine(target, context_tree((3, 3, 9)), block_size=8)
    engine = PagedEngine(target, context_tree(), max_batch=2, gamma=2, block_size=8)
    assert engine.depth == 2          # the depth a step may accept: gamma when below the shape's length


def test_requests_with_logit_transforms_draft_no_tree(target):
    """Penalties act on a chain's history: such requests decode without trees beside others that draft them, and
    their tokens are the target-only engine's."""
    from tilespec.verify.logit_transforms import LogitSettings
    settings = LogitSettings(presence_penalty=1.5, frequency_penalty=0.5, min_tokens=3)

    def asks():
        return [BatchRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, logits=settings if i % 2 else None)
                for i, p in enumerate(PROMPTS)]
    trees, plain = asks(), asks()
    engine = PagedEngine(target, context_tree(), max_batch=3, gamma=3, block_size=8, pricing=False)
    serve_in_two_waves(engine, trees)
    serve_in_two_waves(PagedEngine(target, None, max_batch=3, block_size=8), plain)
    assert [r.tokens for r in trees] == [r.tokens for r in plain]
    assert [r.cap for r in trees] == [3 if i % 2 == 0 else 0 for i in range(len(PROMPTS))]
    assert engine.counters["accepted"] > 0


def test_grammar_requests_decode_without_trees_beside_tree_rows():
    """A context-tree engine serves structured outputs: grammar requests draft no tree (the grammar masks a chain's
    positions), their texts are target-only's, and the plain requests beside them draft and verify trees."""
    pytest.importorskip("xgrammar")
    from test_paged_grammar import GRAMMARS, CharTokens, _run, ids
    model = tiny_lm(3, vocab=64, logit_scale=2.0)
    model.generation_config.eos_token_id = None
    prompts = [ids("abab{"), ids("yesyes"), ids("a1a1a1"), ids("[ab][ab]")]

    def asks():
        return [BatchRequest(prompt=p, max_tokens=24, temperature=0.0, grammar=g) for p, g in zip(prompts, GRAMMARS)] \
            + [BatchRequest(prompt=ids("abcabcabcabc"), max_tokens=24, temperature=0.0)]
    engine = PagedEngine(model, context_tree(), max_batch=5, gamma=3, block_size=8, tokenizer=CharTokens(),
                         pricing=False)
    trees, plain = asks(), asks()
    assert _run(engine, trees) == _run(PagedEngine(model, None, max_batch=5, block_size=8, tokenizer=CharTokens()),
                                       plain)
    assert [r.cap for r in trees] == [0, 0, 0, 0, 3] and trees[-1].drafted > 0
