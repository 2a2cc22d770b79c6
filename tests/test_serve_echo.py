"""Completions' ``echo`` through ``tilespec serve`` (CPU, the tiny model of tests/test_serve.py on the paged engine):
the prompt's text before the completion's, streamed and whole, per choice; with ``logprobs`` the prompt's tokens
first (the first with no log-probability, the others the target's log-softmax over the prompt), offsets over the
whole echoed text; ``max_tokens`` 0 with echo scores the prompt alone; a BatchEngine server refuses echo with
logprobs with a 400; the engine loop splits the prompt entries across API processes."""
from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import test_serve  # noqa: E402
from serve_hooks import recording_loop  # noqa: E402
from test_serve import MODEL, CharTokenizer, make_target  # noqa: E402

TOK = CharTokenizer()
PROMPT = "hello there"


served = test_serve.server          # the tiny model's default server (one per test process)


def token(i: int) -> str:
    return TOK.decode([i], skip_special_tokens=False)


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)


def ref_log_softmax(ids: list) -> torch.Tensor:
    """Row j: the target's log-softmax after ids[:j + 1] (the distribution of token j + 1)."""
    with torch.no_grad():
        return torch.log_softmax(make_target()(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_puts_the_prompt_before_the_completion_streamed_and_not(served):
    base = dict(prompt=PROMPT, max_tokens=8, temperature=0)
    plain = post(served, base).json()["choices"][0]["text"]
    out = post(served, {**base, "echo": True}).json()
    assert out["choices"][0]["text"] == PROMPT + plain and out["choices"][0]["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": len(PROMPT) + 1, "completion_tokens": 8, "total_tokens": len(PROMPT) + 9}
    chunks = list(served.client().completions.create(model=MODEL, **base, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT                   # the first chunk carries the prompt's text
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    ids = [1, 10, 11, 12, 13]                                    # a token-id prompt echoes its ids decoded
    got = post(served, dict(prompt=ids, max_tokens=4, temperature=0, echo=True)).json()["choices"][0]["text"]
    alone = post(served, dict(prompt=ids, max_tokens=4, temperature=0)).json()["choices"][0]["text"]
    assert got == TOK.decode(ids) + alone
    many = post(served, dict(prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7, n=3, echo=True)).json()
    assert len(many["choices"]) == 3 and all(c["text"].startswith(PROMPT) for c in many["choices"])
    assert many["usage"]["completion_tokens"] == 15


def test_echo_logprobs_are_the_targets_log_softmax_over_the_prompt(served):
    k = 3
    body = dict(prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=k)
    out = post(served, body).json()
    choice = out["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    prompt = TOK(PROMPT).input_ids
    tokens, values, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    assert len(tokens) == len(prompt) + out["usage"]["completion_tokens"] == len(prompt) + 6
    assert len(values) == len(tops) == len(lp["text_offset"]) == len(tokens)
    assert values[0] is None and tops[0] is None                 # the first prompt token has no log-probability
    assert tokens[:len(prompt)] == [token(t) for t in prompt]
    assert text.startswith(PROMPT) and len("".join(tokens)) == len(text)
    assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert "".join(tokens[len(prompt):]) == text[len(PROMPT):]   # the generated tokens spell the completion
    # the numbers: the target's log-softmax over the prompt, then at each generated token (T=0: the argmax)
    ref = ref_log_softmax(prompt)
    gen = []
    for _ in range(6):                                           # greedy continuation, as the server's T=0
        nxt = int(ref[-1].argmax())
        gen.append(nxt)
        ref = ref_log_softmax(prompt + gen)
    ids = prompt + gen
    assert [token(t) for t in ids] == tokens
    for j in range(1, len(ids)):
        assert values[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        top = ref[j - 1].topk(k)
        assert len(tops[j]) <= k + 1 and {token(i) for i in top.indices.tolist()} <= set(tops[j])
        assert token(ids[j]) in tops[j]
    # streamed: the prompt's entries ride on the first chunk; all of them equal the whole response's
    chunks = list(served.client().completions.create(model=MODEL, **body, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.tokens[:len(prompt)] == tokens[:len(prompt)]
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == tokens
    assert [o for p in parts for o in p.text_offset] == lp["text_offset"]
    assert [v for p in parts for v in p.token_logprobs][1:] == pytest.approx(values[1:], abs=1e-6)
    assert "".join(c.choices[0].text for c in chunks) == text


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_scores_the_prompt_alone(served, stream):
    prompt = TOK(PROMPT).input_ids
    for extra in ({}, {"logprobs": 2}):
        body = dict(prompt=PROMPT, max_tokens=0, echo=True, stream=stream, **extra)
        if stream:
            chunks = list(served.client().completions.create(model=MODEL, **body,
                                                             stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage.model_dump()
            parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
            values = [v for p in parts for v in p.token_logprobs] if extra else None
        else:
            out = post(served, body).json()
            text, reason, usage = out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]
            lp = out["choices"][0]["logprobs"]
            values = lp["token_logprobs"] if extra else None
            assert (lp is None) == (not extra)
        assert text == PROMPT and reason == "length"
        assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(prompt)
        if extra:
            ref = ref_log_softmax(prompt)
            assert len(values) == len(prompt) and values[0] is None
            assert values[1:] == pytest.approx([ref[j - 1, prompt[j]].item() for j in range(1, len(prompt))],
                                               abs=1e-4)


def test_max_tokens_zero_without_echo_is_still_a_400(served):
    resp = post(served, dict(prompt="a", max_tokens=0))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    assert "echo" in resp.json()["error"]["message"]
    chat = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                      json=dict(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=0))
    assert chat.status_code == 400


@pytest.mark.slow
def test_the_batch_engine_refuses_echo_with_logprobs_and_echoes_without(tiny_batch_server):
    srv = tiny_batch_server             # make_app(engine="batch", warmup=False), shared with test_serve_logprobs.py
    resp = post(srv, dict(prompt="ab", max_tokens=2, echo=True, logprobs=1))
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "logprobs", resp.text
    assert "paged engine" in err["message"] and "echo" in err["message"]
    ok = post(srv, dict(prompt="ab", max_tokens=2, echo=True, temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith("ab")


def test_steps_carry_prompt_logprobs_to_the_api_process_of_their_request():
    loop, pushes = recording_loop(2)
    entries = [(-0.5, [(7, -0.5)]), (-2.0, [(9, -1.0)])]
    loop._send([(0, [7], None), (1, [3], None)], force=False, prompts={1: entries, 0: []})
    assert pushes[0].sent[0].prompt_logprobs == {0: []} and pushes[0].sent[0].logprobs is None
    assert pushes[1].sent[0].prompt_logprobs == {1: entries}
