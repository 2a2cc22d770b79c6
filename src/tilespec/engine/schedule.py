"""The γ-schedule protocol: what the decoder asks of the object that picks each step's draft length
(engine/gamma.py's GammaSchedule implements all of it; an injected schedule needs only next() and update())."""
from __future__ import annotations

from typing import Optional


class ScheduleHooks:
    """The γ-schedule protocol the decoder drives (engine/decoder.py, engine/generation.py).

    Required: ``next() -> int`` (γ of the next step) and ``update(gamma, num_accepted, draft_time, target_time,
    **extra)``. The hooks below are optional; these defaults describe a schedule that neither prices, measures nor
    cuts drafts: ``wants_step_time`` (update() also takes step_time / requests / drafted, observe_rate() target_time /
    fallback), ``bind(model, context)`` (what drafts), ``cost_state()`` / ``inherit_cost(state)`` (measured costs
    kept across generations of one decoder), ``observe_rate(gamma, wall, tokens_per_request, ...)`` (every step's
    wall time), ``select_drafts(drafts, requests)`` (a context drafter's proposals cut to what pays; None: draft
    nothing), ``fixed_gamma()`` (γ decided before the read, or None), ``falls_back_at_start`` / ``resumes_next``.
    A schedule that is not a ScheduleHooks gets these defaults through :func:`as_schedule`."""

    wants_step_time = False
    falls_back_at_start = False
    resumes_next = False

    def bind(self, model: bool, context: bool) -> None:
        return None

    def cost_state(self) -> Optional[dict]:
        return None

    def inherit_cost(self, state: Optional[dict]) -> None:
        return None

    def observe_rate(self, gamma: int, wall: float, tokens_per_request: float, target_time: Optional[float] = None,
                     fallback: bool = False) -> None:
        return None

    def select_drafts(self, drafts: list, requests: list) -> Optional[list]:
        return drafts

    def fixed_gamma(self) -> Optional[int]:
        return None


HOOKS = ("wants_step_time", "falls_back_at_start", "resumes_next", "bind", "cost_state", "inherit_cost",
         "observe_rate", "select_drafts", "fixed_gamma")


class _Hooked(ScheduleHooks):
    """An injected schedule seen through the protocol: its own hooks where it has them (read live), the defaults
    elsewhere; every other attribute is the schedule's."""

    def __init__(self, inner):
        self.inner = inner

    def next(self) -> int:
        return self.inner.next()

    def update(self, *args, **kwargs) -> None:
        self.inner.update(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _hook(name: str):
    default = getattr(ScheduleHooks, name)

    def read(self):
        if hasattr(self.inner, name):
            return getattr(self.inner, name)
        return default.__get__(self) if callable(default) else default
    return property(read)


for _name in HOOKS:
    setattr(_Hooked, _name, _hook(_name))


def as_schedule(schedule) -> ScheduleHooks:
    """``schedule`` itself when it is a ScheduleHooks, else it wrapped so every hook of the protocol answers."""
    if not (callable(getattr(schedule, "next", None)) and callable(getattr(schedule, "update", None))):
        raise TypeError(f"a γ schedule needs next() and update(...), got {type(schedule).__name__}")
    return schedule if isinstance(schedule, ScheduleHooks) else _Hooked(schedule)
