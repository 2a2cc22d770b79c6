"""``n`` > 1 through ``tilespec serve`` (CPU, the tiny model of tests/test_serve.py): n choices of one prompt, each its
own engine request seeded ``seed + i``, so choice i is exactly the request alone with that seed; shapes streamed and
whole, per-choice stop strings and logprobs, usage counting the prompt once; a disconnect cancels every choice;
limits (batch rows, queue) are 400s naming them and a full queue a 429."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tilespec.serve.completion import choice_seeds  # noqa: E402

from serve_hooks import stall_after  # noqa: E402
import test_serve  # noqa: E402
from test_serve import MODEL, Server, make_app, wait_metric  # noqa: E402
from tiers import fast_first  # noqa: E402

CHAT = dict(model=MODEL, messages=[{"role": "user", "content": "abcabcabc"}], max_tokens=10)
PROMPT = dict(model=MODEL, prompt="hello there", max_tokens=10)


server = test_serve.server          # the tiny model's default server (one per test process)


def post(srv, path, body, **kw):
    return httpx.post(f"{srv.url}/v1/{path}", json=body, timeout=60, **kw)


def texts(out: dict) -> list:
    return [c["message"]["content"] if "message" in c else c["text"] for c in out["choices"]]


def streamed(srv, path, body) -> tuple:
    """(text per index, finish reasons per index, every chunk) of a streamed response."""
    api = srv.client().chat.completions if path == "chat" else srv.client().completions
    chunks = list(api.create(**body, stream=True, stream_options={"include_usage": True}))
    got, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = (c.delta.content or "") if path == "chat" else c.text
            got[c.index] = got.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return got, reasons, chunks


def test_choice_seeds_are_seed_plus_i_within_int64():
    assert choice_seeds(5, 3) == [5, 6, 7]
    assert choice_seeds(2**63 - 1, 2) == [2**63 - 1, -2**63]
    fresh = choice_seeds(None, 4)
    assert len(set(fresh)) == 4 and all(0 <= s < 2**62 for s in fresh)


@pytest.mark.parametrize("path", fast_first(["chat", "completions"], 1))
def test_n_choices_in_index_order_each_the_request_alone_with_seed_plus_i(server, path):
    base = CHAT if path == "chat" else PROMPT
    route = "chat/completions" if path == "chat" else "completions"
    ask = dict(base, temperature=1.0, seed=40)
    out = post(server, route, dict(ask, n=3)).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    solo = [post(server, route, dict(ask, seed=40 + i)).json() for i in range(3)]
    assert texts(out) == [texts(s)[0] for s in solo]
    assert len(set(texts(out))) > 1                     # sampled: the seeds differ, so do the choices
    # usage: the prompt once, every choice's completion tokens
    assert out["usage"]["prompt_tokens"] == solo[0]["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 3 * 10
    assert out["usage"]["total_tokens"] == solo[0]["usage"]["prompt_tokens"] + 30
    # streamed: the same texts per index, one finish each, one usage chunk at the end
    got, reasons, chunks = streamed(server, path, dict(ask, n=3))
    assert [got[i] for i in range(3)] == texts(out)
    assert reasons == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert [c.usage for c in chunks if c.usage is not None][-1].model_dump(exclude_none=True) == out["usage"]
    assert sum(1 for c in chunks if c.usage is not None) == 1 and not chunks[-1].choices
    if path == "chat":          # each choice opens with its role
        firsts = {}
        for chunk in chunks:
            for c in chunk.choices:
                firsts.setdefault(c.index, c.delta.role)
        assert firsts == {0: "assistant", 1: "assistant", 2: "assistant"}


def test_greedy_choices_are_all_equal_and_unseeded_ones_differ(server):
    out = server.client().chat.completions.create(**CHAT, n=4, temperature=0)
    assert len({c.message.content for c in out.choices}) == 1 and len(out.choices) == 4
    free = server.client().completions.create(**PROMPT, n=4, temperature=1.0)
    assert len({c.text for c in free.choices}) > 1      # independent random seeds


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_each_choice_on_its_own(server, stream):
    ask = dict(PROMPT, max_tokens=16, temperature=1.0, seed=9)
    whole = texts(post(server, "completions", dict(ask, n=3)).json())
    stop = whole[1][4:6]
    want = [t[:t.find(stop)] if stop in t else t for t in whole]
    reasons_want = ["stop" if stop in t else "length" for t in whole]
    if stream:
        got, reasons, _ = streamed(server, "completions", dict(ask, n=3, stop=stop))
        assert [got[i] for i in range(3)] == want and [reasons[i] for i in range(3)] == [[r] for r in reasons_want]
    else:
        out = post(server, "completions", dict(ask, n=3, stop=stop)).json()
        assert texts(out) == want and [c["finish_reason"] for c in out["choices"]] == reasons_want


def test_each_choice_has_its_own_logprobs(server):
    out = server.client().chat.completions.create(**CHAT, n=2, temperature=1.0, seed=4, logprobs=True,
                                                  top_logprobs=1)
    for c in out.choices:
        content = c.logprobs.content
        assert len(content) == 10 and "".join(t.token for t in content) == c.message.content
    assert out.choices[0].logprobs.content != out.choices[1].logprobs.content
    parts = {}
    for chunk in server.client().completions.create(**PROMPT, n=2, temperature=1.0, seed=4, logprobs=0,
                                                    stream=True):
        c = chunk.choices[0]
        if c.logprobs is not None:
            parts.setdefault(c.index, []).extend(c.logprobs.tokens)
    assert sorted(parts) == [0, 1] and all(len(v) == 10 for v in parts.values())


@pytest.mark.parametrize("n,says", [(0, "greater than or equal to 1"), (129, "less than or equal to 128"),
                                    (5, "4 batch rows (--max-batch)"), ("two", "integer")])
def test_bad_n_is_a_400_naming_it(server, n, says):
    for route, base in (("chat/completions", CHAT), ("completions", PROMPT)):
        resp = post(server, route, dict(base, n=n))
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
        assert says in resp.json()["error"]["message"]


def test_n_over_the_queue_is_a_400_and_best_of_under_n_too(server):
    engine = server.app.state.client
    engine.max_queue = 2
    try:
        resp = post(server, "completions", dict(PROMPT, n=3))
        assert resp.status_code == 400 and "--max-queue" in resp.json()["error"]["message"]
        assert post(server, "completions", dict(PROMPT, n=2)).status_code == 200
    finally:
        engine.max_queue = 64
    resp = post(server, "completions", dict(PROMPT, n=2, best_of=1))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of"


def test_a_disconnect_cancels_every_choice_and_n_counts_against_the_queue():
    """On an engine that stalls after 3 steps (requests end only by cancellation): a streamed n=3 request whose
    client goes away cancels its 3 engine requests (the blocks are freed); a whole n=2 one too, noticed while it
    waits; with 2 choices waiting, a queue of 3 refuses 2 more with a 429."""
    srv = Server(make_app(engine_hook=stall_after(3)))
    try:
        assert wait_metric(srv, "tilespec_requests_cancelled_total", 0)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(
                PROMPT, max_tokens=80, temperature=1.0, stream=True, n=3)) as resp:
            assert resp.status_code == 200
            assert next(resp.iter_lines()).startswith("data: ")
        assert wait_metric(srv, "tilespec_requests_cancelled_total", 3), "not every choice was cancelled"
        assert wait_metric(srv, "tilespec_requests_running", 0)
        assert wait_metric(srv, "tilespec_kv_cache_bytes", 0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/chat/completions", json=dict(CHAT, n=2, max_tokens=60), timeout=1.5)
        assert wait_metric(srv, "tilespec_requests_cancelled_total", 5)
        client = srv.app.state.client
        client.max_queue = 3
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(
                PROMPT, max_tokens=80, stream=True, n=2)) as held:
            lines = held.iter_lines()       # kept: a dropped iterator closes the connection (the disconnect above)
            assert next(lines).startswith("data: ")
            refused = httpx.post(f"{srv.url}/v1/completions", json=dict(PROMPT, n=2), timeout=30)
            assert refused.status_code == 429 and "2 more" in refused.json()["error"]["message"]
        assert wait_metric(srv, "tilespec_requests_cancelled_total", 7)
        assert not client.streams
    finally:
        srv.stop()
