"""Tests of `python -m bench.report` on the committed results and on fake results of every kind (written to tmp only)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.report.build import _warmup_kind, SYNTH_CAVEAT, build_report

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _row(method, metric, value, ms, delta=None, **kw):
    return dict(method=method, examples=4, steps=40, new_tokens=120, verify_time_s=ms * 0.04, verify_step_ms=ms,
                verify_step_ms_std=0.1, wall_time_s=2.0, phase_times_s={"draft": 1.0, "target": 0.5}, alpha=0.5,
                mean_gamma=4.0, peak_memory_bytes=3 * 2**30, verify_bytes=10**9, bandwidth_gbps=25.0,
                delta_profiling_pct=delta, delta_step_pct=delta, delta_wall_pct=delta, identical_to_baseline=1.0,
                warmup={"ks": list(range(0, 21)), "exhaustive": True, "verify_calls": 21}, **{metric: value}, **kw)


def _run(task, dataset, temperature, device="NVIDIA H100 80GB HBM3", **extra):
    metric = "rouge1" if task == "summarization" else "wer"
    methods = {"hf": _row("hf", metric, 0.2, 1.4, 0.0), "tiled": _row("tiled", metric, 0.2, 1.2, 14.0),
               "fused": _row("fused", metric, 0.2, 0.7, 50.0)}
    if temperature > 0:
        methods["sigmoid"] = _row("sigmoid", metric, 0.15, 0.6, 57.0)
    rec = dict(task=task, dataset=dataset, target="tgt", draft="drf", metric=metric, n=4, n_requested=10,
               budget_note="time budget: main comparison on the first 4 of 10 sampled examples", sweep_n=1,
               config=dict(temperature=temperature, dtype="bfloat16", compile="graphs", max_new_tokens=100,
                           schedule="heuristic", gamma=5, max_gamma=20, sweep_schedule="constant"),
               environment=dict(device=device, torch="2.11", transformers="5.17", triton="3.6", commit="abc1234",
                                date="2026-11-22"),
               methods=methods, stages_done=["main"])
    rec.update(extra)
    return rec


def _sweep(methods=("hf", "tiled", "fused", "sigmoid")):
    return {m: {str(g): dict(verify_step_ms=0.5 + 0.01 * g, peak_memory_bytes=(3000 + g) * 2**20, alpha=0.5)
                for g in (1, 5, 10, 20)} for m in methods}


def test_report_on_fake_results_of_every_kind(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    runs = [
        _run("summarization", "xsum", 1.0, gamma_sweep=_sweep(),
             acceptance={m: {str(g): dict(alpha=0.4, verify_step_ms=1.0) for g in (3, 5, 10, 15)}
                         for m in ("hf", "tiled", "fused", "sigmoid")},
             alphabeta={"examples": 1, "rows": [
                 dict(scale=None, label="baseline", rouge1=0.2, alpha=0.4),
                 dict(scale=1e4, label="-10000 10000", rouge1=0.15, alpha=0.9, delta_profiling_pct=60.0,
                      alpha_inflation=0.5, distortion={"available": True, "tv": 0.2018, "acceptance_inflation": 1.25})]}),
        _run("summarization", "xsum", 0.0),
        _run("asr", "ljspeech", 1.0, gamma_sweep=_sweep(("hf", "fused"))),
        _run("asr", "synthetic", 1.0, note=SYNTH_CAVEAT, synthetic_set=dict(n=64, total_duration_s=443.4,
                                                                             voices=["en-us"], espeak_ng="1.51")),
        dict(task="asr", dataset="ljspeech", config={"temperature": 1.0}, environment={"device": "NVIDIA H100"},
             stages_done=[]),                                                   # a run killed before its main study
    ]
    (res / "eval-H100-2026-11-22.json").write_text(json.dumps({"kind": "eval", "runs": runs}))
    (res / "exactness-H100-x.json").write_text(json.dumps({"samples": 10**6, "alpha": 1e-6, "device": "cuda",
                                                           "results": [{"passed": True}, {"passed": False}]}))
    (res / "e2e-x.json").write_text(json.dumps({"environment": {"device": "H100"}, "results": []}))
    out = tmp_path / "REPORT.md"
    text = build_report(res, out, tmp_path / "figs")
    for needle in ("Table 1", "Table 5", "Table 6", "Table 8", "Tables 2 / 7", "Table 3", "Runs (device",
                   "2.11 / 5.17 / 3.6", "`abc1234`", "4 (of 10)", "time budget", "every K in 0..20",
                   "0.202", "×1.250", "LJSpeech", "1/2 checks passed", "| paper | XSum (10%) |"):
        assert needle in text, needle
    assert text.count(SYNTH_CAVEAT) >= 2 and "NOT LibriSpeech" in text
    for fig in ("fig3-time-per-step", "fig4-peak-memory-text", "fig5-peak-memory-asr"):
        assert (tmp_path / "figs" / f"{fig}.png").is_file()
        assert f"![{fig}]" in text
    # ours, then the paper's rows, in the Table 1 section; one column per measured registry method
    t1 = text[text.index("## Table 1"):text.index("## Table 5")]
    assert "| XSum, T=1, H100 |" in t1 and "| CNN/DM | Llama2 7B / Sheared Llama 1.3B |" in t1 and "+14.0%" in t1
    assert "| baseline | `tiled` | `fused` | `sigmoid` (NOT exact) |" in t1


@pytest.mark.slow   # renders every committed result file (tens of CPU seconds); the fake-results tests cover each section
def test_report_on_committed_results_writes_only_to_tmp(tmp_path):
    if not RESULTS.is_dir():
        pytest.skip("no bench/results")
    before = sorted(p.name for p in RESULTS.rglob("*"))
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy, ignore=shutil.ignore_patterns("eval-figures"))
    text = build_report(copy, tmp_path / "REPORT.md", tmp_path / "figs")
    assert "Table 1" in text and "paper" in text
    assert sorted(p.name for p in RESULTS.rglob("*")) == before                 # nothing written into bench/results
    if any("first-call" in _warmup_kind(r) for r in _gpu_runs(RESULTS)):
        assert "first-call costs" in text                                        # a legacy warm-up is flagged


def _gpu_runs(folder):
    for path in folder.glob("eval-*.json"):
        for run in json.loads(path.read_text()).get("runs", []):
            if run.get("methods") and "cuda" in str(run.get("config", {}).get("device", "")):
                yield run


def test_report_cli(tmp_path, capsys):
    from bench.report.__main__ import main as report_main

    (tmp_path / "res").mkdir()
    assert report_main(["--results", str(tmp_path / "res"), "--out", str(tmp_path / "R.md")]) == 0
    assert "No eval results yet" in (tmp_path / "R.md").read_text()
    with pytest.raises(SystemExit):
        report_main(["--results", str(tmp_path / "missing"), "--out", str(tmp_path / "R.md")])
    assert "--results" in capsys.readouterr().err
