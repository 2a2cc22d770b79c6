"""Engine hooks for the server tests: picklable functions that ``build_server(engine_hook=...)`` runs on the engine
inside the engine process, to stall or break its steps there; and the servers' tokenizer, ``CharTokenizer``.

Everything here is pickled into the engine process, which imports this module to unpickle it: it imports nothing
heavy (no pytest, openai, uvicorn or test module), so an engine process starts in the time its model needs."""
from __future__ import annotations

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
