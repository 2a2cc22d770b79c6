"""``tilespec serve``'s start-up: what runs beside what, and the timeline that says where the time went.

The API processes start with the engine process and get the tokenizer (Loaded) while it still warms up; they
listen only once it is ready. ``import tilespec`` and the CLI's parser for one command import no torch (the
engine process starts sooner) while Triton still runs in its interpreter without CUDA. The load reads weights
onto a CUDA device directly where transformers can, else through the host. The warm-up log's phases.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_import_tilespec_costs_no_torch_and_triton_still_interprets_without_cuda():
    code = ("import os, sys, tilespec\n"
            "assert 'torch' not in sys.modules, 'import tilespec imported torch'\n"
            "from tilespec.cli import build_parser\n"
            "parser = build_parser('serve')\n"
            "assert 'torch' not in sys.modules, 'the serve parser imported torch'\n"
            "try:\n"
            "    import triton  # noqa: F401\n"
            "except ImportError:\n"
            "    sys.exit(0)\n"
            "import torch\n"
            "assert torch.cuda.is_available() or os.environ.get('TRITON_INTERPRET') == '1'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_parser_of_one_command_or_of_all():
    from tilespec.cli import build_parser

    def commands(parser):
        return set(next(a for a in parser._actions if a.dest == "command").choices)
    assert commands(build_parser("serve")) == {"serve"}
    everything = commands(build_parser(None))
    assert {"serve", "generate", "models"} <= everything
    assert commands(build_parser("no-such-command")) == everything


def test_the_timeline_line():
    from tilespec.serve.timeline import Marks, process_start, startup_line
    import time
    assert time.time() - 3600 < process_start() <= time.time()
    main = Marks(launched=100.0)
    main.mark("imports", 101.0)
    main.mark("serving", 130.0)
    engine = Marks(launched=102.0)
    engine.mark("ready", 129.5)
    engine.spans["CUDA init"] = 1.25
    line = startup_line(main, engine.to_wire(), [{"marks": [["launched", 102.5], ["listening", 129.8]]}])
    assert line == ("start-up (s since launch): main imports 1.0, serving 30.0 | engine launched 2.0, ready 29.5, "
                    "CUDA init 1.2 s beside | API 1 launched 2.5, listening 29.8")


def test_warm_up_phases_report_what_they_ran():
    from tilespec.engine.paged.warmup import Phases
    phases = Phases()
    phases.done("attention variants", 24)
    phases.done("eager mixed", 0)
    assert phases.shapes == 24
    assert re.fullmatch(r"attention variants 24 in \d+\.\d s, eager mixed skipped", phases.line())


def test_the_load_reads_weights_onto_cuda_or_through_the_host(monkeypatch):
    from tilespec.models import loading
    calls = []

    class Auto:
        @staticmethod
        def from_pretrained(source, **kw):
            calls.append(kw)
            if "device_map" in kw and kw.get("dtype") == "no-accelerate":
                raise ValueError("Using a `device_map` ... requires `accelerate`")
            return "model"
    tf = type("tf", (), {"AutoModelForCausalLM": Auto})
    assert loading._causal_lm(tf, "src", "bf16", "cuda:0") == "model"
    assert calls[-1] == {"dtype": "bf16", "device_map": "cuda:0"} and loading.LOAD_TIMES["weights"] == "onto cuda:0"
    assert loading._causal_lm(tf, "src", "no-accelerate", "cuda:0") == "model"
    assert calls[-1] == {"dtype": "no-accelerate"} and loading.LOAD_TIMES["weights"] == "via the host"
    assert loading._causal_lm(tf, "src", "fp32", "cpu") == "model" and calls[-1] == {"dtype": "fp32"}


def test_api_processes_get_ready_beside_the_engine_and_listen_once_it_is():
    """A slow engine start (a hook sleeps 4 s after the warm-up): the second API process has its tokenizer before
    the engine is ready, listens after it, and the main process logs the whole timeline once it serves."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from serve_hooks import CharTokenizer, slow_start
    from test_serve import MODEL, make_target, wait_healthy

    from tilespec.serve import serve_engine
    from tilespec.serve.core import EngineSpec, given
    from tilespec.serve.processes import main_server
    lines = []
    spec = EngineSpec(load=partial(given, make_target(), "ngram", CharTokenizer()), warmup=False,
                      hook=slow_start(4.0), options=dict(max_batch=4, gamma=3, max_len=96, prefill_chunk=8))
    app = serve_engine(spec, model_name=MODEL, api_servers=2, shutdown_timeout=5, log=lines.append)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, sock = main_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]))
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        engine = app.state.engine
        api = dict(engine.api_marks[0]["marks"])
        ends = dict(engine.engine_marks["marks"])
        assert api["tokenizer"] < ends["ready"] <= api["listening"]     # order only: a busy CI stretches spans
        start = [line for line in lines if line.startswith("start-up (s since launch): ")]
        assert len(start) == 1 and " | engine launched " in start[0] and " | API 1 launched " in start[0]
        assert "listening" in start[0] and "main " in start[0] and "serving" in start[0]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_stats_count_the_graphs_traced_after_start_up():
    import torch

    from tilespec.serve.core import engine_stats, traced_graphs

    class Engine:
        counters, running, waiting, max_batch = {"steps": 1}, 0, [], 4
    since = traced_graphs()
    assert engine_stats(Engine(), traced=since)["counters"]["graphs_traced_serving"] == 0
    torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=True)(torch.ones(3))
    assert engine_stats(Engine(), traced=since)["counters"]["graphs_traced_serving"] == 1
    assert "graphs_traced_serving" not in engine_stats(Engine())["counters"]
