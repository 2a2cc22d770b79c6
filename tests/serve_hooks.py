"""Engine hooks for the server tests: picklable functions that ``build_server(engine_hook=...)`` runs on the engine
inside the engine process, to stall or break its steps there."""
from __future__ import annotations

import time


def stall_after(steps: int):
    """A hook: the engine makes ``steps`` steps, then makes no progress (each step sleeps 50 ms and returns
    nothing), so a request can only end by a cancellation."""
    return _Stall(steps)


class _Stall:
    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, engine) -> None:
        step, calls = engine.step, [0]

        def stalled():
            calls[0] += 1
            if calls[0] <= self.steps:
                return step()
            time.sleep(0.05)
            return []
        engine.step = stalled


class _Fail:
    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, engine) -> None:
        step, calls = engine.step, [0]

        def failing():
            calls[0] += 1
            if calls[0] > self.steps:
                raise RuntimeError("planted step failure")
            return step()
        engine.step = failing


def fail_after(steps: int):
    """A hook: the engine's step raises after ``steps`` steps."""
    return _Fail(steps)
