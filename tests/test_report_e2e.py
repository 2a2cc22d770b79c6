"""The REPORT.md end-to-end section, from synthetic ``e2e-*.json`` files written to tmp_path only."""
from __future__ import annotations

import json

from bench.report.build import build_report, load_results
from bench.report.e2e import TITLE, e2e_section

ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "transformers": "5.17", "commit": "abc1234 (no .git)",
       "date": "2026-11-22T10:00:00+00:00"}


def _settings(**kw):
    return dict(dict(target="tgt-1.5b", draft="drf-0.5b", gamma=3, gamma_schedule="constant", num_prompts=4,
                     max_new_tokens=48, compile="eager,graphs", random_init=False, whisper=False), **kw)


def _spec(system, tps, b=1, t=0.0, **kw):
    return dict(dict(system=system, engine="graphs", temperature=t, batch_size=b, requests=4, new_tokens=100,
                     tokens_per_second=tps, tokens_per_second_per_request=tps / b, peak_memory_bytes=3 * 2**30,
                     verify_share=0.05, alpha=0.6, alpha_tested=0.7, cost_ratio=0.5, block_efficiency=2.5,
                     mean_gamma=3.0, predicted_speedup=1.5, predicted_speedup_gamma=3), **kw)


def _base(system, tps, b=1, t=0.0):
    return dict(system=system, temperature=t, batch_size=b, requests=4, new_tokens=100, tokens_per_second=tps,
                tokens_per_second_per_request=tps / b, peak_memory_bytes=2 * 2**30, verify_share=0.01)


def _write(tmp_path, name, doc):
    (tmp_path / name).write_text(json.dumps(doc))


def test_table_numbers_and_headline(tmp_path):
    ar_b1 = dict(_base("ar@graphs", 200.0), wall_time=0.5, times={"prefill": 0.25})          # decode: 400 tok/s
    rows = [_base("hf-assisted", 10.0), ar_b1,
            _spec("tilespec:fused@graphs", 240.0, speedup_vs_ar=1.2, greedy_match_ar=0.75, wall_time=0.5,
                  times={"prefill": 0.1}),                                                    # decode: 250 tok/s
            _base("ar@graphs", 800.0, b=8),
            _spec("tilespec:fused@graphs", 600.0, b=8)]  # no speedup_vs_ar: recomputed from ar@graphs (0.75)
    _write(tmp_path, "e2e-fake-2026.json", {"environment": ENV, "settings": _settings(), "results": rows,
                                            "provenance": "fake run"})
    _, others = load_results(tmp_path)
    text = "\n".join(e2e_section(others))
    assert text.startswith(TITLE)
    assert "tgt-1.5b / drf-0.5b — H100 80GB HBM3" in text and "γ=3 (constant schedule)" in text
    assert "4 prompts × 48 new tokens" in text and "eager, graphs" in text and "commit abc1234" in text
    assert "*Provenance: fake run*" in text and "tok/s/req" in text
    # B=1 speculative row: pred 1.5, meas 1.2 -> |1.5-1.2|/1.2 = 25 %; decode-only 250/400 = 0.625 -> 140 %;
    # verify 5.0 %; greedy 75 %; 3 GiB
    assert ("| 0 | 1 | `tilespec:fused@graphs` | 240.0 | – | 0.600 | 0.50 | 2.50 | 3.00 | 1.50 | 1.20 | 25% | 0.62 "
            "| 140% | 5.0 | 75% | 3.00 |") in text
    # B=8 row: per-request 75.0 tok/s, measured recomputed 600/800 = 0.75 -> |1.5-0.75|/0.75 = 100 %
    assert ("| 0 | 8 | `tilespec:fused@graphs` | 600.0 | 75.0 | 0.600 | 0.50 | 2.50 | 3.00 | 1.50 | 0.75 | 100% | – "
            "| – |" in text)   # no per-phase times: no decode-only speedup
    assert "24.00× HF assisted (best 10.0 tok/s" in text and "1.20× our `ar@graphs` (best 200.0 tok/s" in text
    assert "**tgt-1.5b, T=0, B=1**: best tilespec 240.0 tok/s" in text
    assert "greedy match < 100 % in bf16".lower() in text.lower()
    # every table row has as many cells as its header
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.startswith("|")]
        if lines:
            n = len(lines[0].replace("\\|", "").split("|"))
            assert all(len(ln.replace("\\|", "").split("|")) == n for ln in lines), block


def test_error_row_random_init_and_report_hook(tmp_path):
    long_err = "Cannot copy between CPU and CUDA tensors | during capture " + "x" * 200
    rows = [_base("ar", 30.0), _spec("tilespec:fused", 8.0, alpha=0.0, speedup_vs_ar=0.27),
            {"system": "ar@graphs", "temperature": 1.0, "batch_size": 1, "error": long_err},
            {"system": "odd"}]  # missing keys everywhere
    _write(tmp_path, "e2e-random-init-fake.json", {"environment": {}, "settings": _settings(random_init=True),
                                                   "results": rows, "note": "random weights"})
    _write(tmp_path, "e2e-empty.json", {})
    out = tmp_path / "REPORT.md"
    text = build_report(tmp_path, out, figures_dir=tmp_path / "fig")
    assert TITLE in text and text.index(TITLE) < text.index("## Other committed results")
    assert "**Random weights: machinery timing only, α≈0**" in text and "*Note: random weights*" in text
    assert "error: Cannot copy between CPU and CUDA tensors \\| during capture" in text and "x" * 200 not in text
    assert "…" in text
    assert "### Headlines" not in text  # random-init files never enter the headlines
    assert e2e_section([]) == []
