"""The head's tree shape chosen from per-depth acceptance (drafters/tree_choice.py) and its wiring into the decoder:
deeper trees for a head that is accepted often, shallow chain-like ones for one that is not, deterministic, bad
input refused, the head's ``alpha_by_temperature`` used at the sampling temperature unless a shape is given, and
the outputs still token-identical to target-only greedy decoding."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.drafters.tree_choice import (DEFAULT_TREE, alphas_for_temperature, choose_tree,
                                                  head_tree_shape, verify_cost)
from tilespec.engine.drafters.head_tree import tree_candidates
from tilespec.engine.tree_decoder import TreeDecoder
from tilespec.verify import SamplingParams

from engine_models import tiny_lm
from test_tree_decoder import VOCAB, _random_head

pytestmark = pytest.mark.usefixtures("one_thread")


def test_high_acceptance_gets_deeper_larger_trees_and_low_a_short_chain():
    high = choose_tree([0.9, 0.85, 0.8, 0.8, 0.75, 0.7])
    mid = choose_tree([0.6] * 6)
    low = choose_tree([0.2] * 6)
    assert high[1] > mid[1] > low[1] and high[2] >= mid[2] > low[2]   # deeper, and at least as many nodes
    assert high[1] > low[1] and low[1] <= 2 and low[0] <= 2       # shallow, (nearly) a chain
    assert mid[0] > 1                                             # siblings pay where the top-1 is often missed
    for branch, depth, nodes in (high, mid, low):                 # shapes the builder accepts
        assert 2 <= nodes <= 64 and nodes - 1 <= tree_candidates(branch, depth)
    assert choose_tree([0.0] * 4) == (1, 1, 2)


def test_the_choice_is_deterministic_and_follows_the_cost_of_width():
    alphas = [0.8, 0.7, 0.7, 0.6]
    assert choose_tree(alphas) == choose_tree(list(alphas)) == choose_tree(tuple(alphas))
    cheap = choose_tree(alphas, cost_table={1: 1.0, 64: 1.05})     # width almost free: more nodes
    dear = choose_tree(alphas, cost_table={1: 1.0, 2: 1.3, 64: 4.0})
    assert cheap[2] > dear[2]
    assert verify_cost(16, {1: 1.0, 32: 1.31}) == pytest.approx(1.15)
    measured = choose_tree([0.5] * 4, coverage=[[0.5, 0.9, 0.95]] * 4)   # the target's token is often second
    assert measured[0] >= 2


@pytest.mark.parametrize("bad", [[], [1.2], [-0.1, 0.5], [float("nan")], "0.5", [0.5, "x"], None])
def test_bad_alphas_are_refused(bad):
    with pytest.raises(ValueError, match="alphas"):
        choose_tree(bad)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_nodes"):
        choose_tree([0.5], max_nodes=100)
    with pytest.raises(ValueError, match="head_cost"):
        choose_tree([0.5], head_cost=-1.0)
    with pytest.raises(ValueError, match="cost_table"):
        choose_tree([0.5], cost_table={0: 1.0, 4: 1.2})


def test_alphas_at_the_running_temperature():
    table = {"0": [0.9, 0.8], "1": [0.5, 0.4], "0.7": [0.7, 0.6]}
    assert alphas_for_temperature(table, 0.0) == [0.9, 0.8]
    assert alphas_for_temperature(table, 0.85) == pytest.approx([0.6, 0.5])
    assert alphas_for_temperature(table, 1.5) == [0.5, 0.4]
    assert head_tree_shape({}, 1.0) == DEFAULT_TREE == head_tree_shape(None, 0.0)
    assert head_tree_shape({"alpha_by_temperature": table}, 0.0) == choose_tree([0.9, 0.8])
    with pytest.raises(ValueError, match="alphas"):
        head_tree_shape({"alpha_by_temperature": {"0": [2.0]}}, 0.0)


def _head_with(target, table):
    from tilespec.heads.store import target_identity
    head = _random_head(target)
    head.manifest = {"target_id": target_identity(target)}
    if table is not None:
        head.manifest["alpha_by_temperature"] = table
    return head


def test_the_decoder_shapes_the_tree_from_the_head_unless_given():
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    table = {"0": [0.9, 0.9, 0.85, 0.8], "1": [0.3, 0.2, 0.2, 0.1]}
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 3)]
    ref = SpeculativeDecoder(target, None, sampling=greedy, compile="native").generate(prompts, max_new_tokens=16)
    dec = TreeDecoder(target, HeadDrafter(_head_with(target, table)), sampling=greedy, eos_token_id=[],
                      compile="native")
    chosen = choose_tree(table["0"])
    assert dec.drafter.shape.tree == chosen and dec.gamma == chosen[1]
    assert dec.generate(prompts, max_new_tokens=16).sequences == ref.sequences     # still exact
    at_one = TreeDecoder(target, HeadDrafter(_head_with(target, table)), sampling=hot, compile="native")
    assert at_one.drafter.shape.tree == choose_tree(table["1"]) and at_one.gamma < dec.gamma
    given = TreeDecoder(target, HeadDrafter(_head_with(target, table)), sampling=greedy, tree=(2, 2, 3))
    assert given.drafter.shape.tree == (2, 2, 3)                  # an explicit shape wins
    bare = TreeDecoder(target, HeadDrafter(_head_with(target, None)), sampling=greedy)
    assert bare.drafter.shape.tree == DEFAULT_TREE                # no stored acceptance: today's default
