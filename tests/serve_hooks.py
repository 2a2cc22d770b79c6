"""Engine hooks for the server tests: picklable functions that ``build_server(engine_hook=...)`` runs on the engine
inside the engine process, to stall or break its steps there; and the servers' tokenizer, ``CharTokenizer``.

Everything here is pickled into the engine process, which imports this module to unpickle it: it imports nothing
heavy (no pytest, openai, uvicorn or test module), so an engine process starts in the time its model needs."""
from __future__ import annotations

import threading
import time


class CharTokenizer:
    """Characters <-> ids (vocab 128); a chat template joining every turn; no EOS (completions run to length)."""

    chat_template = "turns"
    eos_token_id = None
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = ([1] if add_special_tokens else []) + [3 + (ord(c) % 120) for c in text]
        return type("Enc", (), {"input_ids": ids})()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids if i > 2)


# the tokenizers of tests/test_serve_hardening.py, test_serve_structured.py and test_serve_tools.py: pickled into
# their servers' engine processes with the model, so defined here (defined in a test module, the engine process would
# import it to unpickle them, and pytest, openai and uvicorn with it: seconds of each engine start)
class SlowTokenizer(CharTokenizer):
    """CharTokenizer that, over a prompt holding "SLOW", says it started and then holds until ``release`` is set
    (at most 60 s): a tokenization in progress for as long as the test needs, with no clock involved."""

    started = threading.Event()
    release = threading.Event()

    def __call__(self, text, add_special_tokens=True):
        if "SLOW" in text:
            self.started.set()
            self.release.wait(60)
        return super().__call__(text, add_special_tokens)


class AsciiTokenizer(CharTokenizer):
    """Ids 3-97 are the printable ASCII characters (" " to "~"); 0-2 and 98-127 decode to nothing (a grammar never
    allows them); no EOS, so a request ends when its grammar completes (or at max_tokens)."""

    def __call__(self, text, add_special_tokens=True):
        ids = ([1] if add_special_tokens else []) + [3 + ord(c) - 32 if " " <= c <= "~" else 3 for c in text]
        return type("Enc", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(29 + i) if 3 <= i < 98 else "" for i in ids)

    def __len__(self):
        return 98


class ToolAsciiTokenizer(AsciiTokenizer):
    """AsciiTokenizer with id 98 a newline (the call block's separator) and a chat template that renders tools and
    names the hermes format (``<tool_call>``), so the server offers tools and parses the block."""

    chat_template = "{% for t in tools %}{{ t.function.name }} {% endfor %}<tool_call> {{ messages[-1].content }}"

    def __call__(self, text, add_special_tokens=True):
        ids = super().__call__(text.replace("\n", " "), add_special_tokens).input_ids
        return type("Enc", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i == 98 else super(ToolAsciiTokenizer, self).decode([i]) for i in ids)

    def __len__(self):
        return 99

    def apply_chat_template(self, turns, tools=None, tokenize=False, add_generation_prompt=True):
        names = " ".join(t["function"]["name"] for t in tools or ())
        return f"{names} <tool_call> {turns[-1]['content']}"


# Qwen2.5-Instruct's chat template (tools in the system turn, calls and responses as the model was trained on)
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

CALL = 50       # decodes to BLOCK (every other id to one letter, as CharTokenizer's)
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
class ToolTokenizer(CharTokenizer):
    """CharTokenizer with Qwen2.5's chat template, rendered as transformers renders it."""

    chat_template = QWEN25

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt)
        return rendered[0]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(BLOCK if i == CALL else chr(97 + (i % 26)) for i in ids if i > 2)


class _AfterSteps:
    """Let the engine make ``steps`` steps, then ``stall`` (each step sleeps 50 ms and returns nothing) or raise."""

    def __init__(self, steps: int, stall: bool):
        self.steps, self.stall = steps, stall

    def __call__(self, engine) -> None:
        step, calls = engine.step, [0]

        def changed():
            calls[0] += 1
            if calls[0] <= self.steps:
                return step()
            if not self.stall:
                raise RuntimeError("planted step failure")
            time.sleep(0.05)
            return []
        engine.step = changed


def stall_after(steps: int):
    """A hook: ``steps`` steps, then no progress, so a request can only end by a cancellation."""
    return _AfterSteps(steps, stall=True)


def fail_after(steps: int):
    """A hook: the engine's step raises after ``steps`` steps."""
    return _AfterSteps(steps, stall=False)


class _RecordLogprobs:
    """Append every event that carries logprobs to ``path`` as a JSON line ``[rid, tokens, logprobs]``, written
    before the step's tokens leave the engine process (so a client holding a response finds its events there)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, engine) -> None:
        import json
        step = engine.step

        def recorded():
            events = step()
            with open(self.path, "a") as f:
                for e in events:
                    if e.logprobs:
                        f.write(json.dumps([e.rid, e.tokens, e.logprobs]) + "\n")
            return events
        engine.step = recorded


def record_logprobs(path: str):
    """A hook: the engine's BatchEvent logprobs, as they left the engine, in ``path`` (JSON lines)."""
    return _RecordLogprobs(str(path))


class RecordingPush:
    """A zmq PUSH socket stand-in that keeps every message the engine loop sends, decoded."""

    def __init__(self):
        self.sent = []

    def send(self, data, copy=True):
        from tilespec.serve.messages import decode_to_api
        self.sent.append(decode_to_api(data))


def recording_loop(api_processes: int = 2):
    """An EngineLoop with no engine whose sends to ``api_processes`` API processes are recorded -> (loop, pushes)."""
    from tilespec.serve.core import EngineLoop
    pushes = [RecordingPush() for _ in range(api_processes)]
    loop = EngineLoop.__new__(EngineLoop)
    loop.pushes, loop.dirty = pushes, False
    return loop, pushes


class _Sleep:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, engine) -> None:
        time.sleep(self.seconds)


def slow_start(seconds: float):
    """A hook: the engine's start takes ``seconds`` longer (it runs after the warm-up, before Ready)."""
    return _Sleep(seconds)
