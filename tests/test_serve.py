"""``tilespec serve`` end to end on CPU: a uvicorn server in a thread with a tiny model (its engine in a process of
its own, as in production), the openai client and httpx.

Covers the OpenAI endpoints (chat / completions, streaming, usage, stop strings), 16+ concurrent requests over 4
batch rows, exactness under batching (a seeded request's text alone == amid other traffic), the served tokens equal
to the same engine's offline generation (T=0, and T=1 with the same seed), client cancellation freeing the blocks,
an engine process that dies (errors at once, /health 503, no hang), OpenAI-style errors (404 / 400 / 429 / 503) and a
graceful shutdown that finishes running streams.
"""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tilespec.serve import build_server  # noqa: E402

from engine_models import tiny_lm  # noqa: E402
from serve_hooks import CharTokenizer, fail_after, stall_after  # noqa: E402
from tiers import fast_first  # noqa: E402

MODEL = "tiny"


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("the test server did not start")


class Server:
    """A uvicorn server on a free port in a daemon thread."""

    def __init__(self, app, grace: int = 5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=grace))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, cls=None):
        return (cls or openai.OpenAI)(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)


def make_target():
    torch.manual_seed(0)
    target = tiny_lm(0, logit_scale=3.0)
    target.generation_config.eos_token_id = None
    return target


def make_app(**kw):
    target = make_target()
    options = dict(draft="ngram", model_name=MODEL, max_batch=4, gamma=3, max_len=96, max_queue=64,
                   default_max_tokens=16, prefill_chunk=8)
    tokenizer = kw.pop("tokenizer", None) or CharTokenizer()
    options.update(kw)
    return build_server(target, tokenizer, **options)


@pytest.fixture
def server(tiny_server):
    """make_app()'s server: the session's ``tiny_server`` (tests/shared_fixtures.py), shared with test_serve_echo.py
    and test_serve_n.py."""
    return tiny_server


def metric(srv, name) -> float:
    for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_models_health_metrics(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert metric(server, "tilespec_batch_slots") == 4
    # the engine process froze its start-up heap (no full collection walks it while serving) and counts its pauses
    assert server.app.state.client.info["gc_frozen_objects"] > 10_000
    assert metric(server, "tilespec_gc_full_collection_seconds_total") >= 0


def test_chat_stream_equals_non_stream_and_reports_usage(server):
    client = server.client()
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "abcabcabc"}], max_tokens=12, temperature=0.8,
               seed=3)
    full = client.chat.completions.create(**ask)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == len("<user>abcabcabc<assistant>")
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_text_and_token_prompts_and_stop_strings(server):
    client = server.client()
    a = client.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0)
    b = client.completions.create(model=MODEL, prompt=[1] + [3 + (ord(c) % 120) for c in "hello there"],
                                  max_tokens=16, temperature=0)
    text = a.choices[0].text
    assert text == b.choices[0].text and a.usage.completion_tokens == 16 and len(text) > 8
    stop = text[6:8]
    cut = client.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="hello there", max_tokens=16, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_concurrent_requests_match_their_solo_runs(server):
    """20 requests over 4 rows (mixed temperatures, top-p, lengths): each seeded request's text equals its text
    alone, and nothing is lost."""
    asks = [dict(model=MODEL, messages=[{"role": "user", "content": "xyz" * (1 + i % 5) + str(i)}],
                 max_tokens=4 + (7 * i) % 13, temperature=(0.0, 0.7, 1.0, 1.3)[i % 4], top_p=(1.0, 0.9)[i % 2],
                 seed=100 + i) for i in range(20)]

    async def run():
        client = server.client(openai.AsyncOpenAI)

        async def one(ask):
            out = await client.chat.completions.create(**ask)
            return out.choices[0].message.content, out.usage.completion_tokens

        crowd = await asyncio.gather(*(one(a) for a in asks))
        solo = [await one(asks[i]) for i in (0, 5, 10, 19)]
        return crowd, solo

    crowd, solo = asyncio.run(run())
    assert [c[1] for c in crowd] == [a["max_tokens"] for a in asks]
    assert solo == [crowd[i] for i in (0, 5, 10, 19)]


def wait_metric(srv, name, value, timeout=60.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if metric(srv, name) == value:
                return True
        except KeyError:                # not reported yet
            pass
        time.sleep(0.02)
    return False


def test_served_tokens_equal_offline_generation(server):
    """At T=0, and at T=1 with the same seed, the tokens a request streams over HTTP are the ones the same engine
    gives in-process (PagedEngine.generate): the process boundary changes nothing."""
    from tilespec.engine.paged import PagedEngine
    from tilespec.verify.types import SamplingParams
    tok = CharTokenizer()
    prompt = tok("the quick brown fox").input_ids
    engine = PagedEngine(make_target(), "ngram", max_batch=4, gamma=3, max_len=96, token_budget=8 + 4 * 4)
    for temperature, seed in ((0.0, 0), (1.0, 17)):
        offline = engine.generate([prompt], max_new_tokens=24, sampling=SamplingParams(temperature=temperature),
                                  seed=[seed])
        want = tok.decode(offline.sequences[0])
        streamed = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                                      temperature=temperature, seed=seed, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want


def test_disconnect_frees_the_blocks():
    """A client that goes away mid-stream cancels its request in the engine process: its blocks are freed."""
    srv = Server(make_app(engine_hook=stall_after(3)))
    try:
        assert wait_metric(srv, "tilespec_requests_cancelled_total", 0)
        before = 0
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(
                model=MODEL, prompt="abc", max_tokens=80, temperature=1.0, stream=True)) as resp:
            assert resp.status_code == 200
            assert next(resp.iter_lines()).startswith("data: ")
        assert wait_metric(srv, "tilespec_requests_cancelled_total", before + 1), "the disconnect was never a cancel"
        assert wait_metric(srv, "tilespec_requests_running", 0)
        assert wait_metric(srv, "tilespec_kv_cache_bytes", 0)
    finally:
        srv.stop()


@pytest.mark.parametrize("how", fast_first(["killed", "step raises"], 1))
def test_a_dead_engine_process_fails_requests_at_once(how):
    """The engine process dies mid-stream (SIGKILL, or a step that raises): the stream ends with an error event
    within seconds, /health turns 503 with the reason, and new requests get 503 -- nothing hangs."""
    import os
    import signal
    srv = Server(make_app(engine_hook=stall_after(3) if how == "killed" else fail_after(3)))
    client = srv.app.state.engine
    try:
        t0 = time.time()
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30, json=dict(
                model=MODEL, prompt="abc", max_tokens=80, temperature=1.0, stream=True)) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            if how == "killed":
                os.kill(client.process.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert time.time() - t0 < 20
        assert "engine" in rest[-1] and '"error"' in rest[-1]
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["reason"]
        after = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="a", max_tokens=2))
        assert after.status_code == 503
    finally:
        srv.stop()
    assert not client.process.is_alive()


def test_openai_style_errors(server):
    client = server.client()
    chat = dict(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", **chat)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, temperature=-1, **chat)
    with pytest.raises(openai.BadRequestError, match="over the context of 96"):
        client.completions.create(model=MODEL, prompt="x" * 90, max_tokens=20)
    with pytest.raises(openai.BadRequestError, match="n=5 is over this server's 4 batch rows"):
        client.chat.completions.create(model=MODEL, n=5, **chat)
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    engine = server.app.state.client
    engine.max_queue = 0
    try:
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, **chat)
    finally:
        engine.max_queue = 64
    engine.draining = True
    try:
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model=MODEL, **chat)
        assert httpx.get(f"{server.url}/health").status_code == 503
    finally:
        engine.draining = False


def test_graceful_shutdown_finishes_running_streams():
    srv = Server(make_app(draft=None, max_batch=2), grace=60)     # a loaded CI machine may take seconds
    got = {}

    def consume():
        stream = srv.client().completions.create(model=MODEL, prompt="abc", max_tokens=60, temperature=0,
                                                 stream=True)
        chunks = list(stream)
        got["text"] = "".join(c.choices[0].text for c in chunks)
        got["reason"] = chunks[-1].choices[0].finish_reason

    reader = threading.Thread(target=consume)
    reader.start()
    end = time.time() + 10
    while time.time() < end and metric(srv, "tilespec_requests_running") == 0:
        time.sleep(0.01)
    srv.stop()
    reader.join(timeout=20)
    assert got.get("reason") == "length" and len(got["text"]) > 30
    assert not srv.app.state.engine.process.is_alive()       # no engine process outlives the server


# make_target()'s model, built from the light test modules (serve_hooks, engine_models): importing test_serve there
# would import pytest, openai and uvicorn first, seconds before the engine's spawn, none of it under test
ORPHAN = """
import sys, time
sys.path[:0] = {paths!r}
import torch
from tilespec.serve import build_server
from engine_models import tiny_lm
from serve_hooks import CharTokenizer
torch.manual_seed(0)
target = tiny_lm(0, logit_scale=3.0)
target.generation_config.eos_token_id = None
app = build_server(target, CharTokenizer(), model_name="tiny", max_batch=2, max_len=64)
print(app.state.engine.process.pid, flush=True)
time.sleep(120)
"""


def test_the_engine_process_dies_with_the_server():
    """An API process killed outright (SIGKILL: none of its code runs) takes its engine process with it, so no
    orphan keeps the device's memory."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path
    script = ORPHAN.format(paths=[str(Path(__file__).parent), *sys.path])
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        end = time.monotonic() + 15
        while Path(f"/proc/{child}").exists() and time.monotonic() < end:
            stat = Path(f"/proc/{child}/stat").read_text() if Path(f"/proc/{child}/stat").exists() else ""
            if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
                break
            time.sleep(0.05)
        gone = not Path(f"/proc/{child}").exists() or \
            Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
        assert gone, f"the engine process {child} outlived its server"
    finally:
        parent.kill()
        parent.wait()


def connections_of(pid: int, port: int) -> int:
    """Established TCP connections to ``port`` whose sockets process ``pid`` holds (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for line in open("/proc/net/tcp").readlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01" and fields[9] in inodes:
            count += 1
    return count


@pytest.mark.slow
def test_two_api_processes_serve_one_port():
    """--api-servers 2: a second API process serves the same port (SO_REUSEPORT) beside the main one; requests over
    many connections all complete with the texts one process gives, and both processes end with the server."""
    from functools import partial

    from tilespec.serve import serve_engine
    from tilespec.serve.core import EngineSpec, given
    from tilespec.serve.processes import main_server
    spec = EngineSpec(load=partial(given, make_target(), "ngram", CharTokenizer()), warmup=False,
                      options=dict(max_batch=4, gamma=3, max_len=96, prefill_chunk=8))
    app = serve_engine(spec, model_name=MODEL, api_servers=2, shutdown_timeout=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, sock = main_server(app, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]))
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        asks = [dict(model=MODEL, prompt=f"ab{i}", max_tokens=10, temperature=0) for i in range(12)]

        def one(ask):
            with httpx.Client(timeout=60) as c:       # a connection each: the kernel spreads them
                out = c.post(f"{url}/v1/completions", json=ask).json()
                return out["choices"][0]["text"], out["usage"]["completion_tokens"]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(12) as pool:
            crowd = list(pool.map(one, asks))
        assert [one(asks[i]) for i in (0, 7)] == [crowd[0], crowd[7]] and all(n == 10 for _, n in crowd)
        extra = app.state.engine.api_processes
        assert len(extra) == 1 and extra[0].is_alive()
        if os.path.exists("/proc/net/tcp"):     # the second process listened before the first accepted: it holds
            held = [httpx.Client(timeout=60) for _ in range(16)]    # some of 16 kept connections (all: p = 2^-16)
            try:
                for c in held:
                    c.get(f"{url}/health")
                assert connections_of(extra[0].pid, port) > 0
            finally:
                for c in held:
                    c.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not app.state.engine.process.is_alive() and not app.state.engine.api_processes[0].is_alive()
