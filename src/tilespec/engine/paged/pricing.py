"""Which drafts a step of the paged engine verifies: each step's drafts priced by a measured cost model.

A decode step of R rows (a rows bucket) that feeds T tokens (R pending tokens + the verified drafts, ragged: request
i brings k_i drafts, 0 allowed) takes t(R, T) seconds; T is rounded up to a *token bucket* of R (few shapes: one
CUDA graph each). Request i's j-th draft adds one emitted token exactly when its first j drafts are all accepted,
with probability c_ij, so the step's expected output is n + sum_i sum_{j <= k_i} c_ij tokens. The planner picks
every k_i of the step together to maximise that over t(R, T):

  * c_ij does not grow with j, so for a fixed T the best drafts are the T - n largest c_ij (each request's first
    ones): sort once, prefix sums give every T's best value;
  * then the token bucket with the most expected tokens per second wins (T = R, no drafts, when nothing pays).

One mechanism serves one client (drafting is nearly free: the step reads the weights whatever T is) and 256 (only
likely drafts pay, and only as many as fit where the step is still cheap).

The costs (:class:`StepCosts`) are measured on the running engine: seeded by the warm-up's timed graph replays, then
every decode step's wall time (schedule to accepted tokens on the host) updates its (R, T) entry; steps that compiled
or captured a graph are never samples. Acceptance (:class:`Acceptance`) is counted per request and draft depth,
decayed, and shrunk toward the engine-wide rate of the same depth while a request has few samples of its own.
Per-draft pricing sees drafts already proposed, so it cannot see the host work of drafting itself (proposals, the
drafter's index upkeep, the pricing): at 256 rows on an H200 that made a step that verified no draft cost 13 ms in
the ngram engine against 8 ms in the target-only one. :class:`DraftGate` closes that gap: per rows bucket it keeps
the measured tokens per second of decode steps that ran the drafter and of steps that did not, runs the better
one, and now and then the other (less often the longer it keeps losing), so drafting stops where it loses whole and
comes back when it pays again.
Pricing changes which drafts are verified, never the law of the tokens: with ``coupled`` verification and context
drafts not even the tokens (tests/test_paged_engine.py).
"""
from __future__ import annotations

import math
from typing import Optional

from .shapes import bucket

TOKEN_STEPS = (0.5, 1.0, 2.0)   # token buckets of R rows: R, R * (1 + s) for these s, and R * (1 + gamma)
PRICED_AFTER = 3    # explorations of one winner's reign before their cost bounds the interval (DraftGate)


def token_buckets(rows: int, gamma: int) -> tuple:
    """The token totals a decode step of ``rows`` rows may take (sorted; ``rows`` alone when gamma is 0)."""
    if gamma <= 0:
        return (rows,)
    top = rows * (1 + gamma)
    return tuple(sorted({rows, top, *(min(top, rows + max(1, round(s * rows))) for s in TOKEN_STEPS)}))


def token_bucket(rows: int, tokens: int, gamma: int) -> int:
    """The smallest token bucket of ``rows`` rows that holds ``tokens`` (``tokens`` itself above them all)."""
    return next((b for b in token_buckets(rows, gamma) if b >= tokens), tokens)


class StepCosts:
    """Seconds of a decode step by shape (R rows bucket, T token bucket, wide): ``wide`` steps verify 1 + gamma
    logit rows per request (some request drafts), narrow ones one (T = R, nobody drafts).

    ``seed(shape, s)``: a graph replay's time from the warm-up (device time only). ``observe(shape, s)``: a served
    step's wall time, kept as an exponential moving average of its excess over the seed (``decay`` per sample),
    samples clipped to [1/2, 2] x the current estimate so that one stalled step cannot price a shape out for good.
    A shape with no sample of its own borrows the mean excess of R's sampled shapes; with neither a seed nor a
    sample, the dearest sampled shape of R with no more tokens (costs grow with tokens), else None: unknown, which
    the planner treats as free (so it is tried, and then measured)."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.seeds: dict = {}          # (R, T, wide) -> s
        self.excess: dict = {}         # (R, T, wide) -> EMA of wall - seed (of wall where there is no seed)
        self.samples: dict = {}        # (R, T, wide) -> how many observed

    def seed(self, shape: tuple, seconds: float) -> None:
        self.seeds[shape] = float(seconds)

    def _mean_excess(self, rows: int) -> float:
        seen = [v for k, v in self.excess.items() if k[0] == rows and k in self.seeds]
        return sum(seen) / len(seen) if seen else 0.0

    def estimate(self, shape: tuple) -> Optional[float]:
        if shape in self.seeds:
            return self.seeds[shape] + (self.excess[shape] if shape in self.excess else self._mean_excess(shape[0]))
        if shape in self.excess:
            return self.excess[shape]
        below = [v for k, v in self.excess.items() if k[0] == shape[0] and k[1] <= shape[1] and k not in self.seeds]
        return max(below) if below else None

    def observe(self, shape: tuple, seconds: float) -> None:
        now = self.estimate(shape)
        if now is not None and now > 0:
            seconds = min(max(seconds, 0.5 * now), 2.0 * now)
        sample = seconds - self.seeds.get(shape, 0.0)
        old = self.excess.get(shape)
        self.excess[shape] = sample if old is None else self.decay * old + (1 - self.decay) * sample
        self.samples[shape] = self.samples.get(shape, 0) + 1


class Acceptance:
    """c_j = P(a request's first j drafts are all accepted), j = 1..gamma: its own decayed counts shrunk toward the
    engine-wide ones (``prior`` pseudo-samples), made non-increasing in j.

    Engine-wide counts start at ``start`` ** j (one pseudo-sample: an optimistic prior, so a new drafter is tried)
    and decay by ``global_decay`` per observation. A request's decay by ``decay`` per observation (its recent drafts
    matter most: an ngram match holds for a stretch, then stops) and by ``idle_decay`` per engine step since its
    last one, so a request priced out of drafting drifts back to the engine's rate and is tried again."""

    def __init__(self, gamma: int, start: float = 0.6, prior: float = 2.0, decay: float = 0.8,
                 idle_decay: float = 0.97, global_decay: float = 0.995):
        self.gamma, self.prior, self.decay = gamma, prior, decay
        self.idle_decay, self.global_decay = idle_decay, global_decay
        self.tried = [1.0] * gamma
        self.hits = [start ** (j + 1) for j in range(gamma)]

    def new_request(self) -> list:
        """A request's own counts: [tried per depth, hits per depth, the step of its last observation]."""
        return [[0.0] * self.gamma, [0.0] * self.gamma, 0]

    def chain(self, own: list, k: int, step: int = 0) -> list:
        """[c_1 .. c_k] for a request with counts ``own`` and ``k`` <= gamma drafts on offer at engine ``step``."""
        tried, hits, last = own
        age = self.idle_decay ** max(0, step - last)
        out, low = [], 1.0
        for j in range(min(k, self.gamma)):
            engine = self.hits[j] / self.tried[j]
            low = min(low, (age * hits[j] + self.prior * engine) / (age * tried[j] + self.prior))
            out.append(low)
        return out

    def observe(self, own: list, drafted: int, accepted: int, step: int = 0) -> None:
        """A request verified ``drafted`` drafts at engine ``step`` and ``accepted`` of them (a prefix)."""
        tried, hits, last = own
        keep = self.decay * self.idle_decay ** max(0, step - last)
        for j in range(self.gamma):
            tried[j] *= keep
            hits[j] *= keep
        for j in range(min(drafted, self.gamma)):
            hit = 1.0 if j < accepted else 0.0
            tried[j] += 1.0
            hits[j] += hit
            self.tried[j] = self.global_decay * self.tried[j] + 1.0
            self.hits[j] = self.global_decay * self.hits[j] + hit
        own[2] = step


def plan(rows: int, chains: list, costs: StepCosts, gamma: int) -> tuple:
    """The drafts of one decode step: ``chains[i]`` = [c_i1, ...] (request i's offered drafts, c non-increasing) for
    the step's n = len(chains) requests in a bucket of ``rows`` rows -> (k per request, its shape (rows, T, wide)).

    Maximises (n + expected accepted drafts) / t(shape) over the shapes: (rows, rows, narrow) with no drafts, and
    every token bucket T with the T - n likeliest drafts (T = rows too when absent rows leave room). A shape of
    unknown cost counts as the cheapest known shape of ``rows`` (tried, then measured); ties go to fewer tokens."""
    n = len(chains)
    gains = sorted(((c, j, i) for i, chain in enumerate(chains) for j, c in enumerate(chain) if c > 0),
                   key=lambda g: (-g[0], g[1], g[2]))
    prefix = [0.0]
    for c, _, _ in gains:
        prefix.append(prefix[-1] + c)
    known = [c for c in (costs.estimate((rows, t, w)) for t in token_buckets(rows, gamma) for w in (False, True))
             if c is not None]
    free = min(known) if known else 1.0
    best, held = None, n
    for t in token_buckets(rows, gamma):
        for wide in ((False, True) if t == rows else (True,)):
            m = min(max(0, t - n), len(gains)) if wide else 0
            if wide and n + m <= held:
                continue                  # no draft, or a smaller bucket holds the same drafts
            cost = costs.estimate((rows, t, wide))
            value = (n + prefix[m]) / (free if cost is None else max(cost, 1e-9))
            if best is None or value > best[0] * (1 + 1e-9):
                best = (value, (rows, t, wide), m)
            held = max(held, n + m)
    _, shape, m = best
    ks = [0] * n
    for _, _, i in gains[:m]:
        ks[i] += 1
    return ks, shape


def price_drafts(decoding: list, acceptance: Optional[Acceptance], costs: StepCosts, gamma: int, step: int) -> tuple:
    """Cut the decoding items' drafts (scheduler.Item) to those the step's :func:`plan` verifies -> the decode step's
    shape (rows bucket, token bucket, wide). ``acceptance`` None: every offered draft is kept (unpriced)."""
    rows = bucket(max(1, len(decoding)))
    offered = [len(it.seq.drafts) for it in decoding]
    if acceptance is not None and any(offered):
        chains = [acceptance.chain(it.seq.acceptance, k, step) for it, k in zip(decoding, offered)]
        ks, shape = plan(rows, chains, costs, gamma)
        for it, k in zip(decoding, ks):
            del it.seq.drafts[k:]
        return shape
    tokens = len(decoding) + sum(offered)
    return rows, token_bucket(rows, tokens, gamma), tokens > len(decoding)


def observe(sample, wall: float, admission, costs: StepCosts, gate) -> None:
    """A step's wall time (overlap.Sample; None: no sample) into admission's averages, the decode step costs and the
    draft gate. A step left in flight is timed by the call that lands it: overlapped, that call's wall (the device
    ran it meanwhile); drained, from the landing of the step before it."""
    if sample is None:
        return
    admission.observe(sample.mixed, wall)
    if not sample.mixed:
        costs.observe(sample.shape, wall)
        if gate is not None and sample.gated is not None and sample.gated[0] == sample.shape[0]:
            gate.observe(sample.gated[0], sample.gated[1], sample.made, wall)


class DraftGate:
    """Whether a decode step of R rows runs the drafter at all (see the module docstring): per rows bucket the
    measured tokens per second of decode steps with the drafter on and off, each the ratio of decayed sums (tokens
    and seconds, ``decay`` per sample), so that a step that found nothing to draft weighs by its time, not as a rate
    of its own. Each branch is sampled in *stretches* of ``stretch`` consecutive steps: a new bucket drafts for a
    stretch, then runs one without, then the faster branch runs, and the other for a stretch every ``explore``-th
    step, an interval that doubles (up to ``max_explore``) while the explorations leave the winner unchanged. A
    stretch, not a single step: whether a step has drafts at all is a coin flip per step at one client (code edit on
    an H200: four single drafting steps all found no n-gram match, and the gate kept ngram off at one client where
    drafting makes it 1.5x); the losing branch's steps cost (a drafting step also forgoes the overlap of decode
    steps), so it is sampled less the longer it keeps losing, and as often as at first once the winner changes.
    After PRICED_AFTER explorations that left the winner unchanged, the interval is also never shorter than what
    keeps the explorations' cost within ``share`` of the tokens per second (a loser at half the winner's rate: a
    stretch every 200 steps). Buckets stay independent: starting a bucket from a smaller one's rates, where drafting
    lost during a load's ramp, kept the drafter off where it won (CPU, forward stubbed:
    bench/scripts/host_loop_cost.py --forward-ms 1.5)."""

    def __init__(self, explore: int = 16, decay: float = 0.9, max_explore: int = 256, stretch: int = 8,
                 share: float = 0.02):
        if not (isinstance(explore, int) and explore >= 2 and max_explore >= explore):
            raise ValueError(f"explore must be an integer >= 2 and <= max_explore, got {explore!r}")
        if not (isinstance(stretch, int) and 1 <= stretch < explore):
            raise ValueError(f"stretch must be an integer in [1, explore), got {stretch!r}")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.explore, self.max_explore, self.decay, self.stretch = explore, max_explore, decay, stretch
        self.share = share
        self.rate: dict = {}           # (R, drafting) -> decayed tokens / decayed seconds
        self._sums: dict = {}          # (R, drafting) -> [decayed tokens, decayed seconds]
        self.steps: dict = {}          # R -> decode steps decided
        self.every: dict = {}          # R -> steps between explorations now
        self.wait: dict = {}           # R -> steps until the next exploration
        self.best: dict = {}           # R -> the winner at the last decision (True: drafting)
        self.left: dict = {}           # R -> (steps left in the stretch running now, its branch)
        self.explored: dict = {}       # R -> explorations since the winner last changed

    def drafting(self, rows: int, explore: bool = True) -> bool:
        """Whether a step of ``rows`` drafts. ``explore`` False (a mixed step: its wall time is no sample of the gate,
        admission.py takes it) -> the measured winner, without exploring: the nearest measured bucket's where this one
        has no rates (True where none has), since a bucket met only in prefilling steps (a load's ramp) otherwise
        drafted in every one, each a synchronous step."""
        on, off = self.rate.get((rows, True)), self.rate.get((rows, False))
        if not explore:
            known = [r for r, drafting in self.rate if not drafting and (r, True) in self.rate]
            if not known:
                return True
            near = min(known, key=lambda r: (abs(r - rows), -r))
            return self.rate[near, True] >= self.rate[near, False]
        self.steps[rows] = self.steps.get(rows, 0) + 1
        left, branch = self.left.get(rows, (0, False))
        if left > 0:                                       # inside a stretch
            self.left[rows] = (left - 1, branch)
            return branch
        if on is None or off is None:                      # a new bucket: a stretch drafting, then one without
            return self._stretch(rows, on is None)
        best = on >= off
        if self.best.setdefault(rows, best) != best:       # the winner changed: explore as often as at first
            self.best[rows], self.every[rows], self.wait[rows] = best, self.explore, self.explore
            self.explored[rows] = 0
        every = self.every.setdefault(rows, self.explore)
        wait = self.wait.get(rows, every) - 1
        if wait > 0:
            self.wait[rows] = wait
            return best
        self.explored[rows] = self.explored.get(rows, 0) + 1      # priced once the loser has lost a few times:
        costly = self._costly(on, off) if self.explored[rows] > PRICED_AFTER else 0     # one stretch's rate is noisy
        self.every[rows] = self.wait[rows] = max(min(2 * every, self.max_explore), costly)
        return self._stretch(rows, not best)

    def _costly(self, on: float, off: float) -> int:
        """Steps between explorations so that they cost at most ``share`` of the tokens per second: a stretch of
        the loser gives up (1 - its rate / the winner's) of a step's tokens per step (at 256 rows an H200 running
        ngram lost 13 % to its drafting stretches while the gate kept the drafter off on 979 of 1,059 steps)."""
        lo, hi = min(on, off), max(on, off)
        return 0 if hi <= 0 else math.ceil(self.stretch * (1 - lo / hi) / self.share)

    def _stretch(self, rows: int, branch: bool) -> bool:
        self.left[rows] = (self.stretch - 1, branch)
        return branch

    def observe(self, rows: int, drafting: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (rows, drafting)
        sums = self._sums.get(key)
        if sums is None:
            sums = self._sums[key] = [0.0, 0.0]
        sums[0] = self.decay * sums[0] + tokens
        sums[1] = self.decay * sums[1] + seconds
        self.rate[key] = sums[0] / sums[1]
