"""Tool calls: the hermes / Qwen2.5 parser (whole texts, every streamed split), the parser registry, the request's
tools and tool messages as the chat template gets them, and end to end through ``tilespec serve`` (CPU, the tiny
model) with a character tokenizer whose chat template is Qwen2.5's and whose id ``CALL`` decodes to a whole
``<tool_call>`` block, so ``logit_bias`` makes the model call a tool."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tilespec.serve.protocol import APIError, ChatCompletionRequest  # noqa: E402
from tilespec.serve.tools import HermesToolParser, split, tool_parser_for  # noqa: E402

from serve_hooks import BLOCK, CALL, ToolTokenizer  # noqa: E402
from test_serve import MODEL, CharTokenizer, Server, make_app  # noqa: E402

ARGS = '{"city": "Paris", "unit": "C"}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"type": "string"}},
                                                "required": ["city"]}}}


# ------------------------------------------------------------------------------------------------ the parser
def whole(text: str, max_calls=None):
    content, calls = split(HermesToolParser(max_calls), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_parser_on_whole_texts():
    assert whole(BLOCK) == (None, [("get_weather", {"city": "Paris", "unit": "C"})])
    two = BLOCK + "\n" + BLOCK.replace("Paris", "Oslo")
    assert whole(two) == (None, [("get_weather", {"city": "Paris", "unit": "C"}),
                                 ("get_weather", {"city": "Oslo", "unit": "C"})])
    assert whole(two, max_calls=1) == (None, [("get_weather", {"city": "Paris", "unit": "C"})])
    assert whole("Let me look.\n" + BLOCK + "\n") == ("Let me look.", [("get_weather", {"city": "Paris",
                                                                                       "unit": "C"})])
    assert whole("a\n" + BLOCK + "\nb ") == ("a\n\nb", [("get_weather", {"city": "Paris", "unit": "C"})])
    # no calls: the text exactly, whitespace and partial openings included
    for text in ("plain text \n", "  ", "", "a <tool_", "x < y", "<tool_call", "</tool_call> stray"):
        assert whole(text) == (text, [])
    # blocks that hold no call stay text, as written
    for bad in ("<tool_call>\n{not json}\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "<tool_call>[1, 2]</tool_call>",
                '<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', '<tool_call>\n{"name": "f"'):
        assert whole("hi " + bad) == ("hi " + bad, []), bad
    assert whole('<tool_call>{"name": "f"}</tool_call>') == (None, [("f", {})])
    assert whole('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == (None, [("f", {"a": 1})])
    content, calls = split(HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"q": "é"}}</tool_call>')
    assert calls[0].arguments == '{"q": "é"}' and calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert calls[0].message() == {"id": calls[0].id, "type": "function",
                                  "function": {"name": "f", "arguments": '{"q": "é"}'}}


def streamed_parse(pieces: list, max_calls=None):
    parser = HermesToolParser(max_calls)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += parser.push(piece, final=i == len(pieces) - 1)
    content = "".join(d for d in deltas if isinstance(d, str))
    calls = [(d.name, d.arguments) for d in deltas if not isinstance(d, str)]
    return (content or None) if calls else content, calls, deltas


TEXTS = ["Let me look.\n" + BLOCK + "\n" + BLOCK.replace("Paris", "Oslo") + "\n", "a\n" + BLOCK + "\nb ",
         "no calls at all <tool_ here\n", "x<tool_call>{bad}</tool_call> y " + BLOCK,
         BLOCK[:40], "  \n" + BLOCK + "  tail  "]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_splits_give_the_whole_texts_result(text):
    """Split at every character boundary (two pieces), and one character a piece: the same content and calls as
    the whole text, and no delta is empty."""
    content, calls = split(HermesToolParser(), text)
    want = (content, [(c.name, c.arguments) for c in calls])
    for k in range(len(text) + 1):
        got = streamed_parse([text[:k], text[k:]])
        assert got[:2] == want, (k, got[:2])
        assert all(d for d in got[2] if isinstance(d, str))
    assert streamed_parse(list(text) + [""])[:2] == want
    content, calls = split(HermesToolParser(1), text)       # parallel_tool_calls false: the first call alone
    want = (content, [(c.name, c.arguments) for c in calls])
    assert streamed_parse([text[i:i + 7] for i in range(0, len(text), 7)] + [""], max_calls=1)[:2] == want


def test_held_back_text_waits_only_while_it_could_open_a_block():
    parser = HermesToolParser()
    assert parser.push("The weather <tool") == ["The weather"]       # " <tool" could begin a block
    assert parser.push("s> are") == [" <tools> are"]
    assert parser.push(" next\n\n") == [" next"]                       # trailing whitespace waits
    assert parser.push("", final=True) == ["\n\n"]                      # no call: the text exactly


# ------------------------------------------------------------------------------------------------ the registry
class Named:
    def __init__(self, name, template):
        self.name_or_path, self.chat_template = name, template


def test_the_parser_is_chosen_by_model_name_or_template():
    assert tool_parser_for(Named("Qwen/Qwen2.5-7B-Instruct", "{% if tools %}x{% endif %}"), "m") is HermesToolParser
    assert tool_parser_for(Named("", "{% for t in tools %}<tool_call>{% endfor %}"), "mine") is HermesToolParser
    assert tool_parser_for(Named("x", {"default": "a", "tool_use": "{{ tools }}"}), "qwen3-8b") is HermesToolParser
    with pytest.raises(APIError, match="the chat template of meta/llama does not render tools"):
        tool_parser_for(Named("meta/llama", "{{ messages }}"), "m")
    with pytest.raises(APIError, match="no tool-call parser for org/other"):
        tool_parser_for(Named("org/other", "{% if tools %}[TOOLS]{% endif %}"), "m")
    with pytest.raises(APIError, match="does not render tools") as err:
        tool_parser_for(CharTokenizer(), "tiny")       # its template is "turns"
    assert err.value.param == "tools" and err.value.status == 400


# ------------------------------------------------------------------------------------------------ the request
def test_tool_messages_reach_the_template_as_transformers_templates_take_them():
    body = ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22"}]})
    body.check_supported()
    turns = body.turns()
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "C"}}}]}
    assert turns[2] == {"role": "tool", "content": "22", "tool_call_id": "call_1"}
    assert body.template_tools() == [WEATHER]
    prompt = ToolTokenizer().apply_chat_template(turns, tools=body.template_tools())
    assert json.dumps(WEATHER) in prompt and "# Tools" in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + '}\n</tool_call>' \
        in prompt
    assert "<|im_start|>user\n<tool_response>\n22\n</tool_response><|im_end|>" in prompt
    assert ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "tool_choice": "none",
                                                 "messages": [{"role": "user", "content": "x"}]}
                                                ).template_tools() is None


def test_a_template_that_raises_on_the_messages_is_a_400():
    from jinja2.exceptions import TemplateError

    from tilespec.serve.completion import Completions

    class Raising(CharTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise TemplateError("Conversation roles must alternate user/assistant")

    completions = Completions(None, Raising(), "m")
    try:
        with pytest.raises(APIError, match="refused the messages: Conversation roles must alternate") as err:
            completions._chat_ids([{"role": "user", "content": "x"}], None)
        assert err.value.status == 400 and err.value.param == "messages"
    finally:
        completions.encode_pool.shutdown()


# ------------------------------------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def server():
    torch.set_num_threads(1)
    srv = Server(make_app(tokenizer=ToolTokenizer(), max_len=1024, prefill_chunk=64))
    yield srv
    srv.stop()


ASK = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
           temperature=0, max_tokens=8)
FORCE = dict(logit_bias={str(CALL): 100}, stop_token_ids=[CALL])     # the model answers with BLOCK, then stops


def test_a_tool_call_is_parsed_into_message_tool_calls(server):
    out = server.client().chat.completions.create(**ASK, extra_body=FORCE)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == ARGS
    # text first (min_tokens bans the stop id, which is also the call's id, for 3 tokens)
    out = server.client().chat.completions.create(**ASK, extra_body=dict(FORCE, min_tokens=3))
    choice = out.choices[0]
    assert len(choice.message.content) == 3 and choice.message.content.isalpha()
    assert choice.message.tool_calls[0].function.arguments == ARGS and choice.finish_reason == "tool_calls"
    assert out.usage.completion_tokens == 4


def test_a_streamed_tool_call_as_openai_streams_one(server):
    chunks = list(server.client().chat.completions.create(**ASK, stream=True, extra_body=dict(FORCE, min_tokens=3)))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(content) == 3
    head, args = calls
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert args.index == 0 and args.id is None and args.function.arguments == ARGS
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["tool_calls"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_several_calls_n_choices_and_parallel_tool_calls_false(server):
    ask = dict(ASK, max_tokens=2, extra_body={"logit_bias": {str(CALL): 100}})     # two blocks, then the length
    out = server.client().chat.completions.create(**ask, n=2)
    for choice in out.choices:
        assert [c.function.arguments for c in choice.message.tool_calls] == [ARGS, ARGS]
        assert choice.finish_reason == "length"          # cut by max_tokens: the length, not a finished call
        assert len({c.id for c in choice.message.tool_calls}) == 2
    one = server.client().chat.completions.create(**ask, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    chunks = list(server.client().chat.completions.create(**ask, n=2, stream=True))
    by_index = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            by_index.setdefault(c.choices[0].index, []).append((tc.index, tc.function.arguments))
    assert by_index == {i: [(0, ""), (0, ARGS), (1, ""), (1, ARGS)] for i in (0, 1)}


def test_tool_choice_none_offers_no_tools_and_parses_nothing(server):
    plain = server.client().chat.completions.create(**{**ASK, "tools": None}, extra_body=FORCE)
    offered = server.client().chat.completions.create(**ASK, extra_body=FORCE)
    none = server.client().chat.completions.create(**ASK, tool_choice="none", extra_body=FORCE)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens
    assert none.choices[0].message.content == BLOCK and not none.choices[0].message.tool_calls
    assert none.choices[0].finish_reason == "stop"
    auto = server.client().chat.completions.create(**ASK, tool_choice="auto", extra_body=FORCE)
    assert auto.usage.prompt_tokens == offered.usage.prompt_tokens and auto.choices[0].message.tool_calls


def test_a_conversation_with_calls_and_results_is_rendered(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22"}]
    out = server.client().chat.completions.create(**{**ASK, "messages": messages})
    turns = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages}).turns()
    want = ToolTokenizer().apply_chat_template(turns, tools=[WEATHER])
    assert out.usage.prompt_tokens == len(want) and out.choices[0].finish_reason == "length"


def test_logprobs_ride_along_with_a_parsed_stream(server):
    body = dict(ASK, stream=True, logprobs=True, extra_body=dict(FORCE, min_tokens=3))
    chunks = list(server.client().chat.completions.create(**body))
    entries = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(entries) == 4 and entries[-1].token == BLOCK


@pytest.mark.parametrize("extra,param,says", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice.function.name",
     "not among the tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict",
     "only when the call is forced"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name", "Field required"),
])
def test_unsupported_tool_requests_are_400s_that_say_why(server, extra, param, says):
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**ASK, **extra}, timeout=60)
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == param and says in err["message"], resp.text
    if param == "tools.0.function.strict":
        assert '"auto"' in err["message"] and "strict: false" in err["message"]      # it names what works
