"""The serving load benchmark (bench/scripts/serve_load.py) end to end: against a tiny in-process tilespec server
(Poisson and closed-loop levels, the JSON it writes: summary fields, ratios, determinism check, soak), and against
the stub server (bench/scripts/stub_server.py: no model), where the multi-process client must count every token,
merge its processes' records, report TTFT / ITL, and record a failed request's reason (the server's HTTP status and
body, or the connection error and where it broke); the stub check section, the vLLM command and the /metrics
parsing."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "bench" / "scripts"
SCRIPT = SCRIPTS / "serve_load.py"


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
    pytest.importorskip("fastapi")
    from test_serve import Server, make_app
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


@pytest.mark.slow
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
    assert load.split_system("tilespec:ngram|--gamma 2|TILESPEC_NATIVE_KERNELS=attn") == (
        "tilespec:ngram", ["--gamma", "2"], {"TILESPEC_NATIVE_KERNELS": "attn"})
    assert load.split_system("tilespec:qwen:layers=8") == ("tilespec:qwen:layers=8", [], {})


def test_the_soak_runs_on_a_speculative_tilespec_system():
    load = _script()
    systems = ["tilespec:none", "tilespec:ngram|--gamma 2", "hf"]
    assert load.soak_index(systems) == 1
    assert load.soak_index(["hf", "tilespec:none"]) == 0
    assert load.soak_index(systems, "hf") == 2
    with pytest.raises(SystemExit, match="not one of"):
        load.soak_index(systems, "tilespec:head")


@pytest.mark.slow
def test_a_soak_runs_for_its_duration_and_compares_greedy_texts(tmp_path):
    """--soak-seconds keeps the largest level's load for that long (whatever the measured request rate) and counts
    the greedy texts that differ from the one-client level's."""
    load = _script()
    _, out, _ = _run_levels(load, tmp_path, "soak.json", ["--warmup", "0", "--soak-seconds", "3", "--soak-system",
                                                          "url:tiny={url}"])
    soak = json.loads(out.read_text())["soak"]
    assert soak["errors"] == 0 and soak["ok"] == soak["requests"] >= 4 and soak["stopped_by_time"]
    assert 2.5 < soak["wall_s"] < 30
    assert soak["compared_with_solo"] == soak["ok"] and soak["changed_vs_solo"] == 0


# ------------------------------------------------------------------------------------------- against the stub
class Stub:
    """stub_server.py on a free port (``procs`` processes, a token every ``token_ms`` ms per stream)."""

    def __init__(self, procs: int = 1, token_ms: float = 1.0):
        load = _script()
        self.port = load.free_port()
        self.proc = load.spawn_tied([sys.executable, str(SCRIPTS / "stub_server.py"), "--port", str(self.port),
                                     "--procs", str(procs), "--token-ms", str(token_ms), "--model", "bench"])
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.time() + 15
        while time.time() < end:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the stub server did not start")

    def stop(self):
        _script().stop_server(self.proc, grace=5)


@pytest.fixture(scope="module")
def stub():
    server = Stub(procs=2, token_ms=1.0)
    yield server
    server.stop()


def test_the_multiprocess_client_counts_every_token(stub):
    """12 requests of 16 tokens from 4 clients in 2 processes: every token counted (usage and chunks), TTFT and ITL
    present (ITL near the stub's 1 ms), the processes' records merged in send order, each prompt's text alike."""
    load = _script()
    row = load.run_level(stub.url, "bench", ["alpha", "beta", "gamma"], 4, 12, 0.0, 16, 0.0, procs=2,
                         ignore_eos=True)
    assert row["requests"] == row["ok"] == row["planned_requests"] == 12 and row["errors"] == 0
    assert row["completion_tokens"] == 12 * 16 and row["finish"]["length"] == 12 and row["no_usage"] == 0
    assert row["client"]["procs"] == 2 and len({r["prompt"] for r in row["records"]}) == 3
    records = row["records"]
    assert [r["sent"] for r in records] == sorted(r["sent"] for r in records)
    assert all(r["tokens"] == r["chunks"] == 16 and len(r["gaps"]) == 15 and r["status"] == 200 for r in records)
    assert len({r["text_hash"] for r in records}) == 1            # the stub answers every prompt alike
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < 2
    assert 0.0005 < row["itl_p50_s"] < 0.05 and row["throughput_tok_s"] > 0
    assert row["client"]["connections"] == 4                      # one kept-alive connection per client


def test_a_failed_request_records_the_servers_reason(stub):
    """HTTP 400 -> its status and body; a reset mid-stream -> the exception and where; a closed port -> the
    connection error. The requests after an HTTP error still run on the same connection."""
    load = _script()
    prompts = ["fine", "STUB-ERROR please", "STUB-DROP now"]
    row = load.run_level(stub.url, "bench", prompts, 1, 6, 0.0, 12, 0.0, procs=1, ignore_eos=True)
    by_prompt = {}
    for r in row["records"]:
        by_prompt.setdefault(r["prompt"], []).append(r)
    assert row["requests"] == 6 and row["ok"] == 2 and row["errors"] == 4
    assert all(r["ok"] and r["tokens"] == 12 for r in by_prompt[0])
    for r in by_prompt[1]:
        assert r["status"] == 400 and r["error"].startswith("HTTP 400: ") and "rejected on purpose" in r["error"]
    for r in by_prompt[2]:
        assert not r["ok"] and "mid-stream" in r["error"], r["error"]
    assert row["error_kinds"]["HTTP 400"] == 2 and len(row["error_samples"]) >= 2
    closed = load.free_port()
    row = load.run_level(f"http://127.0.0.1:{closed}", "bench", prompts, 2, 2, 0.0, 8, 0.0, procs=2)
    assert row["errors"] == 2 and row["client"]["procs"] == 2
    assert all("ConnectionRefusedError" in r["error"] and "while connecting" in r["error"] for r in row["records"])


def test_poisson_arrivals_and_a_time_capped_level(stub):
    load = _script()
    row = load.run_level(stub.url, "bench", ["a"], 4, 8, 40.0, 8, 0.0, procs=2)
    assert row["ok"] == 8 and row["completion_tokens"] == 64 and row["rate"] == 40.0
    assert row["wall_s"] > 0.05                                  # 8 arrivals at 40/s take ~0.2 s
    row = load.run_level(stub.url, "bench", ["a"], 2, 10_000, 0.0, 32, 0.0, procs=2, until=0.5, keep_records=False)
    assert row["stopped_by_time"] and 4 <= row["requests"] < 10_000 and row["errors"] == 0
    assert 0.45 < row["wall_s"] < 3 and "records" not in row


def test_main_writes_the_stub_check_and_the_levels(tmp_path, stub):
    """serve_load.main with --stub-check and a slower stub as the measured system: load_generator_check (achieved
    vs offered, ceiling, headroom against the system's best), the system's levels with their request counts."""
    load = _script()
    slow = Stub(procs=1, token_ms=4.0)
    try:
        out = tmp_path / "serve-load.json"
        argv = ["--systems", f"url:slow={slow.url}", "--clients", "1,4", "--min-requests", "6", "--task", "synthetic",
                "--num-prompts", "8", "--max-tokens", "16", "--client-procs", "2", "--ignore-eos", "--warmup", "2",
                "--stub-check", "--stub-clients", "1,8", "--stub-seconds", "0.6", "--stub-procs", "1",
                "--level-seconds", "20", "--log-dir", str(tmp_path), "--out", str(out)]
        assert load.main(argv) == 0
    finally:
        slow.stop()
    result = json.loads(out.read_text())
    check = result["load_generator_check"]
    assert set(check["levels"]) == {"1", "8"} and check["stub"]["per_stream_tok_s"] == 1000.0
    for c, row in check["levels"].items():
        assert row["offered_tok_s"] == int(c) * 1000 and row["errors"] == 0 and row["requests"] > int(c)
        assert 0 < row["achieved_vs_offered"] <= 1.2 and row["limited_by"] and "records" not in row
    assert check["ceiling_tok_s"] == max(r["throughput_tok_s"] for r in check["levels"].values())
    rows = result["levels"][f"url:slow={slow.url}"]
    assert rows["1"]["requests"] == rows["1"]["planned_requests"] == 6 and rows["4"]["planned_requests"] == 16
    assert rows["4"]["ok"] == 16 and rows["4"]["completion_tokens"] == 16 * 16 and rows["4"]["changed"] == 0
    assert rows["1"]["server"]["stub_streamed_tokens_total"] == 6 * 16       # a counter: this level's increase
    assert check["highest_measured_tok_s"] == max(r["throughput_tok_s"] for r in rows.values())
    assert check["headroom"] > 1 and set(check["headroom_by_clients"]) == {"1"}     # the levels both ran
    assert check["headroom_by_clients"]["1"]["ratio"] > 2          # 1 token a ms against the slow stub's one in 4
    assert result["settings"]["ignore_eos"] and result["environment"]["cpu_count"]


def test_metrics_parse_labels_and_counters():
    """vLLM's /metrics: labelled counters count per level, gauges stay, buckets and comments are dropped."""
    load = _script()
    text = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="bench"} 1500.0
vllm:num_requests_running{engine="0",model_name="bench"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="bench"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="bench"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="bench"} 400.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="bench"} 300.0
vllm:cache_config_info{block_size="16",cache_dtype="auto"} 1.0
"""

    class Resp:
        status_code = 200

    Resp.text = text
    old_get = load.httpx.get
    load.httpx.get = lambda *a, **k: Resp()
    try:
        after = load.server_metrics("http://x")
    finally:
        load.httpx.get = old_get
    assert not any("_bucket" in k for k in after) and len(after) == 6
    before = {'vllm:generation_tokens_total{engine="0",model_name="bench"}': 500.0,
              'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="bench"}': 100.0}
    delta = load.metrics_delta(before, after)
    assert delta['vllm:generation_tokens_total{engine="0",model_name="bench"}'] == 1000.0
    assert delta['vllm:num_requests_running{engine="0",model_name="bench"}'] == 3.0
    summary = load.server_summary(delta, 1000)
    assert summary["generated_tokens"] == 1000 and summary["generated_vs_client"] == 1.0
    assert summary["drafted_tokens"] == 300 and summary["acceptance"] == 1.0


def test_the_vllm_commands(tmp_path):
    load = _script()
    site, hf = tmp_path / "vsite", tmp_path / "hf"
    hf.mkdir()
    args = Namespace(hf_model=str(hf), vllm_site=str(site), max_batch=256, vllm_args="--gpu-memory-utilization 0.8")
    with pytest.raises(RuntimeError, match="not installed"):
        load.server_command("vllm", args, 9000)
    (site / "vllm").mkdir(parents=True)
    cmd, model, env = load.server_command("vllm", args, 9000)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(hf)] and model == "bench"
    joined = " ".join(cmd)
    for part in ("--dtype bfloat16", "--port 9000", "--host 127.0.0.1", "--max-num-seqs 256",
                 "--served-model-name bench", "--gpu-memory-utilization 0.8"):
        assert part in joined
    assert "--speculative-config" not in cmd and "--disable-log-requests" not in cmd
    assert env["PYTHONPATH"] == str(site) and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["HF_HUB_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == env["DO_NOT_TRACK"] == "1"
    cmd, _, env = load.server_command("vllm:ngram|VLLM_LOGGING_LEVEL=WARNING", args, 9001)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    with pytest.raises(RuntimeError, match="hf-model"):
        load.server_command("vllm", Namespace(**{**vars(args), "hf_model": None}), 9000)


def test_a_server_that_exits_is_recorded_with_its_log(tmp_path):
    """A system whose server exits at start is a failed system with the end of its log; the others still run."""
    load = _script()
    args = Namespace(start_timeout=20, stub_procs=1, stub_token_ms=1.0)
    with pytest.raises(RuntimeError, match="exited with") as err:
        load.start_server("stub|--no-such-flag", args, load.free_port(), tmp_path / "stub.log")
    assert "unrecognized arguments" in str(err.value)


def test_stub_server_standalone_answers_non_streamed_requests():
    server = Stub(procs=1)
    try:
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=5)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "t0 t1 t2 "
        assert resp.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["id"] == "bench"
        assert httpx.get(f"{server.url}/nowhere", timeout=5).status_code == 404
    finally:
        server.stop()
    assert subprocess.run([sys.executable, str(SCRIPTS / "load_client.py")], capture_output=True).returncode != 0
