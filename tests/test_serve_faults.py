"""``tilespec serve`` under faults while it serves (docs/reliability.md, server section): bad requests and clients
that go away arrive at the same moment as a crowd of well-formed streams. Each bad request gets its own status and
OpenAI's error body, each disconnected stream is cancelled, every well-formed stream ends with the text it gets
alone (T=0: exact under batching, drafts and preemption), and afterwards no request holds a K/V block.

A uvicorn server in a thread with the tiny model of tests/test_serve.py (its engine in a process of its own, ngram
drafts, 4 batch rows for 10 streams: most of them wait for a row while the faults arrive), once with the default
K/V cache and once with 6 usable blocks, where running rows run out of blocks and are preempted: the cancellations
and the recomputation then meet in the same blocks. Both are held to the texts of one serial run, on the first."""
from __future__ import annotations

import asyncio
import json
import logging
from urllib.parse import urlsplit

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from test_serve import MODEL, Server, make_app, metric, wait_metric  # noqa: E402

MAX_BODY_MB = 0.05
SMALL_CACHE = 7         # blocks of 16 slots: 6 beside the scratch block, 96 positions shared by the 4 rows


@pytest.fixture(scope="module", params=[pytest.param(None, marks=pytest.mark.slow), SMALL_CACHE],
                ids=["default cache", "preempting cache"])
def server(request):
    torch.set_num_threads(1)
    srv = Server(make_app(draft="ngram", max_body_mb=MAX_BODY_MB, num_blocks=request.param))
    srv.small_cache = request.param is not None
    yield srv
    srv.stop()


def well_formed() -> list:
    """(path, body) of 10 streamed T=0 requests: chat and completions, repetitive prompts (ngram drafts hit) and
    varied ones, a few lengths. Each holds 2-4 blocks of 16 at its end, so 4 rows of them overfill the small cache."""
    asks = []
    for i in range(10):
        prompt = ("abcab" * (4 + i % 3)) if i % 2 else f"the {i} quick brown fox jumps over the lazy dog"
        common = dict(model=MODEL, max_tokens=4 + (3 * i) % 6, temperature=0, stream=True)
        if i % 3 == 0:
            asks.append(("/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}])))
        else:
            asks.append(("/v1/completions", dict(common, prompt=prompt)))
    return asks


def text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple:
    """A streamed request read to its end -> (text, the last finish reason, error events)."""
    text, reason, errors = [], None, []
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            text.append(text_of(chunk))
            reason = chunk["choices"][0]["finish_reason"] or reason
    return "".join(text), reason, errors


async def walk_away(url: str, path: str, body: dict, chunks: int) -> int:
    """A streamed request whose client closes its connection after ``chunks`` data lines -> the lines it read."""
    seen = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= chunks:
                        break
    return seen


# data lines each leaving client reads: the completions' first carries tokens; the chat one leaves after its role
# chunk, which comes before any token (most likely while it still waits for a batch row)
GONE_AFTER = (1, 2, 3, 1)


async def upload_half(url: str, path: str) -> None:
    """A client that sends its headers and half its body, then closes the connection."""
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 8, "stream": True}).encode()
    where = urlsplit(url)
    _, writer = await asyncio.open_connection(where.hostname, where.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()


def bad_requests() -> list:
    """(name, path, raw body, expected status, expected param, words the message holds)."""
    big = json.dumps({"model": MODEL, "prompt": "x" * int(MAX_BODY_MB * 2**20 * 2), "stream": True}).encode()
    return [
        ("too large", "/v1/completions", big, 413, None, "max-body-mb"),
        ("malformed", "/v1/chat/completions", b'{"model": "tiny", "messages": [,], "stream": true}', 400, None,
         "line 1 column"),
        ("unsupported chat field", "/v1/chat/completions", json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "functions": [{"name": "f"}]}).encode(), 400, "functions", "functions"),
        ("unsupported completion field", "/v1/completions", json.dumps({
            "model": MODEL, "prompt": "ab", "suffix": "end", "stream": True}).encode(), 400, "suffix", "suffix"),
        ("prompt over the context", "/v1/completions", json.dumps({
            "model": MODEL, "prompt": "x" * 120, "stream": True}).encode(), 400, "prompt", "over the context"),
        ("max_tokens over the context", "/v1/chat/completions", json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500,
            "stream": True}).encode(), 400, "max_tokens", "lower max_tokens"),
    ]


ALONE: list = []        # each well-formed request's (text, finish reason, errors) sent alone, the first server's


async def bad(client: httpx.AsyncClient, path: str, raw: bytes) -> httpx.Response:
    return await client.post(path, content=raw, headers={"content-type": "application/json"})


def test_faults_amid_a_crowd_of_streams_disturb_no_request_and_leave_no_block_held(server, caplog):
    asks = well_formed()
    leaving = [("/v1/completions", dict(model=MODEL, prompt=f"abc{i}", max_tokens=80, temperature=1.0, seed=i,
                                        stream=True)) for i in range(3)]
    leaving.append(("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                                 max_tokens=70, temperature=1.0, seed=9, stream=True)))
    faults = bad_requests()

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as client:
            if not ALONE:           # T=0 tokens do not depend on the cache size: one serial run serves both servers
                ALONE.extend([await stream(client, path, body) for path, body in asks])
            alone = list(ALONE)
            cancelled = metric(server, "tilespec_requests_cancelled_total")
            crowd = asyncio.gather(*(stream(client, path, body) for path, body in asks))
            gone = asyncio.gather(*(walk_away(server.url, path, body, chunks)
                                    for (path, body), chunks in zip(leaving, GONE_AFTER)))
            refused = asyncio.gather(*(bad(client, path, raw) for _, path, raw, *_ in faults))
            halves = asyncio.gather(*(upload_half(server.url, path) for path in ("/v1/completions",
                                                                                  "/v1/chat/completions")))
            together = await asyncio.gather(crowd, gone, refused, halves)
            after = await stream(client, *asks[0])      # the server still answers as before
            return alone, cancelled, together, after

    caplog.set_level(logging.WARNING)
    preempted = metric(server, "tilespec_preemptions_total")
    alone, cancelled, (crowd, gone, refused, _), after = asyncio.run(run())

    assert all(reason == "length" and not errors and text for text, reason, errors in alone)
    assert crowd == alone and after == alone[0]
    assert gone == list(GONE_AFTER)
    for (name, _, _, status, param, words), resp in zip(faults, refused):
        assert resp.status_code == status, (name, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert err["param"] == param and words in err["message"], (name, err)
    assert wait_metric(server, "tilespec_requests_cancelled_total", cancelled + len(leaving)), \
        "a disconnected stream was not cancelled"
    assert wait_metric(server, "tilespec_requests_running", 0)
    assert wait_metric(server, "tilespec_kv_cache_bytes", 0), "K/V blocks stayed held after every request ended"
    assert httpx.get(f"{server.url}/health").status_code == 200
    # no fault was taken for the server's own failure (a half-sent body logged two tracebacks as a 500)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    if server.small_cache:          # the variant met what it exists for
        assert metric(server, "tilespec_preemptions_total") > preempted


def test_a_kv_cache_the_device_cannot_hold_ends_the_start_up_with_one_line():
    """The engine process cannot allocate its K/V blocks (2 PiB asked: the CPU allocator fails at once): the start-up
    ends with that error as one line, what was asked and what to lower (the CLI prints it as it is), no allocator
    traceback."""
    with pytest.raises(RuntimeError) as failed:
        make_app(num_blocks=2**40)
    line = str(failed.value)
    assert "\n" not in line and line.startswith("KVCacheTooLarge: the K/V cache does not fit: 1,099,511,627,776 blocks")
    assert "pass a smaller num_blocks" in line and "DefaultCPUAllocator" not in line
