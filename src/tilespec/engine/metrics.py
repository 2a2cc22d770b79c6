"""Run metrics of the engine: acceptance, block efficiency, throughput and where the time goes.

Definitions (see docs/engine.md):
  * alpha (acceptance rate) = accepted draft tokens / drafted tokens (vLLM V1's "draft acceptance rate"; it is
    below Leviathan's α because tokens after a rejection count as drafted but never tested);
  * alpha_tested = accepted / tested positions (Leviathan's α under the i.i.d. model, what the γ schedule uses);
  * block_efficiency (τ) = tokens emitted per request per target call, bonus included (target-only steps count 1);
  * gammas: γ of every step (0 for a target-only step); mean_gamma averages all steps, mean_spec_gamma only the
    speculative ones (γ >= 1);
  * fallback_steps: steps decoded target-only because the ``optimal`` schedule fell back (predicted or measured
    speedup < 1), the first at step ``fallback_at_step`` (None: no fallback); with a draft model all steps from there
    on, with a context drafter until it resumes drafting (gamma.py); they draft nothing, so alpha / alpha_tested /
    draft_calls describe the speculative steps only;
  * drafter: the drafter's name ("ngram", "suffix", a model, "MODEL+ngram"; "" for target-only);
    context_steps: steps drafted from the context; match_share = request-steps whose context had a match /
    request-steps (the share of a request's steps that drafted anything from its context);
  * time_{draft,target,verify}: seconds inside the draft forwards, the target forward and ``verify()``; on CUDA they
    come from CUDA events read once at the end of the run (no extra host syncs inside a step; the γ schedule gets
    each step's own times by waiting for that step's events only, :meth:`PhaseTimer.between`). For a step launched
    ahead of the previous read the GPU reaches its events straight after the previous step, so its phases measure
    GPU time without launch gaps; ``bookkeeping`` on CUDA is the GPU time elapsed during the host's commit, ~0 when
    a step launched ahead hides it;
  * ahead_steps: steps launched before the previous step's host read (``SpeculativeDecoder(run_ahead=...)``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

PHASES = ("prefill", "draft", "target", "verify", "bookkeeping")


class PhaseTimer:
    """Accumulates time per phase: perf_counter on CPU, CUDA events (resolved lazily) on GPU.

    Every closed phase is logged in order; :meth:`mark` names a position in that log and :meth:`between` sums the
    phases closed between two marks (one step's draft / target time) without waiting for work queued later.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals = {p: 0.0 for p in PHASES}
        self._log: list = []           # closed phases: (phase, seconds) on CPU, (phase, begin, end) events on CUDA
        self._resolved = 0             # CUDA: entries of _log already added to totals
        self._open: dict[str, object] = {}

    def start(self, phase: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[phase] = ev
        else:
            self._open[phase] = time.perf_counter()

    def stop(self, phase: str) -> float:
        """Close the phase; returns the elapsed seconds on CPU (0.0 on CUDA, where it is resolved later)."""
        begin = self._open.pop(phase)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._log.append((phase, begin, end))
            return 0.0
        dt = time.perf_counter() - begin
        self.totals[phase] += dt
        self._log.append((phase, dt))
        return dt

    def mark(self) -> int:
        """The number of phases closed so far: a position for :meth:`between`."""
        return len(self._log)

    def between(self, start: int, stop: int) -> dict[str, float]:
        """Seconds per phase of the phases closed between marks ``start`` and ``stop``. On CUDA this waits for the
        last of them only (an event, not the device), so a step launched after them keeps running."""
        spent = {p: 0.0 for p in PHASES}
        entries = self._log[start:stop]
        if self.cuda and entries:
            entries[-1][2].synchronize()
        for entry in entries:
            spent[entry[0]] += entry[1] if not self.cuda else entry[1].elapsed_time(entry[2]) / 1000.0
        return spent

    def resolve(self) -> dict[str, float]:
        """The totals of every closed phase (on CUDA: waits for the device)."""
        if self.cuda and self._resolved < len(self._log):
            torch.cuda.synchronize()
            for phase, begin, end in self._log[self._resolved:]:
                self.totals[phase] += begin.elapsed_time(end) / 1000.0
            self._resolved = len(self._log)
        return dict(self.totals)


@dataclass
class RunStats:
    """Counters of one ``generate`` call (all requests together)."""

    requests: int = 0
    new_tokens: int = 0
    steps: int = 0
    target_calls: int = 0          # target forwards after prefill (one per step)
    draft_calls: int = 0           # single draft forwards
    request_steps: int = 0         # sum over steps of active requests
    drafted: int = 0
    accepted: int = 0
    tested: int = 0
    emitted: int = 0               # tokens emitted by verify (before EOS / length truncation)
    wall_time: float = 0.0
    times: dict = field(default_factory=dict)
    peak_memory_bytes: int = 0
    kv_cache_bytes: int = 0
    gammas: list = field(default_factory=list)
    defrags: int = 0
    method: str = ""
    fallback_steps: int = 0        # target-only steps after the optimal schedule's fallback
    fallback_at_step: Optional[int] = None   # index of the first such step
    runtime: str = ""              # how the target's forwards ran: eager / graphs / native / native-graphs ...
    draft_runtime: str = ""        # the same for the draft model ("" without one)
    compile_seconds: float = 0.0   # compile + capture time of new shapes inside this call (0 once warm)
    drafter: str = ""
    context_steps: int = 0         # steps drafted by a context drafter (ngram / suffix)
    match_request_steps: int = 0   # request-steps whose context matched (drafted >= 1 token)
    ahead_steps: int = 0           # steps launched before the previous step's host read (run-ahead; incl. a last
                                   # one computed after every request had ended, which counts only its forwards)
    graphed_steps: int = 0         # steps run as whole-step graphs (step_graph.py; replayed captures on CUDA)
    accepted_histogram: list = field(default_factory=list)   # [n_0, n_1, ...]: request-steps that accepted 0, 1,
                                   # ... draft tokens (a tree's depth profile)

    def count_step(self, gamma: int, draft_forwards: int, ks: list, emitted: list, context: bool) -> None:
        """Count one step: ``ks`` tokens drafted and ``emitted`` tokens emitted per live request (same order)."""
        self.steps += 1
        self.target_calls += 1
        self.draft_calls += draft_forwards
        if context:
            self.context_steps += 1
            self.match_request_steps += sum(1 for k in ks if k > 0)
        self.request_steps += len(emitted)
        self.drafted += sum(ks)
        self.accepted += sum(e - 1 for e in emitted)
        for e in emitted:
            if e > len(self.accepted_histogram):
                self.accepted_histogram.extend([0] * (e - len(self.accepted_histogram)))
            self.accepted_histogram[e - 1] += 1
        self.tested += sum(min(e, k) for e, k in zip(emitted, ks))
        self.emitted += sum(emitted)
        self.gammas.append(gamma)

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def alpha_tested(self) -> float:
        return self.accepted / self.tested if self.tested else float("nan")

    @property
    def block_efficiency(self) -> float:
        return self.emitted / self.request_steps if self.request_steps else float("nan")

    @property
    def match_share(self) -> float:
        """Share of request-steps with a context match (0 for drafters that do not match the context)."""
        return self.match_request_steps / self.request_steps if self.request_steps else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas) / len(self.gammas) if self.gammas else 0.0

    @property
    def mean_spec_gamma(self) -> float:
        """Mean γ over the speculative steps (γ >= 1); 0.0 when none drafted."""
        spec = [g for g in self.gammas if g > 0]
        return sum(spec) / len(spec) if spec else 0.0

    @property
    def verify_share(self) -> float:
        """Verify time / (draft + target + verify) time: the verification step's share of step time."""
        step = sum(self.times.get(p, 0.0) for p in ("draft", "target", "verify"))
        return self.times.get("verify", 0.0) / step if step > 0 else float("nan")

    @classmethod
    def merge(cls, runs: list) -> "RunStats":
        """The stats of several generations as one: counters, times and γs summed/concatenated, memory maxed, so
        that the aggregates above (alpha, alpha_tested, block_efficiency, ...) are pooled over all of them."""
        first = runs[0] if runs else cls()
        total = cls(method=first.method, runtime=first.runtime, draft_runtime=first.draft_runtime,
                    drafter=first.drafter)
        for r in runs:
            for name in ("requests", "new_tokens", "steps", "target_calls", "draft_calls", "request_steps", "drafted",
                         "accepted", "tested", "emitted", "defrags", "fallback_steps", "context_steps",
                         "match_request_steps", "ahead_steps", "graphed_steps"):
                setattr(total, name, getattr(total, name) + getattr(r, name))
            total.wall_time += r.wall_time
            total.compile_seconds += r.compile_seconds
            for phase, t in r.times.items():
                total.times[phase] = total.times.get(phase, 0.0) + t
            total.gammas += list(r.gammas)
            hist = total.accepted_histogram
            hist.extend([0] * (len(r.accepted_histogram) - len(hist)))
            for a, n in enumerate(r.accepted_histogram):
                hist[a] += n
            total.peak_memory_bytes = max(total.peak_memory_bytes, r.peak_memory_bytes)
            total.kv_cache_bytes = max(total.kv_cache_bytes, r.kv_cache_bytes)
        return total

    @property
    def cost_ratio(self) -> Optional[float]:
        """Measured c = (draft time / draft forward) / (target time / target forward); None when not measured."""
        d, t = self.times.get("draft", 0.0), self.times.get("target", 0.0)
        return (d / self.draft_calls) / (t / self.target_calls) if self.draft_calls and self.target_calls and t \
            else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("gammas")
        d.update(alpha=self.alpha, alpha_tested=self.alpha_tested, block_efficiency=self.block_efficiency,
                 tokens_per_second=self.tokens_per_second, mean_gamma=self.mean_gamma,
                 mean_spec_gamma=self.mean_spec_gamma, match_share=self.match_share,
                 verify_share=self.verify_share)
        return d


def peak_memory(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device since the last reset; on CPU the process' max RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # noqa: BLE001 - platform without resource
        return 0
