"""tilespec.generate's token-tree keywords (tree=, chains=, scheme=) on the paged engine, CPU, tiny fp32 models:
a context drafter's trees and a head's dynamic trees and sampled chains give target-only decoding's greedy tokens,
and the decoder's tree run's; auto keeps the decoder for what the paged engine cannot run (a draft model's chains,
trees over its limits), engine="paged" refuses those naming the fix; bad shapes fail before any model loads."""
from __future__ import annotations

import pytest

import tilespec
from tilespec.api import pick_engine
from tilespec.engine.drafters import HeadDrafter

from engine_models import tree_models
from test_api import ChatTokenizer

PROMPTS = ["abcabcabc", "sky", "abab abab abab"]


@pytest.fixture(autouse=True)
def paged_on_cpu(monkeypatch):
    """"auto" takes the paged engine on CUDA only (api.paged_by_default); here the rest of its rule runs on CPU."""
    monkeypatch.setattr("tilespec.api.paged_by_default", lambda target: True)


@pytest.fixture(scope="module")
def models():
    return tree_models()


@pytest.fixture(scope="module")
def greedy(models):
    return tilespec.generate(PROMPTS, target=models[0], tokenizer=ChatTokenizer(), max_new_tokens=10,
                             temperature=0.0, engine="decoder").sequences


@pytest.mark.parametrize("case", ["ngram-tree", "suffix-tree", "head-tree", "head-chains", "head-chains-law"])
def test_greedy_tree_tokens_on_the_paged_engine_are_target_only_and_the_decoders(models, greedy, case):
    target, _, head = models
    draft, keywords = {"ngram-tree": ("ngram", dict(tree=(3, 3, 8))), "suffix-tree": ("suffix", dict(tree=(2, 4, 8))),
                       "head-tree": (HeadDrafter(head), dict(tree=(2, 3, 6))),
                       "head-chains": (HeadDrafter(head), dict(chains=(2, 3), scheme="spectr")),
                       "head-chains-law": (HeadDrafter(head), dict(chains=(3, 2), draft_sampling=tilespec.SamplingParams(
                           temperature=1.5)))}[case]
    run = dict(target=target, draft=draft, tokenizer=ChatTokenizer(), max_new_tokens=10, temperature=0.0, **keywords)
    paged = tilespec.generate(PROMPTS, engine="paged", **run)
    auto = tilespec.generate(PROMPTS, **run)
    decoder = tilespec.generate(PROMPTS, engine="decoder", **run)
    assert paged.sequences == auto.sequences == decoder.sequences == greedy
    assert paged.stats.runtime == auto.stats.runtime == "paged" and decoder.stats.runtime != "paged"
    assert paged.stats.drafted > 0 and decoder.stats.drafted > 0


def test_auto_keeps_the_decoder_for_trees_the_paged_engine_cannot_run(models):
    target, draft, head = models
    assert pick_engine(target, HeadDrafter(head), options={"tree": (2, 3, 6)}) == "paged"
    assert pick_engine(target, HeadDrafter(head), options={"chains": (2, 3)}) == "paged"
    for d, options in ((draft, {"chains": (2, 2)}),                       # a draft model's chains: no paged runner
                       (HeadDrafter(head), {"tree": (8, 10, 16)}),         # 9 frontiers of 8 > 64 ancestor bits
                       (HeadDrafter(head), {"chains": (3, 6)}),            # 18 draft nodes > block_size 16
                       ("ngram", {"tree": (1, 40, 41)})):                  # depth 40 > the paged gamma cap
        assert pick_engine(target, d, options=options) == "decoder", options
    assert pick_engine(target, HeadDrafter(head), options={"chains": (3, 6), "block_size": 32}) == "paged"


def test_paged_tree_refusals_name_the_fix(models):
    target, draft, head = models
    tok = ChatTokenizer()
    for kwargs, match in [(dict(draft=draft, chains=(2, 2)), "cannot serve this: .* drafts a token tree .*; use "
                                                              "engine='decoder'"),
                          (dict(draft=HeadDrafter(head), tree=(8, 10, 16)),
                           r"72 frontier entries exceed the 64 ancestor bits .* lower the depth or the width\); use "
                           r"engine='decoder'"),
                          (dict(draft="ngram", tree=(3, 3, 20)), "pass block_size=32 or a tree of at most 16 nodes"),
                          (dict(draft="ngram", tree=(1, 40, 41), block_size=64), "depth 40: .* fewer than 32"),
                          (dict(draft=None, tree=(3, 3, 8)), "tree decoding needs a drafter")]:
        with pytest.raises(ValueError, match=match):
            tilespec.generate("x", target=target, tokenizer=tok, engine="paged", max_new_tokens=2, **kwargs)


def test_bad_tree_values_fail_before_any_model_loads():
    for kwargs, match in [(dict(tree=(1, 1, 1)), r"tree=\(branch, depth, nodes\) needs"),
                          (dict(chains=(0, 3)), r"chains=\(K, L\) needs K, L >= 1"),
                          (dict(chains=(2, 2), scheme="nope"), "nope"),
                          (dict(tree=(2, 2, 4), chains=(2, 2)), "give one of")]:
        for engine in ("auto", "paged"):
            with pytest.raises(ValueError, match=match):
                tilespec.generate("x", target="no-such-model", draft="ngram", engine=engine, **kwargs)
