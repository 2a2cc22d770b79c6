"""REPORT.md's multi-draft section and T=0 repeatability note: rendered from the committed JSON shapes."""
from pathlib import Path

from bench.report.multidraft import multidraft_section, multidraft_summary, repeatability_lines


def _stats(mean, err=0.1, n=10):
    return {"mean": mean, "stderr": err, "n": n}


def _multidraft_doc():
    be = {"fig3": {"T=1.2": {"sd": _stats(2.0), "specinfer": _stats(2.4), "spectr": _stats(2.5), "is": _stats(2.45)}},
          "table1": {"K=2": {"specinfer": _stats(2.4), "spectr": _stats(2.5), "is": _stats(2.45)},
                     "K=4": {"specinfer": _stats(2.8), "spectr": _stats(2.9), "is": _stats(3.1)}},
          "table2": {"T2=2.0": {"is-s5": _stats(2.2), "is-s5-m10": _stats(2.0)}}}
    ta = {"1.0": {"2": {"optimal": _stats(0.70), "is": _stats(0.68), "spectr": _stats(0.69), "specinfer": _stats(0.67)}}}
    timing = {"T=1.2": {"sd": {"tokens": 96, "seconds": 10.0, "tokens_per_s": 9.6, "K": 1, "prompts": 2,
                               "gain_over_sd_pct": 0.0},
                        "spectr/K=4": {"tokens": 96, "seconds": 5.0, "tokens_per_s": 19.2, "K": 4, "prompts": 2,
                                       "gain_over_sd_pct": 100.0}}}
    return {"date": "2026-11-24", "gpu": "GPU X", "device": "cuda", "args": {"dtype": "bfloat16", "timing_tokens": 48},
            "setting": {"target_sampling": "T=1.0", "draft_sampling": "T_d", "L": 5},
            "sample_sizes": {"prompts_done": {"xsum": 50}, "rounds": {"xsum": 200}, "trajectory_positions": {"xsum": 500},
                             "reps_per_round": 8},
            "summary": {"block_efficiency": {"xsum": be}, "token_acceptance": {"xsum": ta}}, "timing": timing}


def test_multidraft_summary_and_section_quote_the_file():
    others = [(Path("bench/results/multidraft-cpu-2026-11-21.json"), {"date": "2026-11-21"}),   # CPU: ignored
              (Path("bench/results/multidraft-H100-2026-11-24.json"), _multidraft_doc())]
    line = " ".join(multidraft_summary(others))
    assert "multidraft-H100-2026-11-24.json" in line and "SD 2.00" in line and "K=4 IS 3.10" in line
    assert "spectr/K=4 at +100 %" in line
    assert "differ by at most 0.30 tokens per call (xsum, K=4)" in line    # 3.1 - 2.8, the widest spread
    text = "\n".join(multidraft_section(others))
    assert "| xsum | 1 / 2 | 2.00 ± 0.10 | 2.40 ± 0.10 | 2.50 ± 0.10 | 2.45 ± 0.10 |" in text
    assert "| xsum | 4 | – | 2.80 ± 0.10 | 2.90 ± 0.10 | 3.10 ± 0.10 |" in text
    assert "| xsum | 1.0 | 2 | 0.700 | 0.680 | 0.690 | 0.670 |" in text
    assert "| SpecTr | 4 | 19.20 | +100 % |" in text


def test_no_gpu_multidraft_file_says_so():
    assert "no `multidraft-*.json` from a GPU" in multidraft_summary([])[0]
    assert multidraft_section([]) == []


def test_repeatability_note_uses_the_newest_probed_run():
    probed = {"date": "2026-11-24T19:39", "dataset": "xsum", "offset": 80, "batch": 16,
              "pairs": [{"a": ["target", 0], "b": ["target", 1], "differing": 3}],
              "probes": {"torch.bfloat16": [{"example": 0, "token": 24, "gap_ulps": 1.0},
                                            {"example": 12, "token": 0, "gap_ulps": 0.0}]}}
    void = dict(probed, date="2026-11-24T19:50", probes={})      # newer, but its probes were removed
    others = [(Path("repeatability-a.json"), probed), (Path("repeatability-b.json"), void)]
    line = repeatability_lines(others)[0]
    assert "repeatability-a.json" in line and "2 splits" in line and "largest gap 1 ulp" in line
    assert "3 of 16" in line
    assert repeatability_lines([(Path("repeatability-b.json"), void)]) == []


def test_multidraft_section_adds_the_runtime_rows_and_keeps_them_out_of_the_study():
    runtime = {"benchmark": "trees", "env": {"date": "2026-11-30"},
               "settings": {"task": "xsum", "num_prompts": 16, "max_new_tokens": 128, "draft_temperature": 1.2,
                            "md_draft": "draft-0.5b"},
               "rows": [{"system": "ar", "tokens_per_second": 500.0, "tau": 1.0, "graphed": True},
                        {"system": "md-K2-L5-specinfer", "tokens_per_second": 600.0, "tau": 2.9, "graphed": True},
                        {"system": "mdm-K2-L5-is", "error": "weights absent"}]}
    others = [(Path("bench/results/multidraft-H100-2026-11-24.json"), _multidraft_doc()),
              (Path("bench/results/multidraft-schemes-runtime-qwen-h200.json"), runtime)]
    assert "multidraft-H100-2026-11-24.json" in " ".join(multidraft_summary(others))   # the study, not the runtime
    text = "\n".join(multidraft_section(others))
    assert "`multidraft-schemes-runtime-qwen-h200.json`" in text and "T_d = 1.2" in text
    assert "| md-K2-L5-specinfer | 600.0 | 2.90 | 1.20× | yes |" in text
    assert "mdm-K2-L5-is" not in text                                    # an error row has no rate to print
