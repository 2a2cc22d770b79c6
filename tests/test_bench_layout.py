"""The split between the installed library (``tilespec.bench``: measure and report) and the repository's top-level
``bench`` package (report generator, studies, paper-scale runs, data makers): the repository's tools are no
``tilespec`` commands, the library runs no study it was not given, and nothing under ``src/tilespec`` imports ``bench``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tilespec.cli import main

SRC = Path(__file__).resolve().parents[1] / "src" / "tilespec"


@pytest.mark.parametrize("argv", [
    ["report", "--results", "bench/results"],
    ["eval", "scale", "xsum-t0", "--res", "x"],
    ["eval", "make-synthetic", "--out", "x"],
    ["bench", "multidraft", "--prompts", "2"],
])
def test_repository_tools_are_no_tilespec_commands(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_library_never_imports_the_repository_package():
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(SRC)}: {n}" for n in names if n.split(".")[0] in ("bench", "benchmarks", "eval")
                          and getattr(node, "level", 0) == 0 or n.startswith("tilespec.eval")]
    assert not offenders, offenders


def test_evaluate_runs_no_study_it_was_not_given():
    from tilespec.bench.config import EvalConfig
    from tilespec.bench.quality import evaluate

    cfg = EvalConfig(methods=("hf",), studies=("main", "gamma"))
    with pytest.raises(ValueError, match="bench.studies"):
        evaluate(cfg, models=(None, None, None), examples=[{"id": "0", "document": "d", "reference": "r"}])


def test_studies_command_builds_the_side_study_settings():
    import argparse

    from bench.studies import STUDIES, add_study_arguments, study_settings
    from tilespec.cli.eval import add_eval_arguments, build_config

    p = argparse.ArgumentParser()
    add_eval_arguments(p, "summarization")
    add_study_arguments(p)
    args = p.parse_args(["--studies", "all", "--sweep-gammas", "1-3", "--scales", "10,1e3"])
    cfg = build_config(args, **study_settings(args))
    assert cfg.studies == ("main", *STUDIES) and cfg.sweep_gammas == (1, 2, 3) and cfg.scales == (10.0, 1e3)
    plain = build_config(p.parse_args([]))            # tilespec eval alone: the main comparison only
    assert plain.studies == ("main",)
