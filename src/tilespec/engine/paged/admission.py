"""When waiting requests join the running batch of the paged engine: prefills coalesced by a measured trade.

A step that prefills (a mixed step) costs more than a decode step: it runs outside the decode graphs and carries the
prompt tokens, so every running request waits O = t(mixed) - t(decode) longer for its next token, however many
prompts the step admits. Admitting each arrival at once pays O once per arrival; under steady load that is most
steps (64 clients of 128-token answers bring a request every other step). Waiting instead costs each waiting
request a step of time to first token per step.

The rule is the ski-rental one: admit once the waiting requests' accumulated waiting time reaches what admitting
now costs the running ones, sum(now - submitted) >= O x running. Then no arrival pattern costs more than twice the
best schedule in request-seconds, and the rule adapts by itself: with nothing running, or O near zero (cheap
mixed steps), it admits at once; at 64 busy clients it gathers a few arrivals per prefill. ``max_wait_s`` bounds
any request's extra wait (0: admit at once). O is measured on the running engine (moving averages of both kinds of step's wall time).
Admission timing changes no request's tokens (they are keyed by seed and position).
"""
from __future__ import annotations

from typing import Optional


class Admission:
    def __init__(self, max_wait_s: float = 0.1, decay: float = 0.8):
        self.max_wait_s, self.decay = max_wait_s, decay
        self.mixed: Optional[float] = None       # EMA seconds of a step that prefilled
        self.decode: Optional[float] = None      # EMA seconds of a decode step

    def observe(self, prefilled: bool, seconds: float) -> None:
        """One served step's wall time (clipped at 2x the kind's average: a stall moves it little)."""
        old = self.mixed if prefilled else self.decode
        seconds = seconds if old is None else min(seconds, 2.0 * old)
        new = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        if prefilled:
            self.mixed = new
        else:
            self.decode = new

    @property
    def overhead(self) -> float:
        """O: seconds a prefilling step adds for every running request (0 until both kinds are measured)."""
        if self.mixed is None or self.decode is None:
            return 0.0
        return max(0.0, self.mixed - self.decode)

    def admit(self, now: float, waiting_since, running: int) -> bool:
        """Whether this step admits: ``waiting_since`` the submit times of the waiting requests (oldest first),
        ``running`` the requests in the batch."""
        if running == 0 or self.max_wait_s <= 0:
            return True
        cost, waited = self.overhead * running, 0.0
        for i, t in enumerate(waiting_since):
            if i == 0 and now - t >= self.max_wait_s:
                return True
            waited += now - t
            if waited >= cost:
                return True
        return False
