"""Logprobs through ``tilespec serve`` (CPU, the tiny model of tests/test_serve.py on the paged engine): chat's and
completions' shapes, streamed and whole; the numbers a client gets are exactly the engine's BatchEvent numbers
(recorded inside the engine process by a hook), which are the target's log-softmax at each emitted token; a stop
string cuts the logprobs where it cuts the text; bad values and an engine that cannot report logprobs get 400s."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tilespec.serve.text import TextStream  # noqa: E402

from serve_hooks import recording_loop  # noqa: E402
from test_serve import MODEL, CharTokenizer, make_target  # noqa: E402

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def served(tiny_server):
    """make_app(engine_hook=record_logprobs(path)): the session's ``tiny_server`` (tests/shared_fixtures.py), whose
    engine records its logprobs events; this module reads them from the events recorded from now on."""
    srv = tiny_server
    srv.events = Events(srv.logprobs_path)
    srv.events.seen = len(srv.logprobs_path.read_text().splitlines()) if srv.logprobs_path.exists() else 0
    yield srv


class Events:
    """The engine's recorded events: ``latest()`` the tokens and entries of the last request submitted (the tests
    send one at a time; a request cut by a stop string may add a step or two after its response)."""

    def __init__(self, path):
        self.path, self.seen = path, 0

    def latest(self) -> tuple:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        new, self.seen = [json.loads(line) for line in lines[self.seen:]], len(lines)
        last = max(rid for rid, _, _ in new)
        new = [(toks, lps) for rid, toks, lps in new if rid == last]
        return [t for toks, _ in new for t in toks], [e for _, lps in new for e in lps]


def token(i: int) -> str:
    return TOK.decode([i], skip_special_tokens=False)


def chat_ask(**kw):
    return dict(model=MODEL, messages=[{"role": "user", "content": "abcabcabc"}], max_tokens=12, temperature=0.8,
                seed=3, **kw)


def check_chat_content(content: list, tokens: list, entries: list, k: int) -> None:
    """OpenAI's chat shape, with the engine's own numbers for the engine's own tokens."""
    assert len(content) == len(tokens) == len(entries)
    for item, tok, (lp, top) in zip(content, tokens, entries):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["token"] == token(tok) and item["bytes"] == list(token(tok).encode())
        assert item["logprob"] == lp                    # exactly the BatchEvent's number
        assert len(item["top_logprobs"]) == k
        assert [(t["token"], t["logprob"], t["bytes"]) for t in item["top_logprobs"]] == \
            [(token(i), v, list(token(i).encode())) for i, v in top]


def test_chat_logprobs_are_the_engines_numbers_and_the_targets_log_softmax(served):
    out = httpx.post(f"{served.url}/v1/chat/completions", json=chat_ask(logprobs=True, top_logprobs=3),
                     timeout=60).json()
    tokens, entries = served.events.latest()
    choice = out["choices"][0]
    assert set(choice["logprobs"]) == {"content"}
    check_chat_content(choice["logprobs"]["content"], tokens, entries, 3)
    assert out["usage"]["completion_tokens"] == 12
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == choice["message"]["content"]
    # the engine's numbers: the target's log-softmax at each emitted token, its top 3 the likeliest there
    prompt = TOK(TOK.apply_chat_template(chat_ask()["messages"]), add_special_tokens=False).input_ids
    with torch.no_grad():
        ref = torch.log_softmax(make_target()(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    ref = ref[len(prompt) - 1:-1]
    for j, (tok, (lp, top)) in enumerate(zip(tokens, entries)):
        assert lp == pytest.approx(ref[j, tok].item(), abs=1e-4)
        values, ids = ref[j].topk(3)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    # through the openai client: the same numbers, in its types
    typed = served.client().chat.completions.create(**chat_ask(logprobs=True, top_logprobs=0))
    tokens, entries = served.events.latest()
    content = typed.choices[0].logprobs.content
    assert [c.logprob for c in content] == [lp for lp, _ in entries] and all(c.top_logprobs == [] for c in content)


def test_chat_stream_carries_each_chunks_logprobs(served):
    chunks = list(served.client().chat.completions.create(**chat_ask(logprobs=True, top_logprobs=2), stream=True))
    tokens, entries = served.events.latest()
    assert chunks[0].choices[0].logprobs is None                 # the role chunk
    content = []
    for c in chunks[1:]:
        got = [t.model_dump() for t in c.choices[0].logprobs.content]
        assert "".join(t["token"] for t in got) == (c.choices[0].delta.content or "")    # this chunk's tokens
        content += got
    check_chat_content(content, tokens, entries, 2)
    plain = list(served.client().chat.completions.create(**chat_ask(), stream=True))
    assert all(c.choices[0].logprobs is None for c in plain)       # not asked: none, and no engine entries
    assert not served.events.path.read_text().splitlines()[served.events.seen:]


def test_completion_logprobs_in_the_legacy_shape(served):
    ask = dict(model=MODEL, prompt="hello there", max_tokens=10, temperature=1.0, seed=5, logprobs=2)
    out = httpx.post(f"{served.url}/v1/completions", json=ask, timeout=60).json()
    tokens, entries = served.events.latest()
    lp = out["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [token(t) for t in tokens] and lp["token_logprobs"] == [e[0] for e in entries]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(tokens))]
    for top, tok, (chosen, alts) in zip(lp["top_logprobs"], tokens, entries):
        want = {token(i): v for i, v in alts}                 # the k alternatives and the chosen token
        want.setdefault(token(tok), chosen)
        assert len(alts) == 2 and set(top) == set(want) and len(top) <= 3
        if len({token(i) for i, _ in alts}) == 2:             # no two alternatives share a string: every value shows
            assert top == want
    streamed = list(served.client().completions.create(**{**ask, "stream": True}))
    tokens, entries = served.events.latest()
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs is not None]
    assert [e for p in parts for e in p.token_logprobs] == [e[0] for e in entries]
    assert [t for p in parts for t in p.tokens] == [token(t) for t in tokens]
    strings = [token(t) for t in tokens]
    assert [o for p in parts for o in p.text_offset] == [len("".join(strings[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_logprobs_with_the_text(served, stream):
    base = dict(model=MODEL, prompt="hello there", max_tokens=16, temperature=0)
    text = served.client().completions.create(**base).choices[0].text
    stop = text[6:8]
    want = text[:text.find(stop)]
    asked = served.client().completions.create(**base, stop=[stop], logprobs=1, stream=stream)
    chunks = list(asked) if stream else [asked]
    _, entries = served.events.latest()
    got = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert got == want and "".join(tokens) == want and len(tokens) == len(want)    # one character a token here
    assert values == [e[0] for e in entries][:len(want)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_settled_tokens_align_with_the_text_sent():
    """Tokens of several characters, and one of none: a stop string inside a token keeps that token and drops those
    after it; streamed in any batches, the counts handed out end where the whole text's does."""
    pieces = {1: "ab", 2: "", 3: "cde", 4: "f", 5: "gh"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    ids = [1, 2, 3, 4, 5]
    whole = TextStream(decode, ["d"], track=True)
    assert whole.push(ids, final=True) == "abc" and whole.settled_tokens(True) == 3      # "cde" is cut, kept
    assert [whole.start(i) for i in range(3)] == [0, 2, 2]
    for stops, final_count in (([], 5), (["fg"], 3), (["a"], 0)):      # "f" lies in the stop string: dropped
        for split in ([1] * 5, [2, 3], [5]):
            text, at, got = TextStream(decode, stops, track=True), 0, []
            for n in split:
                at += n
                text.push(ids[at - n:at], final=at == len(ids))
                got.append(text.settled_tokens(at == len(ids)))
                if text.stopped:
                    break
            assert got == sorted(got) and got[-1] == final_count, (stops, split, got)
    mid = TextStream(decode, ["zz"], track=True)       # a held-back character: its token waits
    mid.push([1])
    assert mid.sent == 1 and mid.settled_tokens(False) == 0
    mid.push([2, 4])
    assert mid.sent == 2 and mid.settled_tokens(False) == 1      # "ab" sent; the empty token waits for "f"
    mid.push([5], final=True)
    assert mid.settled_tokens(True) == 4


@pytest.mark.parametrize("path,extra,param", [
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"logprobs": 2}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": "3"}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_values_are_400s_naming_the_field(served, path, extra, param):
    body = chat_ask(**extra) if path == "chat" else dict(model=MODEL, prompt="ab", max_tokens=2, **extra)
    resp = httpx.post(f"{served.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    if extra.get("top_logprobs") == 3:
        assert "logprobs: true" in resp.json()["error"]["message"]     # it names the fix


@pytest.mark.slow
def test_the_batch_engine_refuses_logprobs_with_a_400_that_says_why(tiny_batch_server):
    srv = tiny_batch_server             # make_app(engine="batch", warmup=False), shared with test_serve_echo.py
    for stream in (False, True):
        resp = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_ask(logprobs=True, stream=stream))
        err = resp.json()["error"]
        assert resp.status_code == 400 and err["param"] == "logprobs", resp.text
        assert "paged engine" in err["message"] and "BatchEngine" in err["message"]
    resp = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="ab", max_tokens=2, logprobs=0))
    assert resp.status_code == 400 and "paged engine" in resp.json()["error"]["message"]
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat_ask(), timeout=60).status_code == 200


def test_steps_carry_logprobs_only_for_the_requests_that_asked():
    """The engine loop's split over two API processes gives each its own requests' entries; a step without any
    costs one nil byte more than the Step before logprobs (and one more for the prompt's logprobs, echo's)."""
    import msgspec

    from tilespec.serve.messages import Step, encode

    loop, pushes = recording_loop(2)
    entries = [(-0.5, [(7, -0.5), (9, -1.25)])]
    loop._send([(0, [7], None), (1, [3], None), (3, [4], "stop")], force=False, logprobs={3: entries})
    assert pushes[0].sent[0].logprobs is None and pushes[0].sent[0].outputs == [(0, [7], None)]
    assert pushes[1].sent[0].logprobs == {3: entries}
    class Before(msgspec.Struct, tag="Step", array_like=True):
        outputs: list
        stats: object = None

    outputs = [(0, [7, 8], None), (5, [9], "length")]
    assert len(encode(Step(outputs=outputs))) == len(encode(Before(outputs=outputs))) + 2
