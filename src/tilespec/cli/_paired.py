"""What ``tilespec demo`` needs to time two systems honestly on a shared machine.

* :func:`free_cpus`: how many CPUs this process can use right now -- its affinity mask and cgroup quota, the load
  average, and a short probe of how much CPU time busy threads of this process actually get (other processes' work
  shows up as a share below 1). The demo runs torch on that many threads: on a CPU whose cores are taken, threads
  of one forward wait for each other and the wide verify forwards stall most (a 2-thread run measured 0.43-1.51x
  on a busy 2-core machine where one thread measures ~2x).
* :func:`summarize`: paired runs (target-only then speculative, back to back, so both see the same load) give one
  ratio each; the speedup is their geometric mean with a Student-t 95 % interval over the log ratios.
* :class:`Watchdog`: between decode steps, drops to fewer threads as soon as the runs stop getting the CPUs they
  asked for (other work arrived after the probe).
* :func:`measure`: alternates the two until that interval is narrow enough or the pair count or the time budget
  runs out; the pairs measured before a thread drop do not count.
"""
from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

# two-sided 95 % Student-t quantiles by degrees of freedom (pairs - 1)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 30: 2.042}
STARVED = 0.6   # a run whose CPU time per thread is below this share of its wall time did not get its CPUs


def t95(df: int) -> float:
    if df in T95:
        return T95[df]
    return T95[max(k for k in T95 if k <= df)] if df < 30 else 1.96 + 2.4 / df


def _cgroup_cpus() -> Optional[float]:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), else None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def probe_cpu(threads: int, seconds: float = 0.25) -> float:
    """CPUs this process got: ``threads`` threads hash a buffer (hashlib releases the GIL) for ``seconds`` of wall
    time; returns the sum over threads of CPU time / wall time (``threads`` on an idle machine, less when other
    processes share the cores)."""
    buf = bytes(1 << 20)
    shares = [0.0] * threads
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        start.wait()
        w0, c0 = time.perf_counter(), time.thread_time()
        w = w0
        while w - w0 < seconds:
            hashlib.sha256(buf).digest()
            w = time.perf_counter()
        shares[i] = (time.thread_time() - c0) / (w - w0)

    workers = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(shares)


@dataclass
class CpuReport:
    cpus: int                       # CPUs this process may run on (affinity, cgroup quota)
    got: Optional[float]            # CPUs the probe got (None: not probed)
    load_average: Optional[list]    # 1, 5, 15 minutes
    threads: int                    # the thread count chosen from them
    limit: Optional[int] = None     # at most this many (torch's default)

    def describe(self) -> str:
        parts = [f"{self.cpus} CPU{'s' if self.cpus != 1 else ''} usable"]
        if self.limit and self.limit < self.cpus:
            parts[0] += f" (torch's default: {self.limit} thread{'s' if self.limit != 1 else ''})"
        if self.got is not None:
            parts.append(f"a {self.cpus}-thread probe got {self.got:.2f}")
        if self.load_average:
            parts.append(f"load average {self.load_average[0]:.2f}")
        return ", ".join(parts)


def usable_cpus() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(cpus, math.floor(quota + 0.5))) if quota else max(1, cpus)


def free_cpus(probe: Callable[[int], float] = probe_cpu, limit: Optional[int] = None) -> CpuReport:
    """The thread count for this machine now: the CPUs usable, less what other processes take (a probe of
    ``cpus`` threads that gets 1.3 CPUs of 2 -- one other busy process -- gives 1 thread), at most ``limit``
    (torch's default: one per physical core, or OMP_NUM_THREADS)."""
    cpus = usable_cpus()
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    got = probe(cpus)
    return CpuReport(cpus, got, load, max(1, min(cpus, limit or cpus, math.floor(got + 0.25))), limit)


@dataclass
class Pair:
    """One target-only run and one speculative run, back to back, at ``threads`` threads."""
    target_only_s: float
    speculative_s: float
    threads: int
    cpu_share: list = field(default_factory=list)   # CPU time / (wall time x threads) of the two runs
    counted: bool = True                            # False: measured before a thread change, not in the speedup

    @property
    def ratio(self) -> float:
        return self.target_only_s / self.speculative_s

    def to_dict(self) -> dict:
        return dict(asdict(self), ratio=self.ratio)


@dataclass
class Summary:
    pairs: int
    speedup: float                 # geometric mean of the paired ratios
    low: float                     # its 95 % interval (NaN with one pair)
    high: float
    spread: float                  # the paired ratios' standard deviation, relative (log scale)

    @property
    def half_width(self) -> float:
        """The interval's half width relative to the speedup (0.1: within ±10 %)."""
        return math.sqrt(self.high / self.low) - 1 if self.pairs > 1 else math.inf


def summarize(ratios: list) -> Summary:
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return Summary(n, math.exp(mean), math.nan, math.nan, math.nan)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    h = t95(n - 1) * sd / math.sqrt(n)
    return Summary(n, math.exp(mean), math.exp(mean - h), math.exp(mean + h), math.exp(sd) - 1)


@dataclass
class Measurement:
    pairs: list                      # every Pair, the counted ones last
    summary: Optional[Summary]       # over the counted pairs
    stable: bool                     # the interval is within ±precision
    stopped: str                     # why measuring stopped: "stable", "pairs", "budget"
    seconds: float                   # wall time spent measuring
    thread_changes: list = field(default_factory=list)   # [from, to] per drop

    @property
    def counted(self) -> list:
        return [p for p in self.pairs if p.counted]


class Watchdog:
    """Called between decode steps (:meth:`check`): when, over the last ``window`` seconds of wall time, this process
    got less than ``STARVED`` of the CPU time its ``threads`` threads could use, other processes took cores, and
    threads of one forward now wait for each other (a 2-thread target-only run went from 4 s to 116 s that way):
    it drops the thread count at once, to what the process got, through ``set_threads`` (``enabled``: the automatic
    thread count only; ``--threads N`` is kept). Never raises it again, so it cannot oscillate."""

    def __init__(self, threads: int, set_threads: Callable[[int], None], *, enabled: bool = True,
                 window: float = 0.5, on_drop: Optional[Callable] = None,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] = time.process_time):
        self.threads, self.set_threads, self.enabled, self.window = threads, set_threads, enabled, window
        self.on_drop, self.clock, self.cpu_clock = on_drop, clock, cpu_clock
        self.drops: list = []       # [from, to, share]
        self.start()

    def start(self) -> None:
        self.w0, self.c0 = self.clock(), self.cpu_clock()

    def check(self) -> None:
        w, c = self.clock(), self.cpu_clock()
        if w - self.w0 < self.window:
            return
        share = (c - self.c0) / ((w - self.w0) * self.threads)
        self.w0, self.c0 = w, c
        if self.enabled and self.threads > 1 and share < STARVED:
            new = max(1, min(self.threads - 1, math.floor(share * self.threads + 0.25)))
            self.drops.append([self.threads, new, share])
            self.set_threads(new)
            old, self.threads = self.threads, new
            if self.on_drop:
                self.on_drop(old, new, share)


def measure(run_one: Callable[[str], tuple], threads_now: Callable[[], int], *, max_pairs: int, min_pairs: int,
            budget_s: float, precision: float, on_pair: Optional[Callable] = None,
            clock: Callable[[], float] = time.monotonic) -> Measurement:
    """Alternate ``run_one("target-only")`` and ``run_one("speculative")`` (each returns ``(wall_s, cpu_s)``) in
    pairs until at least ``min_pairs`` counted pairs give a 95 % interval within ±``precision`` of the speedup, or
    ``max_pairs`` counted pairs, or ``budget_s`` of wall time (no pair is started that would end past it, by the
    mean pair time so far) -- whichever comes first.

    ``threads_now()`` is the thread count (a :class:`Watchdog` may lower it during a run): a pair that ends at
    another count than it started with drops the pairs measured so far from the speedup (they stay in ``pairs``,
    ``counted=False``) and measuring starts again at the new count, with the whole budget (the watchdog acts
    within a second of the starvation, so the pair it spoils costs about one idle pair's time)."""
    start = since = clock()
    pairs, changes, pair_s = [], [], []
    while True:
        counted = [p for p in pairs if p.counted]
        if counted:
            s = summarize([p.ratio for p in counted])
            if len(counted) >= min_pairs and s.half_width <= precision:
                return Measurement(pairs, s, True, "stable", clock() - start, changes)
            if len(counted) >= max_pairs:
                return Measurement(pairs, s, False, "pairs", clock() - start, changes)
        if pair_s and clock() - since + sum(pair_s) / len(pair_s) > budget_s:
            s = summarize([p.ratio for p in counted]) if counted else None
            return Measurement(pairs, s, False, "budget", clock() - start, changes)
        threads, t0 = threads_now(), clock()
        (base_s, base_cpu), (spec_s, spec_cpu) = run_one("target-only"), run_one("speculative")
        pair_s.append(clock() - t0)
        pair = Pair(base_s, spec_s, threads, [base_cpu / (base_s * threads), spec_cpu / (spec_s * threads)])
        pairs.append(pair)
        if threads_now() != threads:
            for p in pairs:
                p.counted = False
            changes.append([threads, threads_now()])
            since, pair_s = clock(), []
        if on_pair:
            on_pair(pair, len([p for p in pairs if p.counted]))
