"""``--tree auto`` on the command line (bench/tree_args.py): ``tilespec generate`` and ``tilespec bench e2e`` reach the
tree shaped from a head's stored per-depth acceptance at the request temperature (or the documented default without
it), record the chosen shape, keep explicit shapes as before, and refuse bad values with a clear error; the tree
benchmark's ``--auto`` row records its shape."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import tilespec.cli.generate as gen
from tilespec.bench import e2e as bench_e2e
from tilespec.bench.e2e_systems import Config, make_decoder
from tilespec.cli import main
from tilespec.bench.tree_args import tree_nodes, tree_option
from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.drafters.tree_choice import DEFAULT_TREE, choose_tree

from engine_models import tiny_lm
from test_engine_cli import ToyTokenizer
from test_tree_choice import _head_with

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
TABLE = {"0": [0.9, 0.85, 0.8, 0.75], "1": [0.35, 0.25, 0.2, 0.1]}   # a confident head at T = 0, an unsure one at 1


@pytest.fixture
def target():
    model = tiny_lm(0, logit_scale=20.0)
    model.generation_config.eos_token_id = None
    return model


def _generate(monkeypatch, tmp_path, target, head, *extra) -> dict:
    monkeypatch.setattr(gen, "load_pair", lambda t, d, device, dtype, log=None: (
        target, HeadDrafter(head) if d == "head" else d, ToyTokenizer()))
    path = tmp_path / "out.json"
    assert main(["generate", "--target", "t", "--prompt", "hello", "--max-new-tokens", "10", "--device", "cpu",
                 "--json", str(path), *extra]) == 0
    return json.loads(path.read_text())


def test_tree_values_parse_and_bad_ones_are_refused(capsys):
    assert tree_nodes("auto") == tree_nodes("AUTO") == "auto" and tree_nodes("32") == 32 and tree_nodes("2") == 2
    for bad in ("foo", "0", "1", "65", "-3", "3.5", ""):
        with pytest.raises(SystemExit) as exit_:     # a usage error: argparse names the flag, status 2
            main(["generate", "--target", "t", "--prompt", "x", "--tree", bad])
        assert exit_.value.code == 2
        assert "argument --tree: expected 'auto' or a node count in [2, 64]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--tree", "foo"])
    assert "argument --tree: expected 'auto'" in capsys.readouterr().err


def test_shape_options_that_contradict_the_tree_fail_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(gen, "load_pair", lambda *a, **k: pytest.fail("loaded a model before checking --tree"))
    for argv, words in ((["--tree", "auto", "--tree-depth", "3"], "--tree auto chooses the branch and depth"),
                        (["--tree-branch", "3"], "--tree-branch shape an explicit tree"),
                        (["--tree", "8", "--chains", "2,3"], "give --tree or --chains, not both")):
        assert main(["generate", "--target", "t", "--prompt", "x", *argv]) == 1
        assert words in capsys.readouterr().err


def test_generate_tree_auto_uses_the_heads_acceptance_at_the_temperature(monkeypatch, tmp_path, target, capsys):
    ar = _generate(monkeypatch, tmp_path, target, None)
    cold = _generate(monkeypatch, tmp_path, target, _head_with(target, TABLE), "--draft", "head", "--tree", "auto")
    branch, depth, nodes = choose_tree(TABLE["0"])
    assert cold["tree"] == {"branch": branch, "depth": depth, "nodes": nodes, "auto": True,
                            "source": "alpha_by_temperature"}
    assert cold["tokens"] == ar["tokens"]           # still exact at T = 0
    assert f"branch {branch}, depth {depth}, {nodes} nodes (auto: chosen from the head's measured acceptance at T=0)" \
        in capsys.readouterr().err
    hot = _generate(monkeypatch, tmp_path, target, _head_with(target, TABLE), "--draft", "head", "--tree", "auto",
                    "--temperature", "1")
    assert (hot["tree"]["branch"], hot["tree"]["depth"], hot["tree"]["nodes"]) == choose_tree(TABLE["1"])
    assert hot["tree"]["depth"] < cold["tree"]["depth"]


def test_generate_tree_auto_without_stored_acceptance_takes_the_default(monkeypatch, tmp_path, target, capsys):
    bare = _generate(monkeypatch, tmp_path, target, _head_with(target, None), "--draft", "head", "--tree", "auto")
    assert (bare["tree"]["branch"], bare["tree"]["depth"], bare["tree"]["nodes"]) == DEFAULT_TREE
    assert bare["tree"]["source"] == "default" and "stores no per-depth acceptance" in capsys.readouterr().err


def test_generate_explicit_shapes_are_unchanged(monkeypatch, tmp_path, target):
    head = _head_with(target, TABLE)          # stored acceptance is ignored when a shape is given
    given = _generate(monkeypatch, tmp_path, target, head, "--draft", "head", "--tree", "8", "--tree-branch", "3",
                      "--tree-depth", "3")
    assert given["tree"] == {"branch": 3, "depth": 3, "nodes": 8, "auto": False, "source": "given"}
    plain = _generate(monkeypatch, tmp_path, target, head, "--draft", "head", "--tree", "8")
    assert (plain["tree"]["branch"], plain["tree"]["depth"], plain["tree"]["nodes"]) == (8, 6, 8)   # the defaults
    chains = _generate(monkeypatch, tmp_path, target, head, "--draft", "head", "--chains", "2,3")
    assert chains["tree"] is None


def _e2e_args(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_e2e.add_arguments(p)
    args = p.parse_args(["--batch", "1", "--temperature", "0,1", "--methods", "reference", "--systems", "tilespec",
                         *argv])
    bench_e2e.check_args(args)
    return args


def test_bench_e2e_configures_and_builds_auto_trees(target):
    auto = _e2e_args(["--tree", "auto"])
    assert tree_option(auto) == "auto"
    assert [c.system for c in bench_e2e.configs(auto, ["xsum"])] == ["tilespec:reference/tree-auto"] * 2
    explicit = _e2e_args(["--tree", "32"])                 # as before: γ = the depth, named by it
    assert tree_option(explicit) == (8, 6, 32)
    assert [c.system for c in bench_e2e.configs(explicit, ["xsum"])] == ["tilespec:reference/g6"] * 2
    with pytest.raises(ValueError, match="--tree auto chooses"):
        _e2e_args(["--tree", "auto", "--tree-branch", "4"])
    for temperature, alphas in ((0.0, TABLE["0"]), (1.0, TABLE["1"])):
        cfg = Config("xsum", temperature, 1, "tilespec", "reference", "native", None, "constant")
        dec = make_decoder(cfg, target, HeadDrafter(_head_with(target, TABLE)), auto)
        assert dec.drafter.shape.tree == choose_tree(alphas) and dec.gamma == choose_tree(alphas)[1]


def test_bench_e2e_rows_record_the_auto_tree(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--prompts", "2", "--temperature", "0", "--max-new-tokens", "5",
                 "--methods", "reference", "--draft", "ngram", "--systems", "ar,ngram", "--tree", "auto",
                 "--out", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    row = rows["ngram:reference/tree-auto"]
    assert "error" not in row and row["greedy_match_ar"] == 1.0
    assert row["tree"] == {"branch": 8, "depth": 6, "nodes": 32, "auto": True, "source": "default"}   # no head
    assert row["gamma"] == 6 and "tree" not in rows["ar"]


def test_tree_benchmark_auto_row_records_the_chosen_shape(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("trees_bench", ROOT / "bench" / "scripts" / "trees.py")
    trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trees)
    monkeypatch.setattr(trees, "_head", lambda args, target: HeadDrafter(_head_with(target, TABLE)))
    out = tmp_path / "trees.json"
    assert trees.main(["--tiny", "--prompts", "1", "--max-new-tokens", "6", "--stage", "t0", "--auto",
                       "--trees", "2,2,3", "--context-trees", "", "--chain-gamma", "2", "--compile", "native",
                       "--json", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ar", "chain-g2", "tree-2-2-3", "tree-auto"}
    assert all("error" not in r for r in rows.values())
    branch, depth, nodes = choose_tree(TABLE["0"])
    assert rows["tree-auto"]["tree"] == {"branch": branch, "depth": depth, "nodes": nodes, "auto": True,
                                         "source": "alpha_by_temperature"}
    assert rows["tree-2-2-3"]["tree"]["source"] == "given" and "tree" not in rows["chain-g2"]
    assert rows["tree-auto"]["same_as_ar"] == rows["tree-auto"]["compared_with_ar"] == 1
