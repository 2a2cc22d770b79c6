"""Structured outputs through ``tilespec serve`` (serve/structured.py; the engine's masks: engine/paged/grammar.py).

Unit tests of the parser (every field to the engine's (kind, spec) pair, conflicts and malformed values to 400s
naming the field, the grammar parsed in the API process), the grammar over the engine process's messages; end to
end on the tiny model of tests/test_serve.py with a tokenizer whose ids are printable ASCII (the model's output is
random text: only the masks make it JSON), its paged engine drafting with ngram: choice, regex, EBNF, json_object
and json_schema outputs in their language, streamed and whole, on both endpoints, the same tokens with drafts and
without (gamma 0); a grammar the engine refuses and a BatchEngine server come back as 400s."""
from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from tilespec.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest  # noqa: E402
from tilespec.serve.structured import Constraint, check_grammar, constraint_of  # noqa: E402

from serve_hooks import ToolAsciiTokenizer  # noqa: E402
from test_serve import MODEL, Server, make_app  # noqa: E402


def started(tokenizer):
    """make_app()'s paged engine with ngram drafts, over ``tokenizer``, with room for JSON (a fixture's body)."""
    torch.set_num_threads(1)
    srv = Server(make_app(tokenizer=tokenizer, max_len=192, default_max_tokens=96))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served():
    """The module's one server, over ToolAsciiTokenizer (AsciiTokenizer with id 98 a newline and a template that
    renders tools): the grammar tests need printable-ASCII ids and no EOS, the forced tool calls also the template
    and the newline; one engine start (a spawned process importing torch and transformers) serves both."""
    yield from started(ToolAsciiTokenizer())


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["x", "y"]}},
          "required": ["ok", "pick"], "additionalProperties": False}


# ------------------------------------------------------------------------------------------------ the parser
def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)


@pytest.mark.parametrize("fields,param,pair", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, "response_format", ("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     "response_format.json_schema.schema", ("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": SCHEMA}, "guided_json", ("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json", ("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[a-c]{3}"}, "guided_regex", ("regex", "[a-c]{3}")),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", ("choice", '["yes", "no"]')),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", ("ebnf", 'root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", ("regex", "a+")),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", ("choice", '["a"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar", ("ebnf", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True, "whitespace_pattern": None}},
     "structured_outputs.json_object", ("json_object", "")),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_regex", ("regex", "a")),
])
def test_every_field_reads_into_the_engines_pair(fields, param, pair):
    for body in (chat(**fields), CompletionRequest(model=MODEL, prompt="hi", **fields)):     # both endpoints
        c = constraint_of(body)
        assert (c is None and pair is None) or (c.param, c.pair) == (param, pair)


@pytest.mark.parametrize("fields,param,words", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "guided_json, guided_regex each constrain"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "send one of them"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "send one"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
    ({"response_format": {}}, "response_format.type", "must be \"text\""),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "with a JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format.json_schema.schema",
     "is missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "must be a JSON Schema object"),
    ({"guided_json": 3}, "guided_json", "must be a JSON Schema object"),
    ({"guided_regex": 5}, "guided_regex", "must be a string"),
    ({"guided_regex": ""}, "guided_regex", "is empty"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a", 3]}, "guided_choice.1", "non-empty string"),
    ({"guided_choice": ["a", ""]}, "guided_choice.1", "is empty"),
    ({"guided_grammar": ""}, "guided_grammar", "EBNF"),
    ({"structured_outputs": ["a"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml", "not a field"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
])
def test_conflicts_and_malformed_fields_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as err:
        constraint_of(chat(**fields))
    assert (err.value.status, err.value.param) == (400, param) and words in err.value.message, err.value.message


@pytest.mark.parametrize("c,words", [
    (Constraint("guided_regex", "regex", "[a-"), "Unclosed '['"),
    (Constraint("guided_json", "json_schema", '{"type": "objx"}'), 'Unsupported type "objx"'),
    (Constraint("guided_grammar", "ebnf", 'start ::= "a"'), "root rule"),
])
def test_grammars_are_parsed_in_the_api_process(c, words):
    with pytest.raises(APIError) as err:
        check_grammar(c)
    assert err.value.param == c.param and words in err.value.message and "/project/" not in err.value.message
    for ok in (Constraint("p", "regex", "[a-c]+"), Constraint("p", "json_schema", json.dumps(SCHEMA)),
               Constraint("p", "ebnf", 'root ::= "a"'), Constraint("p", "json_object", ""),
               Constraint("p", "choice", '["a"]')):
        check_grammar(ok)


def test_the_grammar_crosses_to_the_engine_process():
    from tilespec.engine.batch_request import BatchRequest
    from tilespec.serve.core import request_of
    from tilespec.serve.startup import _refused
    from tilespec.serve.messages import Submit, decode_to_engine, encode
    msg = decode_to_engine(encode(Submit(id=3, prompt=[1, 2], max_tokens=4, temperature=0.0, top_k=0, top_p=1.0,
                                         min_p=0.0, seed=1, grammar=("regex", "[ab]+"))))
    assert request_of(msg).grammar == ("regex", "[ab]+")
    plain = decode_to_engine(encode(Submit(id=4, prompt=[1], max_tokens=1, temperature=0.0, top_k=0, top_p=1.0,
                                           min_p=0.0, seed=1)))
    assert request_of(plain).grammar is None

    class Engine:
        def check(self, req: BatchRequest):
            if req.grammar is not None:
                raise ValueError("no grammars here")
    assert _refused(Engine(), grammar=("json_object", "")) == "no grammars here"
    assert _refused(Engine(), logprobs=0) is None

    class Odd:
        def check(self, req: BatchRequest):
            raise RuntimeError("this tokenizer has no vocabulary")
    assert _refused(Odd(), grammar=("json_object", "")) == "RuntimeError: this tokenizer has no vocabulary"


# ------------------------------------------------------------------------------------------------ over HTTP
def ask(srv, path="/v1/chat/completions", **fields):
    body = {"model": MODEL, "max_tokens": 64, "temperature": 1.0, "seed": 5, **fields}
    if path.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "give me json"}])
    else:
        body.setdefault("prompt", "give me json")
    return httpx.post(f"{srv.url}{path}", json=body, timeout=120)


def texts(resp) -> list:
    assert resp.status_code == 200, resp.text
    return [(c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
            for c in resp.json()["choices"]]


def streamed(srv, path="/v1/chat/completions", **fields) -> tuple:
    """A streamed request's text and last finish reason (one choice)."""
    body = {"model": MODEL, "max_tokens": 64, "temperature": 1.0, "seed": 5, "stream": True, **fields}
    chat_path = path.endswith("chat/completions")
    body.setdefault("messages" if chat_path else "prompt",
                    [{"role": "user", "content": "give me json"}] if chat_path else "give me json")
    parts, reason = [], None
    with httpx.stream("POST", f"{srv.url}{path}", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            c = chunk["choices"][0]
            parts.append((c["delta"].get("content") if chat_path else c["text"]) or "")
            reason = c["finish_reason"] or reason
    return "".join(parts), reason


def valid(text: str) -> bool:
    """``text`` is SCHEMA's: an object with exactly ok (a boolean) and pick ("x" or "y")."""
    value = json.loads(text)
    return set(value) == {"ok", "pick"} and isinstance(value["ok"], bool) and value["pick"] in ("x", "y")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_choice_regex_and_grammar_outputs_are_in_their_language(served, path):
    choices = ["red", "green", "blue"]
    for fields, check in ((dict(guided_choice=choices), lambda t: t in choices),
                          (dict(guided_regex="[a-c]{3}-[0-9]{2}"), lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
                          (dict(guided_grammar='root ::= "[" ("a" | "b")* "]"'),
                           lambda t: re.fullmatch(r"\[[ab]*\]", t)),
                          (dict(structured_outputs={"choice": choices}), lambda t: t in choices)):
        got = texts(ask(served, path, n=3, **fields))
        assert all(check(t) and reason == "stop" for t, reason in got), (fields, got)
        assert streamed(served, path, **fields) == got[0]          # choice 0 is the request alone, seed 5


def test_json_schema_outputs_follow_the_schema_with_drafts_and_without(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    got = texts(ask(served, n=4, response_format=fmt, max_tokens=96))
    done = [t for t, reason in got if reason == "stop"]
    assert len(done) >= 2 and all(valid(t) for t in done), got          # cut by max_tokens: whitespace runs
    assert texts(ask(served, n=4, response_format=fmt, max_tokens=96, gamma=0)) == got     # drafts change nothing
    assert texts(ask(served, "/v1/completions", n=2, guided_json=SCHEMA, max_tokens=96))[0][0] == \
        texts(ask(served, "/v1/completions", guided_json=json.dumps(SCHEMA), max_tokens=96))[0][0]
    client = served.client()            # the openai client's own response_format argument
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "give me json"}],
                                         max_tokens=96, temperature=1.0, seed=5, response_format=fmt)
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == got[0]
    assert streamed(served, response_format=fmt, max_tokens=96) == got[0]


def test_json_object_outputs_parse(served):
    got = texts(ask(served, n=4, response_format={"type": "json_object"}, max_tokens=96))
    done = [t for t, reason in got if reason == "stop"]
    assert done and all(isinstance(json.loads(t), (dict, list)) for t in done), got     # xgrammar's JSON: {} or []
    assert texts(ask(served, n=4, response_format={"type": "json_object"}, max_tokens=96, gamma=0)) == got


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_grammar_is_a_400_before_the_request_is_accepted(served, stream):
    resp = ask(served, guided_regex="[a-", stream=stream)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_regex"
    assert "Unclosed '['" in resp.json()["error"]["message"]
    resp = ask(served, "/v1/completions", guided_choice=["a"], guided_regex="a", stream=stream)
    assert resp.status_code == 400 and "guided_regex, guided_choice each" in resp.json()["error"]["message"]


def test_a_grammar_the_engine_refuses_comes_back_as_a_400_with_its_message(served, monkeypatch):
    """Without the API process's parse, the engine's own check refuses it (Rejected): a 400 with its reason."""
    monkeypatch.setattr("tilespec.serve.completion.check_grammar", lambda c: None)
    resp = ask(served, guided_regex="[a-")
    assert resp.status_code == 400 and "does not compile" in resp.json()["error"]["message"], resp.text
    assert texts(ask(served, guided_choice=["ok"]))[0] == ("ok", "stop")      # the engine serves on


@pytest.mark.slow
def test_the_batch_engine_refuses_structured_outputs_with_a_400_that_says_why(tiny_batch_server):
    srv = tiny_batch_server                 # make_app(engine="batch", warmup=False), shared with the logprobs tests
    for path, fields in (("/v1/chat/completions", dict(response_format={"type": "json_object"})),
                         ("/v1/completions", dict(guided_choice=["a", "b"], stream=True))):
        resp = ask(srv, path, **fields)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "unsupported_parameter" and err["param"] == next(iter(fields))
        assert "BatchEngine" in err["message"] and "paged engine" in err["message"]
    assert ask(srv, response_format={"type": "text"}, max_tokens=2).status_code == 200


# ------------------------------------------------------------------------------------------------ forced tool calls
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ARGS = {"get_weather": ("city", ("Paris", "Rome")), "get_time": ("zone", ("UTC", "CET"))}


@pytest.fixture(scope="module")
def tooled(served):
    """The forced tool calls' server: the module's one server (``served``)."""
    return served


def calls_of(resp) -> list:
    """Per choice: (content, finish reason, [(name, arguments)...]), each call's arguments checked against TOOLS."""
    assert resp.status_code == 200, resp.text
    out = []
    for c in resp.json()["choices"]:
        calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c["message"]["tool_calls"]]
        for name, args in calls:
            key, allowed = ARGS[name]
            assert set(args) == {key} and args[key] in allowed, calls
        out.append((c["message"]["content"], c["finish_reason"], calls))
    return out


def test_forced_tool_calls_follow_the_tools_schemas_with_drafts_and_without(tooled):
    named = {"type": "function", "function": {"name": "get_time"}}
    got = calls_of(ask(tooled, n=4, tools=TOOLS, tool_choice=named, max_tokens=96))
    assert all(content is None and reason == "tool_calls" and [n for n, _ in calls] == ["get_time"]
               for content, reason, calls in got), got
    assert calls_of(ask(tooled, n=4, tools=TOOLS, tool_choice=named, max_tokens=96, gamma=0)) == got     # drafts change nothing
    required = calls_of(ask(tooled, n=4, seed=9, tools=TOOLS, tool_choice="required", max_tokens=96))
    assert all(len(calls) == 1 and reason == "tool_calls" for _, reason, calls in required), required
    body = {"model": MODEL, "max_tokens": 96, "temperature": 1.0, "seed": 5, "stream": True, "tools": TOOLS,
            "tool_choice": named, "messages": [{"role": "user", "content": "give me json"}]}
    deltas, reason = [], None
    with httpx.stream("POST", f"{tooled.url}/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                deltas += c["delta"].get("tool_calls") or []
                reason = c["finish_reason"] or reason
    name = next(d["function"]["name"] for d in deltas if d["function"].get("name"))
    args = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert (None, reason, [(name, json.loads(args))]) == got[0]        # choice 0 is the request alone, seed 5


def test_a_forced_call_conflicts_with_another_constraint(tooled):
    resp = ask(tooled, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "tool_choice" and "send one of them" in err["message"]


def test_a_forced_call_over_parameters_that_are_no_schema_is_a_400_naming_tools():
    body = chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
                tool_choice="required")
    with pytest.raises(APIError) as err:
        constraint_of(body)
    assert err.value.body()["error"]["param"] == "tools" and "nonsense" in str(err.value)
