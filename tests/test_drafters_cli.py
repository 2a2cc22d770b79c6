"""``--draft ngram | suffix | MODEL+ngram`` through generate, bench e2e and eval's model loading (tiny models)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tilespec.cli import main
from tilespec.engine.drafters import split_draft_name

from engine_models import layer_skip, tiny_lm
from test_engine_cli import ToyTokenizer


@pytest.fixture
def registry(monkeypatch):
    """tilespec.models.load serving a tiny target ("t") and its 1-layer draft ("t:layers=1")."""
    torch.set_num_threads(1)
    tiny = tiny_lm(0, logit_scale=20.0)
    tiny.generation_config.eos_token_id = None
    loaded = []

    def load(name, role="target", target=None, **kw):
        loaded.append(name)
        return (layer_skip(tiny, 1), None) if role == "draft" else (tiny, ToyTokenizer())

    import tilespec.models as models
    monkeypatch.setattr(models, "load", load)
    return loaded


def test_split_draft_name():
    assert split_draft_name("ngram") == (None, "ngram")
    assert split_draft_name("qwen:layers=4+suffix") == ("qwen:layers=4", "suffix")
    assert split_draft_name("qwen") == ("qwen", None)
    assert split_draft_name("none") == (None, None)
    with pytest.raises(ValueError, match="unknown context drafter 'trigram'"):
        split_draft_name("qwen+trigram")
    with pytest.raises(ValueError, match="names no model"):
        split_draft_name("+ngram")


@pytest.mark.parametrize("draft,loads,name", [("ngram", ["t"], "ngram"), ("suffix", ["t"], "suffix"),
                                              ("t:layers=1+ngram", ["t", "t:layers=1"], "+ngram")])
def test_generate_with_context_drafts(registry, tmp_path, draft, loads, name):
    out = tmp_path / "g.json"
    assert main(["generate", "--target", "t", "--draft", draft, "--prompt", "abcabcabcabc", "--max-new-tokens", "16",
                 "--temperature", "0", "--json", str(out)]) == 0
    stats = json.loads(out.read_text())["stats"]
    assert registry == loads and stats["drafter"].endswith(name) and stats["new_tokens"] == 16
    assert stats["context_steps"] >= 1 and 0 <= stats["match_share"] <= 1


def test_generate_rejects_an_unknown_context_drafter(registry, capsys):
    assert main(["generate", "--target", "t", "--draft", "t+trigram", "--prompt", "x"]) == 1
    assert "unknown context drafter 'trigram'" in capsys.readouterr().err


def test_bench_e2e_with_ngram_draft(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--draft", "ngram", "--num-prompts", "2", "--batch-sizes", "1",
                 "--temperatures", "0", "--max-new-tokens", "6", "--methods", "reference", "--systems",
                 "ar,tilespec,hf-assisted,hf-prompt-lookup", "--out", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert "hf-assisted" not in rows and "error" not in rows["hf-prompt-lookup"]   # no draft model to assist with
    spec = rows["tilespec:reference/g5"]
    assert spec["drafter"] == "ngram" and spec["greedy_match_ar"] == 1.0


def test_eval_loads_context_drafts(monkeypatch):
    from tilespec.bench.config import EvalConfig
    from tilespec.bench.quality import load_models

    calls = []

    def load(name, role="target", target=None, **kw):
        calls.append((name, role))
        return (tiny_lm(1), None)

    monkeypatch.setattr("tilespec.models.load", load)
    _, draft, _ = load_models(EvalConfig(draft="ngram", methods=("hf",)))
    assert draft == "ngram" and calls == [("qwen2.5-coder-1.5b-instruct", "target")]
    _, draft, _ = load_models(EvalConfig(draft="qwen2.5-coder-0.5b-instruct+suffix", methods=("hf",)))
    assert isinstance(draft, list) and draft[1] == "suffix" and hasattr(draft[0], "config")


def test_demo_times_both_modes_in_pairs_and_reports_the_speedup_or_the_noise(registry, tmp_path, capsys):
    """Real (noisy) timings of a tiny model: a ratio with its interval, or "not measured" with the noise measured;
    scripted series for both verdicts: test_demo_measure.py."""
    out = tmp_path / "demo.json"
    assert main(["demo", "--target", "t", "--prompt", "abcabcabcabcabc", "--max-new-tokens", "12", "--repeats", "4",
                 "--json", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(("speedup ", "speedup not measured: ")) and last.endswith("outputs identical: yes")
    rec = json.loads(out.read_text())
    assert rec["draft"] == "ngram" and rec["outputs_identical"] is True and rec["new_tokens"] == 12
    assert 1 <= len(rec["target_only_seconds"]) == len(rec["speculative_seconds"]) <= len(rec["pairs"]) <= 4
    ratios = [p["ratio"] for p in rec["pairs"] if p["counted"]]
    if rec["verdict"] == "measured":
        assert len(ratios) >= 2 and rec["speedup"] == pytest.approx(math.prod(ratios) ** (1 / len(ratios)))
    else:
        assert rec["speedup"] is None and rec["noise"] in last


def test_eval_main_study_with_an_ngram_draft():
    from test_eval import DOCS, ToyTokenizer as WordTokenizer, small_cfg
    from tilespec.bench.quality import evaluate

    torch.set_num_threads(1)
    target = tiny_lm(0, logit_scale=4.0)
    rec = evaluate(small_cfg(methods=("hf", "reference"), draft="ngram", max_new_tokens=8), log=lambda *a: None,
                   models=(target, "ngram", WordTokenizer()), examples=DOCS)
    rows = rec["methods"]
    assert {r["drafter"] for r in rows.values()} == {"ngram"}
    assert rows["reference"]["identical_to_baseline"] == 1.0 and rows["hf"]["steps"] > 0
