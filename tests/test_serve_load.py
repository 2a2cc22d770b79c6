"""The serving load benchmark (bench/scripts/serve_load.py) end to end against a tiny in-process server: Poisson and
closed-loop levels, the JSON it writes (summary fields, ratios, determinism check), and its percentile helper."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_serve import Server, make_app  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scripts" / "serve_load.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentiles():
    load = _script()
    assert load.percentile([], 50) is None
    assert load.percentile([3, 1, 2], 50) == 2 and load.percentile(list(range(101)), 99) == 99


def _run_levels(load, tmp_path, name: str, extra: list) -> tuple:
    """serve_load.main at 1 and 4 clients (2 requests each, 8 tokens) against a tiny in-process server -> (the server,
    stopped; the JSON path; the argv, to run again). ``{url}`` in ``extra`` becomes the server's URL."""
    srv = Server(make_app(max_batch=4, max_len=200, prefill_chunk=256))
    try:
        out = tmp_path / name
        argv = ["--systems", f"url:tiny={srv.url}", "--clients", "1,4", "--requests-per-client", "2", "--task",
                "synthetic", "--num-prompts", "8", "--max-tokens", "8", "--log-dir", str(tmp_path), "--out", str(out),
                *(a.format(url=srv.url) for a in extra)]
        assert load.main(argv) == 0
    finally:
        srv.stop()
    return srv, out, argv


def test_load_levels_write_the_json(tmp_path):
    load = _script()
    srv, out, argv = _run_levels(load, tmp_path, "serve-load.json", ["--warmup", "2", "--rate", "50"])
    result = json.loads(out.read_text())
    assert load.main(argv) == 0                  # a rerun resumes: every level is done, no server is contacted
    assert json.loads(out.read_text())["levels"] == result["levels"]
    rows = result["levels"][f"url:tiny={srv.url}"]
    assert set(rows) == {"1", "4"} and result["environment"]["torch"]
    for c, row in rows.items():
        assert row["ok"] == row["requests"] == 16 and row["errors"] == 0
        assert row["completion_tokens"] == 16 * 8 and row["finish"]["length"] == 16
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["itl_p50_s"] > 0 and row["throughput_tok_s"] > 0
    assert rows["4"]["changed"] == 0            # greedy texts under 4 clients equal the one-client texts
    assert rows["1"]["server"]["tilespec_generated_tokens_total"] == 16 * 8
    assert rows["4"]["server"]["tilespec_steps_total"] > 0


def test_system_settings_split_into_flags_and_environment():
    load = _script()
    assert load.split_system("tilespec:ngram|--spec-max-batch 16|TILESPEC_NATIVE_KERNELS=attn") == (
        "tilespec:ngram", ["--spec-max-batch", "16"], {"TILESPEC_NATIVE_KERNELS": "attn"})
    assert load.split_system("tilespec:qwen:layers=8") == ("tilespec:qwen:layers=8", [], {})


def test_the_soak_runs_on_a_speculative_tilespec_system():
    load = _script()
    systems = ["tilespec:none", "tilespec:ngram|--spec-max-batch 16", "hf"]
    assert load.soak_index(systems) == 1
    assert load.soak_index(["hf", "tilespec:none"]) == 0
    assert load.soak_index(systems, "hf") == 2
    with pytest.raises(SystemExit, match="not one of"):
        load.soak_index(systems, "tilespec:head")


def test_a_soak_runs_for_its_duration_and_compares_greedy_texts(tmp_path):
    """--soak-seconds keeps the largest level's load for that long (whatever the measured request rate) and counts
    the greedy texts that differ from the one-client level's."""
    load = _script()
    _, out, _ = _run_levels(load, tmp_path, "soak.json", ["--warmup", "0", "--soak-seconds", "3", "--soak-system",
                                                          "url:tiny={url}"])
    soak = json.loads(out.read_text())["soak"]
    assert soak["errors"] == 0 and soak["ok"] == soak["requests"] > 16
    assert 2.5 < soak["wall_s"] < 30
    assert soak["compared_with_solo"] == soak["ok"] and soak["changed_vs_solo"] == 0
