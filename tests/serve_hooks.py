"""Engine hooks for the server tests: picklable functions that ``build_server(engine_hook=...)`` runs on the engine
inside the engine process, to stall or break its steps there."""
from __future__ import annotations

import time


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
