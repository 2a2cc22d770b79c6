"""REPORT.md's opening summary, from fabricated result files written to tmp_path only."""
from __future__ import annotations

import json

from bench.report.build import build_report, load_results
from bench.report.summary import TITLE, summary_section

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "transformers": "5.17", "commit": "abc1234",
       "date": "2026-11-24T10:00:00+00:00"}


def _write(folder, name, doc):
    (folder / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))


def _row(system, kind, tps, t=0.0, b=1, task="xsum", **kw):
    return dict(dict(task=task, system=system, kind=kind, temperature=t, batch_size=b, requests=4,
                     tokens_per_second=tps), **kw)


def _new_layout():
    """The bench helper's layout: kind/task per row, hf-static, context drafters, speedups recorded."""
    runs = [dict(new_tokens=100, wall_time=0.5), dict(new_tokens=100, wall_time=0.25)]  # 200 and 400 tok/s
    rows = [_row("hf", "hf", 20.0), _row("hf-static", "hf-static", 100.0), _row("hf-assisted", "hf-assisted", 50.0),
            _row("hf-prompt-lookup", "hf-prompt-lookup", 80.0), _row("ar@auto", "ar", 250.0, runtime="native-graphs"),
            _row("ar", "ar", 60.0),
            _row("tilespec:fused/g3@auto", "tilespec", 300.0, runs=runs, runtime="native-graphs", drafter="Qwen2",
                 match_share=0.0),   # a model drafter: drafter / match share not shown
            _row("tilespec:fused/g5@auto", "tilespec", 280.0),
            _row("ngram:fused/g5@auto", "ngram", 400.0, drafter="ngram", match_share=0.42),
            {"task": "xsum", "system": "suffix:fused/g5@auto", "kind": "suffix", "temperature": 0.0,
             "batch_size": 1, "error": "RuntimeError: boom"},
            _row("tilespec:fused/g3@auto", "tilespec", 900.0, b=8), _row("ar@auto", "ar", 800.0, b=8),
            _row("ar@auto", "ar", 200.0, t=1.0), _row("tilespec:fused/g3@auto", "tilespec", 150.0, t=1.0)]
    settings = dict(target="tgt-1.5b", draft="drf-0.5b", num_prompts=190, max_new_tokens=128, task="xsum")
    return {"environment": ENV, "settings": settings, "results": rows}


def _results(tmp_path):
    _write(tmp_path, "e2e-new-2026-11-24.json", _new_layout())
    old = {"environment": dict(ENV, gpu="NVIDIA H200", date="2026-11-21T10:00:00"),
           "settings": dict(target="tgt-1.5b", num_prompts=4, max_new_tokens=48, dataset="xsum"),
           "results": [_row("hf", None, 999.0, task=None)]}
    _write(tmp_path, "e2e-older-2026-11-21.json", old)                       # same target, older: not summarized
    _write(tmp_path, "e2e-asr-2026-11-21.json",                              # old layout: no kind/task
           {"environment": dict(ENV, date="2026-11-21T10:00:00"),
            "settings": dict(target="whisper-base", whisper=True, num_prompts=8, max_new_tokens=96),
            "results": [_row("ar@graphs", None, 500.0, task=None),
                        _row("tilespec:fused@graphs", None, 200.0, task=None), _row("hf", None, 25.0, task=None)]})
    _write(tmp_path, "e2e-random-2026-11-25.json", {"environment": ENV, "settings": dict(target="tgt-1.5b",
           random_init=True), "results": [_row("ar@graphs", None, 7777.0)]})
    _write(tmp_path, "native-forward-random-init-H100-2026-11-23.json", {
        "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-23", "weights": "random-init (timing only)",
        "models": {"m-1.5b": {"floor_ms_at_3TBps": 1.0, "forwards": [
            {"batch": 1, "q": 1, "graph_replay_ms": 2.5, "forward_call_ms": 2.7},
            {"batch": 1, "q": 4, "graph_replay_ms": 3.0}],
            "engine": [{"batch": 1, "tok_s": 300.0, "runtime": "native-graphs"}, {"batch": 8, "tok_s": 2000.0}],
            "hf_static": [{"batch": 1, "tok_s": 150.0}], "hf_dynamic": [{"batch": 1, "tok_s": 30.0}]}}})
    res = {"fused": {"graph_us": 10.0, "eager_us": 100.0}, "sigmoid": {"graph_us": 8.0, "eager_us": 90.0},
           "hf": {"eager_us": 500.0}, "flashinfer": {"eager_us": 200.0}}
    big = {"fused": {"graph_us": 300.0, "eager_us": 400.0}, "flashinfer": {"eager_us": 1600.0}}
    verify_row = dict(V=151936, dtype="bf16", temperature=1.0, regime="mid", top_k=0)
    _write(tmp_path, "verify-H100-2026-11-21.json", {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-21",
           "rows": [dict(verify_row, B=1, K=5, results=res), dict(verify_row, B=1, K=5, top_k=50, results={}),
                    dict(verify_row, B=64, K=5, results=big), dict(verify_row, B=64, K=1, results={})]})
    _write(tmp_path, "verify-H100-2026-11-22-exp.json", {"date": "2026-11-22", "note": "EXPERIMENT (reverted)",
           "rows": [dict(verify_row, B=1, K=5, results={"fused": {"graph_us": 1.0}})]})
    _write(tmp_path, "exactness-cpu-2026-11-21.json", {"device": "cpu", "samples": 1000, "results": [
        {"method": "fused", "passed": True, "exact_method": True, "min_p_value": 0.3, "max_tv": 0.01},
        {"method": "fused", "passed": False, "exact_method": True, "min_p_value": 1e-9, "max_tv": 0.2},
        {"method": "biased", "passed": True, "exact_method": False}]})
    env = {"device": "NVIDIA H100 80GB HBM3"}
    _write(tmp_path, "eval-H100-2026-11-21.json", {"runs": [
        {"task": "summarization", "dataset": "xsum", "n": 20, "n_requested": 40, "environment": env,
         "config": {"temperature": 1.0}},
        {"task": "summarization", "dataset": "cnndm", "n": 199, "environment": env, "config": {"temperature": 0.0}}]})
    return load_results(tmp_path)


def test_summary_numbers(tmp_path):
    runs, others = _results(tmp_path)
    text = "\n".join(summary_section(runs, others, "fig.png"))
    assert text.startswith(TITLE)
    # (a) new layout: best row per kind at B=1; speedups over the best target-only (250) and hf-static (100)
    assert "`e2e-new-2026-11-24.json` (commit abc1234, 2026-11-24)" in text and "n = 190 prompts" in text
    assert "| xsum | 0 | 1 | transformers static cache | `hf-static` | 100.0 | 0.40× | 1.00× |" in text
    assert ("| xsum | 0 | 1 | tilespec + draft model | `tilespec:fused/g3@auto` (runtime native-graphs) | 300.0 | 1.20× "
            "| 3.00× |") in text
    assert ("| xsum | 0 | 1 | tilespec n-gram | `ngram:fused/g5@auto` (drafter ngram, match 42 %) | 400.0 | 1.60× | "
            "4.00× |") in text
    assert "| xsum | 1 | 1 | tilespec + draft model | `tilespec:fused/g3@auto` | 150.0 | 0.75× | – |" in text
    assert "suffix:fused" not in text   # its only row failed
    assert ("xsum, T=0, B=1: fastest is tilespec n-gram at 400.0 tok/s (1.60× target-only, 4.00× the fastest "
            "transformers system, transformers static cache)") in text
    # old layout (no kind / task): whisper rows are ljspeech; older and random-init files are not summarized
    assert "| ljspeech | 0 | 1 | tilespec + draft model | `tilespec:fused@graphs` | 200.0 | 0.40× | – |" in text
    assert ("ljspeech, T=0, B=1: fastest is tilespec target-only at 500.0 tok/s (20.00× the fastest transformers "
            "system, transformers (dynamic cache)); best speculative: tilespec + draft model `tilespec:fused@graphs` at "
            "200.0 tok/s = 0.40× target-only") in text
    assert "999.0" not in text and "7777" not in text
    assert "⚠ n = 8 prompts" in text and "⚠ n = 190" not in text
    assert "![end-to-end tok/s by system](fig.png)" in text
    # (b) native forward vs floor, labelled random-init
    assert ("Target-only decoding in the same file: m-1.5b B=1: ours 300.0 tok/s (native-graphs) vs transformers "
            "static cache 150.0 tok/s (2.00×).") in text
    assert "random-init weights (timing only)" in text and "m-1.5b 2.50 ms vs floor 1.00 ms (2.50× the floor)" in text
    # (c) verify headline at B=1 and B=64 from the non-experiment file
    assert "`verify-H100-2026-11-21.json`" in text and "-exp.json" not in text
    assert ("B=1, γ=5: fused 10.0 µs (graph) / 100 µs (eager), sigmoid 8.0 µs (graph, NOT exact), transformers "
            "500 µs (eager; fused 5.0× faster eager-vs-eager), FlashInfer 200 µs (eager; fused 2.0× faster") in text
    assert "B=64, γ=5: fused 300.0 µs (graph) / 400 µs (eager)" in text and "transformers not measured" in text
    assert "FlashInfer 1600 µs (eager; fused 4.0× faster" in text
    # (d) exactness: the failure is shown, the power check counted apart
    assert ("fused on cpu: 2/3 checks passed (1/2 exact-method checks, 1/1 planted-bias checks detected) — **1 FAILED**"
            in text)
    # (e) sample sizes and the small-n warning
    # B=8 rows get their own group and headline
    assert "| xsum | 0 | 8 | tilespec target-only | `ar@auto` | 800.0 | 1.00× | – |" in text
    assert "xsum, T=0, B=8: fastest is tilespec + draft model at 900.0 tok/s (1.12× target-only)" in text
    assert "xsum T=1 H100: n = 20 of 40 (partial) ⚠" in text and "cnndm T=0 H100: n = 199." in text
    assert "**1 of 2 run(s) have n < 100**" in text


def test_report_layout_and_figure(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _results(res)
    text = build_report(res, tmp_path / "REPORT.md", tmp_path / "figs")
    heads = [line for line in text.splitlines() if line.startswith("#")]
    order = [next(i for i, h in enumerate(heads) if h.startswith(t)) for t in
             ("## Summary", "## Table 1", "## End-to-end decoding", "## Native forward vs the HBM floor",
              "## Verification kernel at B = 1 and B = 64", "## Exactness suites", "# Methods and raw files",
              "## Runs", "## Other committed results")]
    assert order == sorted(order)
    assert (tmp_path / "figs" / "summary-e2e-tokps.png").stat().st_size > 0
    assert "](figs/summary-e2e-tokps.png)" in text
    assert ("| `native-forward-random-init-H100-2026-11-23.json` | H100 | m-1.5b | 1 | 4 | 3.00 | – | 1.00 | 3.00 |"
            in text)
    assert "| m-1.5b | 1 | 300.0 | native-graphs | 150.0 | 30.0 | 2.00 |" in text
    assert "| m-1.5b | 8 | 2000.0 | ? | – | – | – |" in text
    assert "| B | γ | filter | hf | fused | sigmoid | flashinfer |" in text          # measured methods, registry order
    assert "| 1 | 5 | none | – / 500.0 | 10.0 / 100.0 | 8.0 / 90.0 | – / 200.0 |" in text
    assert "| `exactness-cpu-2026-11-21.json` | cpu | fused | 1,000 | 1/2 | 1e-09 | 0.2 | 1/1 |" in text


def test_missing_and_partial_files(tmp_path):
    """Unreadable, empty and half-written files are skipped with a note; the report still renders."""
    _write(tmp_path, "e2e-broken-2026-11-24.json", '{"results": [')
    _write(tmp_path, "e2e-empty-2026-11-24.json", {"settings": {"target": "t"}, "results": "nope"})
    _write(tmp_path, "e2e-failed-2026-11-24.json", {"settings": {"target": "u"}, "results": [{"error": "x"}]})
    _write(tmp_path, "e2e-odd-2026-11-24.json", {"settings": {"target": "v"},
                                                 "results": [_row("mystery", "mystery", 9.0)]})
    _write(tmp_path, "native-forward-x.json", {"models": {"m": {"forwards": [{"batch": 1, "q": 1}]}, "n": 3}})
    _write(tmp_path, "verify-x.json", {"rows": [{"B": 1}, "junk"]})
    _write(tmp_path, "exactness-x.json", {"results": "junk"})
    _write(tmp_path, "eval-x.json", {"runs": [{"dataset": "xsum"}]})
    text = build_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "figs")
    summary = text.split("## Table 1")[0]
    assert "`e2e-broken-2026-11-24.json`: unreadable" in summary
    assert "`e2e-empty-2026-11-24.json`: no result rows, skipped" in summary
    assert "`e2e-failed-2026-11-24.json`: no result rows, skipped" in summary
    assert "`e2e-odd-2026-11-24.json`: no successful row, skipped" in summary
    assert "**(a) End-to-end decoding**: no real-weight" in summary
    assert "`native-forward-x.json` has no B=1, q=1 forward with a floor, skipped" in summary
    assert "`verify-x.json` has no B=1/B=64 bf16 row at T=1, skipped" in summary
    assert "xsum T=– ?: n = ? ⚠" not in summary and "xsum T=– ?: n = ?." in summary
    assert not (tmp_path / "figs" / "summary-e2e-tokps.png").exists()


def test_no_results_at_all(tmp_path):
    lines = summary_section([], [], None)
    assert "no real-weight `e2e-*.json`" in "\n".join(lines) and "no eval runs committed" in "\n".join(lines)


def test_e2e_groups_spread_and_kinds():
    """Whiskers come from the per-batch rates of a row's ``runs``; old system names map to the same kinds."""
    from bench.report.summary_data import e2e_groups, kind
    groups = dict(e2e_groups(_new_layout()))
    best = {r["kind"]: r for r in groups[("xsum", 0.0, 1)]}
    assert best["tilespec"]["spread"] == (200.0, 400.0) and best["ngram"]["spread"] is None
    assert [r["kind"] for r in groups[("xsum", 0.0, 1)]] == ["hf", "hf-static", "hf-assisted", "hf-prompt-lookup", "ar",
                                                          "tilespec", "ngram"]
    assert [kind({"system": s}) for s in ("ar@graphs", "tilespec:fused@graphs", "hf-assisted",
                                          "tilespec+ngram:fused/g3@auto", "mystery")] == [
        "ar", "tilespec", "hf-assisted", "tilespec+ngram", None]


def _scale_run(dataset, temp, n, req, sig=False):
    """An eval-scale run: batched (B=16), partial, raw per-chunk token sequences; one T=0 output differs."""
    def row(m, rouge, tps, seqs):
        return dict(method=m, rouge1=rouge, tokens_per_s=tps, new_tokens=1000, wall_time_s=1000 / tps, alpha=0.6,
                    texts=[str(x) for x in seqs])
    base = [[i, i + 1] for i in range(n)]
    other = [s if i or temp else [9] for i, s in enumerate(base)]   # example 0 differs at T=0
    methods = {"hf": row("hf", 0.20, 100.0, base), "tiled": row("tiled", 0.20, 120.0, other),
               "fused": row("fused", 0.20, 125.0, other)}
    if sig:
        methods["sigmoid"] = row("sigmoid", 0.15, 150.0, base)
    raw = {m: [dict(idx=list(range(n)), sequences=base if m == "hf" else other)] for m in methods}
    return dict(task="summarization", dataset=dataset, target="tgt", draft="drf", metric="rouge1", n=n,
                n_requested=req, batch_size=16, protocol_note="batched main comparison", raw=raw,
                stages_done=["main-partial"], config={"temperature": temp, "batch_size": 16},
                environment={"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "date": "2026-11-24"},
                methods=methods)


def test_eval_scale_in_summary_and_tables(tmp_path):
    """Batched partial runs: n of target, B, 'partial', identity counts from raw sequences, sigmoid's drop + speed."""
    from bench.report.tables import identical_count
    _write(tmp_path, "eval-scale-H100-xsum-t0-2026-11-24.json",
           {"kind": "eval", "commit_note": "code of abc1234", "runs": [_scale_run("xsum", 0.0, 5, 304)]})
    _write(tmp_path, "eval-scale-H100-xsum-t1-2026-11-24.json",
           {"kind": "eval", "runs": [_scale_run("xsum", 1.0, 4, 304, sig=True)]})
    runs, _ = load_results(tmp_path)
    t0 = next(r for r in runs if r["config"]["temperature"] == 0)
    assert identical_count(t0, "fused") == (4, 5)
    del t0["raw"]                                                   # falls back to the texts
    assert identical_count(t0, "tiled") == (4, 5)
    text = build_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "figs")
    summary = text.split("## Table 1")[0]
    assert "| xsum T=0 | 5 of 304 (**partial**) | 16 | hf, tiled, fused | 4/5 / 4/5 |" in summary
    assert "**batched mode**" in summary and "not the paper's batch-1 protocol" in summary
    assert "T=0: tiled and fused outputs identical to hf for 4/5 xsum." in summary
    assert "xsum (n = 4) ROUGE1 0.150 vs 0.200 (-25 %) at 1.50× hf tok/s" in summary
    assert "xsum T=1 H100 B=16: n = 4 of 304 (partial) ⚠" in summary
    t1 = text[text.index("## Table 1"):text.index("## Table 5")]
    assert "| XSum, T=0, H100, B=16 (batched) | tgt / drf | ROUGE1 | 5 of 304 (**partial**) |" in t1
    assert "| 4/5 / 4/5 |" in t1
    assert ("| XSum, T=1, H100, B=16 (batched) | 4 of 304 (**partial**) | sigmoid | ROUGE1 | 0.200 | 0.150 | "
            "-0.050 (-25.0%) | 100 | fused 125 | 150 | 1.50× |") in t1
    runs_table = text[text.index("## Runs"):]
    assert "- run 1: batched main comparison" in runs_table and "code of abc1234" in runs_table


def test_whisper_settings_drafters_and_filters(tmp_path):
    """A --whisper file that recorded the text defaults is shown as whisper-base; same-day files are ordered by
    time; best drafter per task names what was not measured; verify filter rows; GPU exactness first."""
    from bench.report.summary import filter_cells
    whisper = {"environment": dict(ENV, date="2026-11-24T18:00:00"), "note": "ar tokens shifted by one",
               "settings": dict(target="qwen2.5-coder-1.5b-instruct", whisper=True, num_prompts=32,
                                max_new_tokens=96, task="xsum"),
               "results": [_row("ar@auto", "ar", 800.0, task="ljspeech"), _row("hf", "hf", 80.0, task="ljspeech")]}
    _write(tmp_path, "e2e-whisper-2026-11-24.json", whisper)
    early = _new_layout()
    _write(tmp_path, "e2e-b-early-2026-11-24.json", dict(early, environment=dict(ENV, date="2026-11-24T09:00:00")))
    late = {"environment": dict(ENV, date="2026-11-24T17:00:00", commit="fff0000"),
            "settings": dict(target="tgt-1.5b", draft="drf-0.5b", num_prompts=16, max_new_tokens=128, task="xsum"),
            "results": [_row("ar@auto", "ar", 300.0), _row("tilespec:fused/optimal@auto", "tilespec", 290.0)]}
    _write(tmp_path, "e2e-a-late-2026-11-24.json", late)            # newer, but without the hf-static anchor
    _write(tmp_path, "e2e-drafters-2026-11-24.json", {
        "environment": dict(ENV, date="2026-11-24T08:00:00", commit="0ld0000"),
        "settings": dict(target="tgt-1.5b", num_prompts=16, max_new_tokens=128, task="code-edit,cnndm"),
        "results": [_row("ar@auto", "ar", 300.0, task="code-edit"),
                    _row("ngram:fused/g5@auto", "ngram", 600.0, task="code-edit")]})
    verify_row = dict(V=151936, dtype="bf16", temperature=1.0, regime="mid", K=5)
    _write(tmp_path, "verify-H100-2026-11-24.json", {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-24", "rows": [
        dict(verify_row, B=1, top_k=0, results={"fused": {"graph_us": 10.0, "eager_us": 80.0},
                                               "flashinfer": {"eager_us": 200.0}}),
        dict(verify_row, B=1, top_k=0, top_p=0.9, results={"fused": {"eager_us": 3000.0},
                                                          "flashinfer": {"eager_us": 600.0}})]})
    _write(tmp_path, "exactness-cpu-2026-11-24.json", {"device": "cpu", "date": "2026-11-24", "samples": 10,
                                                       "results": [{"method": "fused", "passed": True}]})
    _write(tmp_path, "exactness-gpu-H100-2026-11-23.json", {"device": "cuda", "date": "2026-11-23", "samples": 10**6,
           "results": [{"method": "fused", "passed": True}, {"method": "biased", "passed": True,
                                                             "exact_method": False}]})
    runs, others = load_results(tmp_path)
    text = "\n".join(summary_section(runs, others, None))
    assert "**(a) End-to-end decoding, whisper-base** — H100" in text and "qwen2.5-coder" not in text
    assert "*Note in the file: ar tokens shifted by one*" in text
    assert "B=1: 800.0 vs 80.0 tok/s (transformers (dynamic cache)), 10.00×" in text
    assert "`e2e-b-early-2026-11-24.json`" in text and "`e2e-a-late-2026-11-24.json`" not in text  # anchor wins
    assert ("**Best drafter per task** (B = 1, T = 0, fastest speculative configuration in the files above): cnndm: "
            "not measured (no speculative row); code-edit: n-gram (`ngram:fused/g5@auto`, 600.0 tok/s, 2.00× "
            "target-only; `e2e-drafters-2026-11-24.json`, commit 0ld0000); draft model, suffix: not measured") in text
    assert "The newest e2e files (commit abc1234, 2026-11-24) hold no n-gram / suffix" not in text  # early has ngram
    doc = dict(others)[tmp_path / "verify-H100-2026-11-24.json"]
    assert filter_cells(doc) == ["top-p 0.9, B=1: fused 3000 µs vs FlashInfer 600 µs (fused 5.0× slower)"]
    assert "fused's eager time exceeds FlashInfer's at top-p 0.9 B=1" in text
    assert "- **Exactness on the GPU** (fused, cuda (H100, per the file name), 1,000,000 samples per check" in text
    assert text.index("`exactness-gpu-H100-2026-11-23.json`") < text.index("`exactness-cpu-2026-11-24.json`")
    # neither has the anchor, same day: the later recorded time wins
    _write(tmp_path, "e2e-b-early-2026-11-24.json", dict(late, environment=dict(ENV, date="2026-11-24T09:00:00")))
    runs, others = load_results(tmp_path)
    text = "\n".join(summary_section(runs, others, None))
    assert "`e2e-a-late-2026-11-24.json`" in text and "`e2e-b-early-2026-11-24.json`" not in text.split("(f)")[0]
    # both compare with hf-static: the newer file wins over the one comparing more system kinds
    _write(tmp_path, "e2e-b-early-2026-11-24.json", dict(early, environment=dict(ENV, date="2026-11-24T09:00:00")))
    late["results"].append(_row("hf-static", "hf-static", 100.0))
    _write(tmp_path, "e2e-a-late-2026-11-24.json", late)
    runs, others = load_results(tmp_path)
    text = "\n".join(summary_section(runs, others, None))
    assert "`e2e-a-late-2026-11-24.json`" in text and "`e2e-b-early-2026-11-24.json`" not in text.split("(f)")[0]


def test_glance_table_eval_rows(tmp_path):
    """The 'At a glance' table: T=0 identity summed over runs, T=1 bootstrap interval, Δ% range, speculation vs the
    target-only run of the drafters stage, context-drafter rows, sigmoid's price; side-study records are skipped."""
    t1 = _scale_run("xsum", 1.0, 4, 304, sig=True)
    t1["references"] = ["1 2", "2 3", "3 4", "4 5"]
    t1["methods"]["fused"]["delta_profiling_pct"] = 97.0
    t0 = _scale_run("xsum", 0.0, 5, 304)
    t0["methods"]["fused"]["delta_profiling_pct"] = 98.5
    target_only = dict(_scale_run("xsum", 1.0, 4, 304), draft=None, methods={"hf": {"tokens_per_s": 250.0}})
    ngram = dict(_scale_run("xsum", 1.0, 4, 304), draft="ngram")
    ngram["methods"] = {"hf": ngram["methods"]["hf"], "fused": dict(ngram["methods"]["fused"], tokens_per_s=200.0)}
    study = dict(_scale_run("xsum", 1.0, 2, 2), methods={})
    noisy = dict(_scale_run("cnndm", 0.0, 3, 199), timing_note="timed while another job shared the GPU")
    noisy["methods"]["fused"]["delta_profiling_pct"] = 10.0    # would widen the range: left out
    _write(tmp_path, "eval-scale-H100-xsum-t0-2026-11-24.json", {"kind": "eval", "runs": [t0]})
    _write(tmp_path, "eval-scale-H100-cnndm-t0-2026-11-24.json", {"kind": "eval", "runs": [noisy]})
    _write(tmp_path, "eval-scale-H100-xsum-t1-2026-11-24.json", {"kind": "eval", "runs": [t1]})
    _write(tmp_path, "eval-scale-H100-drafters-2026-11-24.json", {"kind": "eval", "runs": [ngram, target_only]})
    _write(tmp_path, "eval-scale-H100-studies-text-2026-11-24.json", {"kind": "eval", "runs": [study]})
    text = build_report(tmp_path, tmp_path / "REPORT.md", tmp_path / "figs")
    glance = text[text.index("**At a glance**"):text.index("**Key numbers**")]
    assert ("| T=0: exact methods' outputs token-identical to the `hf` baseline | tiled 6/8, fused 6/8 | "
            "xsum 5, cnndm 3 |") in glance or ("| T=0: exact methods' outputs token-identical to the `hf` baseline | "
                                               "tiled 6/8, fused 6/8 | cnndm 3, xsum 5 |") in glance
    assert "| T=1: `fused` − `hf` quality, paired bootstrap 95 % interval | xsum ROUGE1 +0.000 [+0.000, +0.000] |" \
        in glance
    assert "**+97.0 % to +98.5 %** | 2 runs, B=16; 1 run(s) with a timing note left out |" in glance
    assert "| CNN/DM, T=0, H100, B=16 (batched) ‡ |" in text and "timed while another job shared the GPU" in text
    # fused 125 tok/s in the main run and 200 with the n-gram drafter, over the target-only run's 250
    assert "0.5B draft xsum 0.50×; ngram xsum (n=4) 0.80×" in glance
    assert "xsum ROUGE1 0.150 vs 0.200 at 1.50× the tok/s" in glance
    assert "studies-text" not in glance
    summary = text.split("## Table 1")[0]
    assert "xsum, ngram drafter T=1 n = 4 of 304" in summary and "xsum, target-only T=1" in summary
