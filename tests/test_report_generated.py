"""REPORT.md is the report generator's output (``python -m bench.report``): its table of contents links every
section to an anchor that exists, and regenerating it from ``bench/results/`` gives the committed file."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.report.build import anchor, build_report, table_of_contents

ROOT = Path(__file__).resolve().parents[1]


def test_contents_link_each_section_once_with_github_anchors():
    lines = ["# Title", "", "## Table 1 — accuracy, Δ% (γ)", "```", "# a comment, not a heading", "```",
             "### detail", "## Table 1 — accuracy, Δ% (γ)", "# Methods"]
    assert table_of_contents(lines) == [
        "## Contents", "",
        "- [Table 1 — accuracy, Δ% (γ)](#table-1--accuracy-δ-γ)",
        "- [Table 1 — accuracy, Δ% (γ)](#table-1--accuracy-δ-γ-1)",
        "- [Methods](#methods)", ""]
    assert anchor("Our Δ% against the paper's") == "our-δ-against-the-papers"


def test_committed_report_contents_resolve():
    text = (ROOT / "REPORT.md").read_text()
    lines = text.splitlines()
    start = lines.index("## Contents")
    links = [line.split("](#", 1)[1].rstrip(")") for line in lines[start + 2:] if line.lstrip().startswith("- [")]
    end = start + 2 + len(links)
    anchors = [row.split("](#", 1)[1].rstrip(")") for row in table_of_contents(lines[:start] + lines[end + 1:])[2:-1]]
    assert links and links == anchors
    assert "![" in text        # the plots stand inline beside their tables


@pytest.mark.slow
def test_committed_report_is_the_generators_output(tmp_path, monkeypatch):
    """~2-4 minutes on 2 cores (ROUGE and bootstrap intervals over every committed run)."""
    monkeypatch.chdir(ROOT)
    text = build_report(Path("bench/results"), tmp_path / "REPORT.md", tmp_path / "figures")
    assert text.replace("](figures/", "](bench/results/eval-figures/") == (ROOT / "REPORT.md").read_text()
