"""``tilespec serve`` on bad or unusual input (docs/reliability.md, server section): every case works or gets
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` naming the field. A uvicorn server in a
thread with the tiny model of tests/test_serve.py; the CLI's checks before any model loads."""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serve_hooks import SlowTokenizer  # noqa: E402
from test_serve import MODEL, Server, make_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    app = make_app(draft="ngram", max_body_mb=0.05, tokenizer=SlowTokenizer())
    srv = Server(app)
    yield srv
    srv.stop()


def post(srv, path, body=None, content=None, headers=None):
    return httpx.post(f"{srv.url}{path}", json=body, content=content, headers=headers, timeout=60)


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


# ------------------------------------------------------------------------------------------------ text and size
@pytest.mark.parametrize("raw,param", [
    ('{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud83e"}]}', "messages.0.content"),
    ('{"model": "tiny", "prompt": "\\ud83e b"}', "prompt"),
    ('{"model": "\\ud83e", "prompt": "b"}', "model"),
])
def test_lone_surrogates_are_a_400(server, raw, param):
    path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
    err = error_of(post(server, path, content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == param and "surrogate" in err["message"]


def test_body_over_the_limit_is_a_413_also_when_chunked(server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    assert "max-body-mb" in error_of(post(server, "/v1/chat/completions", big), 413)["message"]

    def chunks():
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]
    error_of(httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), timeout=60), 413)


def test_tokenizing_runs_off_the_event_loop(server):
    SlowTokenizer.started.clear()
    SlowTokenizer.release.clear()
    got = {}
    ask = threading.Thread(target=lambda: got.update(r=post(server, "/v1/completions", {
        "model": MODEL, "prompt": "SLOW", "max_tokens": 3, "temperature": 0})))
    ask.start()
    try:
        assert SlowTokenizer.started.wait(30)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        assert not SlowTokenizer.release.is_set()     # /health answered while the tokenization was still held
    finally:
        SlowTokenizer.release.set()
    ask.join(60)
    assert got["r"].status_code == 200


# ------------------------------------------------------------------------------------------------ OpenAI fields
@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),      # no schema given
    ({"top_logprobs": 3}, "top_logprobs"),          # without logprobs: true
    ({"logprobs": 2}, "logprobs"),                  # chat's logprobs is a boolean
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "function", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages.0.tool_call_id"),     # which call it answers
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name"),    # no tools
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict"),
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
])
def test_unimplemented_or_bad_chat_fields_are_refused_by_name(server, extra, param):
    assert error_of(post(server, "/v1/chat/completions", {**CHAT, **extra}), 400)["param"] == param


@pytest.mark.parametrize("extra,param", [({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
                                         ({"suffix": "end", "echo": True}, "suffix")])
def test_unimplemented_completion_fields_are_refused_by_name(server, extra, param):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 2, **extra}
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


def test_accepted_forms_work(server):
    ok = [{"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
          {"response_format": {"type": "text"}},
          {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None}, {"role": "user", "content": [
                            {"type": "text", "text": "again"}]}]}]
    for extra in ok:
        assert post(server, "/v1/chat/completions", {**CHAT, **extra}).status_code == 200, extra


def test_penalties_bias_and_stop_rules_act(server):
    base = {"model": MODEL, "prompt": "hello there", "max_tokens": 12, "temperature": 0}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    forced = post(server, "/v1/completions", {**base, "logit_bias": {"50": 100}}).json()["choices"][0]["text"]
    assert forced == "y" * 12                       # id 50 decodes to chr(97 + 50 % 26)
    penalised = post(server, "/v1/completions", {**base, "frequency_penalty": 2.0, "presence_penalty": 2.0})
    text = penalised.json()["choices"][0]["text"]
    assert text != plain and max(text.count(c) for c in set(text)) <= max(plain.count(c) for c in set(plain))
    forced_stop = {**base, "logit_bias": {"50": 100}, "stop_token_ids": [50]}
    cut = post(server, "/v1/completions", forced_stop).json()
    assert cut["choices"][0]["text"] == "y" and cut["choices"][0]["finish_reason"] == "stop"
    held = post(server, "/v1/completions", {**forced_stop, "min_tokens": 3}).json()   # id 50 banned for 3 tokens
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["text"][3] == "y"
    assert post(server, "/v1/completions", {**base, "ignore_eos": True}).json()["choices"][0]["text"] == plain


def test_a_prompt_longer_than_the_context_says_so(server):
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 100}), 400)
    assert err["message"].startswith("the prompt is 101 tokens, 5 over the context of 96")
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "x" * 80, "max_tokens": 30}), 400)
    assert "lower max_tokens to at most 15" in err["message"] and err["param"] == "max_tokens"


# ------------------------------------------------------------------------------------------------ error shapes
def test_every_error_has_the_openai_shape(server):
    json_type = {"content-type": "application/json"}
    err = error_of(post(server, "/v1/completions", content=b'{"model": "tiny", "prompt": "a",, }', headers=json_type),
                   400)
    assert err["param"] is None and "line 1 column" in err["message"]
    assert "UTF-8" in error_of(post(server, "/v1/completions", content=b'{"model": "\xff"}', headers=json_type),
                               400)["message"]
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    assert "nested" in error_of(post(server, "/v1/completions", content=deep, headers=json_type), 400)["message"]
    error_of(post(server, "/v1/completions", content=b"[1, 2]", headers=json_type), 400)
    assert error_of(httpx.get(f"{server.url}/v1/nothing"), 404)["code"] == "not_found"
    error_of(httpx.get(f"{server.url}/v1/completions"), 405)
    engine = server.app.state.client
    engine.max_queue = 0
    try:
        resp = post(server, "/v1/chat/completions", CHAT)
        assert error_of(resp, 429)["type"] == "rate_limit_error" and resp.headers["retry-after"] == "1"
    finally:
        engine.max_queue = 64


def test_metrics_have_help_and_type_lines(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert "# HELP tilespec_requests_running" in text and "# TYPE tilespec_steps_total counter" in text
    assert "# TYPE tilespec_batch_slots gauge" in text


# ------------------------------------------------------------------------------------------------ API key, CORS
def test_api_key_and_cors():
    srv = Server(make_app(draft=None, max_batch=2, api_key="sekret", cors_origins=("http://ui.test",)))
    try:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 2}
        assert error_of(post(srv, "/v1/completions", body), 401)["code"] == "invalid_api_key"
        error_of(post(srv, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
        assert post(srv, "/v1/completions", body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        error_of(httpx.get(f"{srv.url}/v1/models"), 401)
        pre = httpx.options(f"{srv.url}/v1/completions", headers={
            "Origin": "http://ui.test", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.test"
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ the CLI
def no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the checks")


@pytest.fixture(autouse=True)
def _cli_modules_imported():
    """Import the CLI's subcommand modules before a test patches ``tilespec.api.load_pair``: one first imported
    under the patch (``from tilespec.api import load_pair``) would keep the stub for later tests."""
    import tilespec.cli.demo  # noqa: F401
    import tilespec.cli.generate  # noqa: F401
    import tilespec.cli.transcribe  # noqa: F401


@pytest.mark.parametrize("flags,expect", [(["--port", "99999"], "[1, 65535]"),
                                          (["--compile", "bogus"], "native-graphs"),
                                          (["--max-body-mb", "0"], "MiB"),
                                          (["--kv-fraction", "1.5"], "(0, 1]")])
def test_cli_refuses_bad_flags_before_loading(monkeypatch, capsys, flags, expect):
    from tilespec.cli import main
    monkeypatch.setattr("tilespec.api.load_pair", no_load)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--target", "tiny", *flags])
    assert exit_.value.code == 2 and expect in capsys.readouterr().err


def test_cli_reports_a_busy_port_or_cpu_graphs_before_loading(monkeypatch, capsys):
    from tilespec.cli import main
    monkeypatch.setattr("tilespec.api.load_pair", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--target", "tiny", "--device", "cpu", "--port", str(port)]) == 1
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    assert main(["serve", "--target", "tiny", "--device", "cpu", "--compile", "graphs"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err
