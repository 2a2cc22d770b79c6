"""``tilespec serve --tree B,D,N`` / ``--chains K,L`` (``--scheme``): the parser's shapes and refusals, the spec the
CLI spawns the engine with (no torch imported first), and make_engine's choice with token trees, CPU, tiny fp32
models: context and head trees on the paged engine (target-only greedy tokens), a head's trees over the paged limits
on BatchEngine, and a clear error where neither engine can serve the trees."""
from __future__ import annotations

import re

import pytest

from tilespec.cli import build_parser, main
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.paged import PagedEngine
from tilespec.engine.paged.head_tree import PagedHeadTrees
from tilespec.engine.paged.tree import PagedTrees
from tilespec.serve import make_engine

from engine_models import serve_in_two_waves, tree_models
from test_serve_startup import _fresh

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [3], [40, 41, 40, 41, 40] * 3]


def _serve(*extra: str):
    return build_parser("serve").parse_args(["serve", "--target", "tiny", *extra])


def test_the_parser_takes_tree_and_chains_shapes():
    assert _serve("--tree", "4,4,16").tree == (4, 4, 16) and _serve("--tree", "12").tree == (8, 6, 12)
    args = _serve("--chains", "2, 3", "--scheme", "spectr")
    assert args.chains == (2, 3) and args.scheme == "spectr" and args.tree is None
    assert _serve().tree is None and _serve().chains is None and _serve().scheme is None


@pytest.mark.parametrize("extra, message", [
    (["--tree", "4,4"], "argument --tree: expected B,D,N"),
    (["--tree", "4,x,16"], "argument --tree: expected B,D,N"),
    (["--tree", "0,4,16"], "needs branch, depth >= 1 and 2 <= nodes <= 64"),
    (["--tree", "4,4,65"], "needs branch, depth >= 1 and 2 <= nodes <= 64"),
    (["--tree", "auto"], "a server serves every temperature: give B,D,N"),
    (["--chains", "2"], "argument --chains: expected K,L"),
    (["--chains", "8,8"], r"1 \+ K L <= 64 nodes"),
    (["--tree", "4,4,16", "--chains", "2,2"], "not allowed with argument"),
])
def test_bad_shapes_are_argparse_errors(capsys, extra, message):
    with pytest.raises(SystemExit):
        _serve(*extra)
    assert re.search(message, capsys.readouterr().err)


def test_a_scheme_without_chains_is_refused_before_anything_starts(capsys):
    assert main(["serve", "--target", "tiny", "--scheme", "spectr", "--port", "1"]) == 1
    assert "--scheme selects among sampled chains: add --chains K,L" in capsys.readouterr().err


def test_an_unknown_scheme_fails_in_the_checks_after_the_spawn():
    from tilespec.cli.serve import torch_checks
    torch_checks(_serve("--chains", "2,2", "--scheme", "is-lp"))
    with pytest.raises(ValueError, match="unknown multi-draft scheme 'nope'"):
        torch_checks(_serve("--chains", "2,2", "--scheme", "nope"))


def test_the_cli_spawns_the_engine_with_the_tree_options():
    """As tests/test_serve_startup.py's spawn stub: the spec carries the shapes to make_engine, a tree without
    --draft drafts with the head (as ``tilespec generate --tree``), and torch is still not imported."""
    code = ("import socket, sys\n"
            "import tilespec.serve.processes as processes\n"
            "def spawn(spec, api_servers=1, marks=None):\n"
            "    o = spec.options\n"
            "    assert 'torch' not in sys.modules\n"
            "    print(spec.load.draft, o['tree'], o['chains'], o['scheme'])\n"
            "    raise SystemExit(0)\n"
            "processes.EngineProcess = spawn\n"
            "with socket.socket() as s:\n"
            "    s.bind(('127.0.0.1', 0))\n"
            "    port = s.getsockname()[1]\n"
            "from tilespec.cli import main\n"
            "main(['serve', '--target', 'tiny', '--port', str(port), *sys.argv[1:]])\n")
    for extra, want in ((["--draft", "ngram", "--tree", "3,3,8"], "ngram (3, 3, 8) None specinfer"),
                        (["--chains", "2,3", "--scheme", "is"], "head None (2, 3) is")):
        out = _fresh(code, *extra)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


@pytest.fixture(scope="module")
def models():
    return tree_models()


def _asks() -> list:
    return [BatchRequest(prompt=p, max_tokens=8, temperature=0.0, seed=i) for i, p in enumerate(PROMPTS)]


def test_make_engine_serves_trees_on_the_paged_engine_with_target_only_tokens(models):
    target, _, head = models
    greedy = serve_in_two_waves(make_engine(target, None, max_batch=4), _asks())
    for draft, shape, runner, gamma in (("ngram", dict(tree=(3, 3, 8)), PagedTrees, 7),
                                        ("suffix", dict(tree=(2, 4, 8)), PagedTrees, 7),
                                        (HeadDrafter(head), dict(tree=(2, 3, 6)), PagedHeadTrees, 5),
                                        (HeadDrafter(head), dict(chains=(2, 3), scheme="spectr"), PagedHeadTrees, 6)):
        engine = make_engine(target, draft, max_batch=4, pricing=False, **shape)
        assert isinstance(engine, PagedEngine) and isinstance(engine.drafts, runner), shape
        depth = shape["tree"][1] if "tree" in shape else shape["chains"][1]      # the decoder's γ of a tree step
        assert engine.gamma == gamma and engine.depth == depth
        assert engine.scheduler.token_budget == 512 + 4 * (1 + gamma)       # room for every row's nodes + a chunk
        assert serve_in_two_waves(engine, _asks()) == greedy and engine.counters["drafted"] > 0


def test_trees_over_the_paged_limits(models):
    target, draft, head = models
    greedy = serve_in_two_waves(make_engine(target, None, max_batch=4), _asks())
    engine = make_engine(target, HeadDrafter(head), max_batch=4, tree=(8, 10, 16))   # 9 frontiers of 8 > 64 bits
    assert isinstance(engine, BatchEngine) and engine.gamma == 10
    reqs = _asks()
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    assert [list(r.tokens) for r in reqs] == greedy and sum(r.drafted for r in reqs) > 0
    with pytest.raises(ValueError, match=r"72 frontier entries .*; use --engine batch"):
        make_engine(target, HeadDrafter(head), engine="paged", tree=(8, 10, 16))
    for d, shape, why in (("ngram", dict(tree=(3, 3, 20)), "19 draft nodes"),
                          (draft, dict(chains=(2, 2)), "drafts a token tree the paged engine has no runner for")):
        with pytest.raises(ValueError, match=f"cannot serve the token trees of .*: BatchEngine runs only a head's.*{why}"):
            make_engine(target, d, max_batch=4, **shape)
