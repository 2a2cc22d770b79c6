"""The tree sampler (tilespec.multidraft.tree): tree structure helpers, greedy = longest argmax path, exact law of the
emitted sequence for every tree kind and scheme (tree_exactness; 1e5 samples here, 1e6 behind the slow marker), the
planted-bias power check, reproducible keyed randomness, and clear errors for malformed trees."""
from __future__ import annotations

import itertools

import pytest
import torch

from tilespec.multidraft.tree import TokenTree, ancestors, depths, select_tree
from tilespec.multidraft.tree_exactness import run_tree_exactness, summary_ok, tree_case
from tilespec.verify import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PARENTS = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, -1], [-1, 0, 1, 2, -1, -1, -1, -1]])
SIZES = torch.tensor([7, 4])


def test_ancestors_and_depths_of_ragged_trees():
    anc = ancestors(PARENTS)
    assert depths(PARENTS).tolist() == [[0, 1, 1, 2, 2, 2, 3, 0], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert anc[0, 6].nonzero().squeeze(1).tolist() == [0, 1, 3, 6]
    assert anc[0, 5].nonzero().squeeze(1).tolist() == [0, 2, 5]
    assert anc[1, 3].nonzero().squeeze(1).tolist() == [0, 1, 2, 3]
    assert anc[1, 5].nonzero().squeeze(1).tolist() == [5]          # padding sees only itself


def _tree(tokens, kind="distinct", probs=None):
    return TokenTree(parents=PARENTS, tokens=torch.tensor(tokens), sizes=SIZES, kind=kind, draft_probs=probs)


def test_greedy_follows_the_longest_argmax_path():
    v = 6
    tokens = [[0, 1, 2, 3, 4, 5, 2, 0], [0, 3, 4, 1, 0, 0, 0, 0]]
    logits = torch.zeros(2, 8, v)
    # request 0: argmax after the root is 2 (node 2), after node 2 it is 5 (node 5), after node 5 it is 1 (bonus)
    logits[0, 0, 2] = logits[0, 2, 5] = logits[0, 5, 1] = 5.0
    # request 1: the chain 3 -> 4 -> 0 matches twice, then the target wants 2 where the draft says 1
    logits[1, 0, 3] = logits[1, 1, 4] = logits[1, 2, 2] = 5.0
    sel = select_tree(_tree(tokens), logits, sampling=SamplingParams(temperature=0.0))
    assert sel.num_accepted.tolist() == [2, 2]
    assert sel.path.tolist() == [[0, 2, 5, -1], [0, 1, 2, -1]]
    assert sel.output_tokens.tolist() == [[2, 5, 1, -1], [3, 4, 2, -1]]


def test_selection_is_reproducible_and_keyed_by_seed():
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 6)
    tree = _tree([[0, 1, 2, 3, 4, 5, 2, 0], [0, 3, 4, 1, 0, 0, 0, 0]])
    a = select_tree(tree, logits, seed=[5, 6], offsets=[10, 3])
    b = select_tree(tree, logits, seed=[5, 6], offsets=[10, 3])
    assert torch.equal(a.output_tokens, b.output_tokens) and torch.equal(a.path, b.path)
    many = {tuple(select_tree(tree, logits, seed=s).output_tokens[0].tolist()) for s in range(40)}
    assert len(many) > 3


@pytest.mark.parametrize("kind", ["distinct", "iid"])
def test_a_depth_cap_is_the_tree_without_its_deeper_nodes(kind):
    """depth_cap [B] (the engine caps trees near a request's token limit) selects exactly as the tree whose nodes
    deeper than the cap are padding: same paths and tokens for every seed."""
    torch.manual_seed(1)
    v = 6
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5, 2, 0], [0, 3, 4, 1, 0, 0, 0, 0]])
    logits = torch.randn(2, 8, v)
    probs = torch.softmax(torch.randn(2, 8, v, dtype=torch.float64), -1) if kind == "iid" else None
    full = TokenTree(parents=PARENTS, tokens=tokens, sizes=SIZES, kind=kind, draft_probs=probs)
    pruned_parents = PARENTS.clone()
    pruned_parents[0, 3:] = -1
    pruned_parents[1, 3:] = -1
    pruned = TokenTree(parents=pruned_parents, tokens=tokens, sizes=torch.tensor([3, 3]), kind=kind,
                       draft_probs=probs)
    cap = torch.tensor([1, 2])
    for seed in range(30):
        a = select_tree(full, logits, seed=seed, offsets=[4, 9], depth_cap=cap)
        b = select_tree(pruned, logits, seed=seed, offsets=[4, 9])
        assert torch.equal(a.output_tokens[:, :3], b.output_tokens) and (a.output_tokens[:, 3:] == -1).all()
        assert torch.equal(a.path[:, :3], b.path) and (a.num_accepted <= cap).all()


def test_distinct_tree_law_1e5_samples_with_filters():
    r = tree_case("2-2-1", "distinct", "rrs", SamplingParams(temperature=0.8, top_k=3, top_p=0.95), 100_000, 1e-6, 7)
    assert r.passed, r


def test_iid_schemes_and_planted_bias():
    for scheme in ("specinfer", "spectr", "is"):
        r = tree_case("chains-K2-L2", "iid", scheme, SamplingParams(), 20_000, 1e-6, 8)
        assert r.passed, r
    r = tree_case("3-wide", "distinct", "rrs", SamplingParams(), 20_000, 1e-6, 9, duplicate=True, ragged=True)
    assert r.passed, r
    planted = tree_case("2-2-1", "distinct", "rrs", SamplingParams(), 20_000, 1e-6, 10, planted=True)
    assert not planted.passed and planted.min_p_value < 1e-12


@pytest.mark.parametrize("shape", ["chains-K2-L2", "sampled-2x2"])
def test_static_iid_selection_is_the_dynamic_one_token_for_token(shape):
    """Told the trees' depth and width, iid selection runs without a host sync (capturable) and makes the very
    same draws: every scheme it takes, both samplers, ragged trees, filters, identical or per-parent laws."""
    from tilespec.multidraft.tree_exactness import _ragged, build_trees, shape_bounds, tables
    logits, draft = tables()
    gen = torch.Generator().manual_seed(0)
    bounds = shape_bounds(shape)
    for scheme, sampler, ragged, identical in itertools.product(("sd", "specinfer", "spectr"), ("cdf", "gumbel"),
                                                                (False, True), (True, False)):
        if scheme == "spectr" and not identical:
            continue                                    # spectr needs identical drafts
        ctx = torch.randint(0, logits.shape[0], (300,), generator=gen)
        tree = build_trees(shape, "iid", ctx, draft, gen)
        tree = _ragged(tree, gen) if ragged else tree
        tree.identical = identical
        kw = dict(sampling=SamplingParams(temperature=0.8, top_k=3, top_p=0.95), scheme=scheme,
                  seed=torch.arange(300) * 3 + 1, offsets=torch.arange(300) % 7, sampler=sampler)
        a = select_tree(tree, logits[tree.tokens.clamp(min=0)].float(), **kw)
        b = select_tree(tree, logits[tree.tokens.clamp(min=0)].float(), **kw, **bounds)
        width = a.output_tokens.shape[1]
        assert torch.equal(a.num_accepted, b.num_accepted), (scheme, sampler, ragged)
        assert torch.equal(a.output_tokens, b.output_tokens[:, :width]), (scheme, sampler, ragged)
        assert torch.equal(a.path, b.path[:, :width]) and bool((b.output_tokens[:, width:] == -1).all())
    with pytest.raises(ValueError, match="host"):
        from tilespec.multidraft.schemes import select
        select("is", torch.ones(1, 4) / 4, torch.ones(1, 2, 4) / 4, torch.zeros(1, 2, dtype=torch.long),
               None, validate=False, static=True)


def test_static_iid_selection_law_with_filters_on_ragged_trees():
    r = tree_case("chains-K2-L2", "iid", "specinfer", SamplingParams(temperature=0.8, top_k=3, top_p=0.95), 20_000,
                  1e-6, 12, ragged=True, static=True, sampler="cdf")
    assert r.passed and r.case.endswith(("-p0.95",)) and "-static" in r.case, r


@pytest.mark.slow
def test_tree_exactness_suite_1e6():
    results = run_tree_exactness(1_000_000, alpha=1e-6, seed=11)
    assert summary_ok(results), [(r.case, r.method, r.passed, r.min_p_value) for r in results]


def test_bad_trees_are_refused_clearly():
    logits = torch.zeros(2, 8, 6)
    with pytest.raises(ValueError, match="parent"):
        bad = PARENTS.clone()
        bad[0, 3] = 5
        select_tree(TokenTree(parents=bad, tokens=torch.zeros(2, 8, dtype=torch.long), sizes=SIZES), logits)
    with pytest.raises(ValueError, match="tokens must lie"):
        select_tree(_tree([[0, 1, 2, 3, 4, 9, 2, 0], [0] * 8]), logits)
    with pytest.raises(ValueError, match="draft_probs"):
        select_tree(_tree([[0] * 8, [0] * 8], kind="iid"), logits)
    with pytest.raises(ValueError, match="NaN"):
        select_tree(_tree([[0] * 8, [0] * 8]), torch.full((2, 8, 6), float("nan")))
    with pytest.raises(ValueError, match="nodes"):
        select_tree(_tree([[0] * 8, [0] * 8]), torch.zeros(2, 7, 6))
    with pytest.raises(ValueError, match="lenience"):
        select_tree(_tree([[0] * 8, [0] * 8]), logits, sampling=SamplingParams(lenience=0.5))
    with pytest.raises(ValueError, match="sizes"):
        select_tree(TokenTree(parents=PARENTS, tokens=torch.zeros(2, 8, dtype=torch.long),
                              sizes=torch.tensor([9, 4])), logits)


def test_uniform_tables_are_the_streams_numbers():
    from tilespec.multidraft.common import Stream
    from tilespec.multidraft.tree import TableStream, uniform_tables
    seeds, offs = torch.tensor([3, 99]), torch.tensor([5, 40])
    acc, smp = uniform_tables(seeds, offs, 3, 4)
    for t in range(3):
        plain = Stream(seeds, offs + t, "cdf")
        table = TableStream(seeds, offs + t, acc[:, t], smp[:, t], "cdf")
        for k in range(4):
            assert torch.equal(plain.accept(k), table.accept(k))
        w = torch.rand(2, 9, generator=torch.Generator().manual_seed(t)).double()
        assert torch.equal(plain.sample(w), table.sample(w))
        assert torch.equal(plain.subset(torch.tensor([1])).accept(2), table.subset(torch.tensor([1])).accept(2))


def test_check_exactness_cli_runs_the_tree_suite(tmp_path):
    import json

    from tilespec.cli import main
    out = tmp_path / "tree.json"
    assert main(["check", "exactness", "--method", "tree", "--samples", "3000", "--no-power-check",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 10 and all(r["method"].startswith("tree:") and r["passed"] for r in rows)
    assert any(not r["exact_method"] for r in rows)                  # the planted sampler, caught


def test_bad_static_bounds_are_refused_clearly():
    logits = torch.zeros(2, 8, 6)
    tree = _tree([[0] * 8, [0] * 8])
    for bad in ({"max_width": -1}, {"max_depth": 2.5}, {"max_width": True}):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            select_tree(tree, logits, **bad)
