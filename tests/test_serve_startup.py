"""``tilespec serve``'s start-up: what runs beside what, and the timeline that says where the time went.

The API processes start with the engine process and get the tokenizer (Loaded) while it still warms up; they
listen only once it is ready. ``import tilespec``, the CLI's parser for one command and everything ``tilespec
serve`` runs before it spawns the engine import no torch (the engine process starts sooner; the checks that need it
run after the spawn), nor do an API process's modules, while Triton still runs in its interpreter without CUDA. The load reads weights
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


def _fresh(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=180)


def test_an_api_process_imports_builds_its_app_and_checks_requests_without_torch(tmp_path):
    """What an API process runs before it serves (run_api_server: the processes and the app's modules, a client,
    the app over it, a request's checks) imports no torch: its start-up is its own imports, not torch's."""
    pytest.importorskip("fastapi")
    code = ("import sys\n"
            "from tilespec.serve import processes  # noqa: F401\n"
            "from tilespec.serve.app import build_app\n"
            "from tilespec.serve.client import EngineClient\n"
            "from tilespec.engine.batch_request import BatchRequest, check_request\n"
            "from serve_hooks import CharTokenizer\n"
            "client = EngineClient(f'ipc://{sys.argv[1]}/engine', f'ipc://{sys.argv[1]}/api-0')\n"
            "client.info = dict(max_len=64, max_request_len=64, vocab=128, grammar_refused='no', logprobs_refused=None)\n"
            "app = build_app(client, 'm', CharTokenizer())\n"
            "check_request(BatchRequest(prompt=[1, 2], max_tokens=4, temperature=0.7, top_k=5, top_p=0.9), 64, 128)\n"
            "try:\n"
            "    check_request(BatchRequest(prompt=[1], max_tokens=1, top_p=0.0), 64, 128)\n"
            "except ValueError as err:\n"
            "    assert str(err) == 'sampling.top_p must be in (0, 1], got 0.0', err\n"
            "client.close()\n"
            "assert 'torch' not in sys.modules, 'an API process imported torch'\n")
    out = _fresh(code, str(tmp_path))
    assert out.returncode == 0, out.stderr


def test_the_cli_spawns_the_engine_before_importing_torch(tmp_path):
    """``tilespec serve`` up to the spawn (EngineProcess stubbed): the spec it builds names the models and the
    device, pickles, and nothing the main process ran so far imported torch."""
    code = ("import pickle, socket, sys\n"
            "import tilespec.serve.processes as processes\n"
            "def spawn(spec, api_servers=1, marks=None):\n"
            "    with spec.portable():\n"
            "        blob = pickle.dumps(spec)\n"
            "    assert 'torch' not in sys.modules, 'the main process imported torch before the spawn'\n"
            "    back = pickle.loads(blob)\n"
            "    print(back.load, back.device, back.options['compile'], 'torch' in sys.modules)\n"
            "    raise SystemExit(0)\n"
            "processes.EngineProcess = spawn\n"
            "with socket.socket() as s:\n"
            "    s.bind(('127.0.0.1', 0))\n"
            "    port = s.getsockname()[1]\n"
            "from tilespec.cli import main\n"
            "main(['serve', '--target', 'tiny', '--draft', 'ngram', '--port', str(port), '--dtype', 'bf16'])\n")
    out = _fresh(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LoadByName(target='tiny',", "draft='ngram',", "device='auto',", "dtype='bf16')",
                                  "auto", "auto", "False"]


def test_the_engine_process_resolves_the_named_device_and_dtype(monkeypatch):
    import torch

    from tilespec.serve.named import LoadByName, device_type
    calls = []
    monkeypatch.setattr("tilespec.api.load_pair", lambda *a, **k: calls.append((a, k)) or ("t", None, "tok"))
    assert LoadByName("tiny", None, "cpu", "auto")() == ("t", None, "tok")
    assert calls[-1][0] == ("tiny", None, torch.device("cpu"), torch.float32) and calls[-1][1] == {"log": print}
    LoadByName("tiny", "ngram", "auto", "fp16")()
    assert calls[-1][0][2] == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert calls[-1][0][3] == torch.float16
    assert [device_type(n) for n in ("auto", "cpu", "cuda:1")] == [None, "cpu", "cuda"]


def test_a_check_after_the_spawn_fails_as_before_and_stops_the_spawned_processes(capsys):
    """A method typo is found once the engine and API processes are spawned (the check imports torch): the
    command fails with the registry's message and leaves no process behind."""
    import multiprocessing

    from tilespec.cli import main
    before = set(multiprocessing.active_children())     # other tests' servers in this worker live on
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["serve", "--target", "tiny", "--device", "cpu", "--method", "fusd", "--port", str(port), "--api-servers",
            "2"]
    assert main(argv) == 1
    assert "tilespec serve: error: unknown verification method 'fusd'; did you mean 'fused'?" in capsys.readouterr().err
    spawned = set(multiprocessing.active_children()) - before
    for child in spawned:                               # killed already; on a busy machine they take a moment
        child.join(15)
    assert [child for child in spawned if child.is_alive()] == []


def test_compile_auto_is_decided_where_the_target_is(monkeypatch):
    """The CLI sends ``compile="auto"`` (it does not know the device): CUDA graphs where the target is on CUDA."""
    from test_serve import make_target

    import tilespec.engine.paged
    from tilespec.serve import make_engine
    monkeypatch.setattr(tilespec.engine.paged, "PagedEngine", lambda *a, **k: k)
    assert make_engine(make_target(), "ngram", compile="auto", max_batch=2)["compile"] is False
    assert make_engine(make_target(), "ngram", compile="native", max_batch=2)["compile"] is True
