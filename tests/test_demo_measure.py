"""``tilespec demo``'s timing on a shared machine (tilespec.cli._paired): the thread count from the CPUs free, the
stopping rule over paired runs, the watchdog that drops threads when other work arrives -- with scripted clocks, so
a stable series gives a ratio and a noisy one the "too busy" verdict deterministically."""
from __future__ import annotations

import json
import math
from itertools import cycle

import pytest
import torch

import tilespec.cli._paired as paired
from tilespec.cli import main
from tilespec.cli._paired import CpuReport, Watchdog, free_cpus, measure, probe_cpu, summarize

from test_drafters_cli import registry  # noqa: F401  (fixture: tilespec.models.load serves a tiny model "t")


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def scripted(series: dict, clock: Clock | None = None, cpu: float = 1.0):
    """run_one for measure(): the next wall time of each system's series (advancing ``clock``), CPU = cpu x wall."""
    its = {name: cycle(times) for name, times in series.items()}

    def run_one(name):
        wall = next(its[name])
        if clock is not None:
            clock.t += wall
        return wall, cpu * wall
    return run_one


def test_summarize_is_the_geometric_mean_with_a_t_interval():
    s = summarize([2.0, 2.0, 2.0])
    assert s.speedup == pytest.approx(2.0) and s.low == pytest.approx(2.0) and s.half_width == pytest.approx(0)
    s = summarize([1.8, 2.0, 2.2, 2.0])
    assert s.low < 1.8 < s.speedup < 2.2 < s.high and s.speedup == pytest.approx((1.8 * 2 * 2.2 * 2) ** 0.25)
    logs = [math.log(r) for r in (1.8, 2.0, 2.2, 2.0)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert math.log(s.high) - mean == pytest.approx(3.182 * sd / 2)
    assert summarize([1.5]).half_width == math.inf


def test_a_stable_series_stops_at_the_fewest_pairs_with_a_ratio():
    m = measure(scripted({"target-only": [4.0, 4.1, 3.9], "speculative": [2.0]}), lambda: 2, max_pairs=10,
                min_pairs=3, budget_s=1e9, precision=0.1)
    assert m.stable and m.stopped == "stable" and len(m.pairs) == 3
    assert m.summary.speedup == pytest.approx(2.0, rel=0.03) and m.summary.half_width < 0.1
    assert m.pairs[0].cpu_share == [0.5, 0.5]   # CPU = wall with 2 threads: each got half its threads' time


def test_a_noisy_series_is_too_busy_to_measure():
    m = measure(scripted({"target-only": [4.0, 9.0, 3.0, 12.0], "speculative": [6.0, 2.0, 4.0, 3.0]}), lambda: 1,
                max_pairs=8, min_pairs=3, budget_s=1e9, precision=0.1)
    assert not m.stable and m.stopped == "pairs" and len(m.pairs) == 8 and m.summary.half_width > 0.5


def test_the_budget_stops_before_a_pair_that_would_end_past_it():
    clock = Clock()
    m = measure(scripted({"target-only": [7.0], "speculative": [4.0]}, clock), lambda: 1, max_pairs=10,
                min_pairs=3, budget_s=30, precision=0.01, clock=clock)   # pairs of 11 s: 2 fit in 30 s, not 3
    assert m.stopped == "budget" and len(m.pairs) == 2 and m.seconds == 22 and not m.stable


def test_a_thread_drop_discards_the_pairs_measured_before_it():
    threads, walls = [2], iter([40.0, 3.0] + [6.0, 3.0, 6.1, 3.0, 5.9, 3.0])

    def run_one(name):
        wall = next(walls)
        if wall == 40.0:
            threads[0] = 1     # the watchdog dropped a thread during the first pair's target-only run
        return wall, wall

    m = measure(run_one, lambda: threads[0], max_pairs=10, min_pairs=3, budget_s=1e9, precision=0.1)
    assert [p.counted for p in m.pairs] == [False, True, True, True] and m.thread_changes == [[2, 1]]
    assert m.pairs[0].threads == 2 and m.pairs[1].threads == 1 and m.summary.speedup == pytest.approx(2.0, rel=0.03)


def test_after_a_thread_drop_the_budget_starts_again():
    clock, threads, walls = Clock(), [2], iter([25.0, 3.0] + [7.0, 4.0] * 5)

    def run_one(name):
        wall = next(walls)
        clock.t += wall
        if wall == 25.0:
            threads[0] = 1
        return wall, wall

    m = measure(run_one, lambda: threads[0], max_pairs=10, min_pairs=3, budget_s=40, precision=0.1, clock=clock)
    assert m.stable and [p.counted for p in m.pairs] == [False, True, True, True]   # 28 s + 3 pairs of 11 s


def test_the_watchdog_drops_threads_when_the_process_gets_less_cpu():
    wall, cpu, set_to, drops = Clock(), Clock(), [], []
    watch = Watchdog(2, set_to.append, clock=wall, cpu_clock=cpu, on_drop=lambda *a: drops.append(a))
    wall.t, cpu.t = 0.3, 0.1
    watch.check()                        # under the 0.5 s window: no verdict yet
    wall.t, cpu.t = 1.0, 1.9             # 95 % of 2 threads' time: fine
    watch.check()
    assert set_to == [] and watch.threads == 2
    wall.t, cpu.t = 2.0, 2.9             # 1 CPU-second in 1 s on 2 threads: 50 %, starved
    watch.check()
    assert set_to == [1] and watch.threads == 1 and drops == [(2, 1, 0.5)] and watch.drops == [[2, 1, 0.5]]
    wall.t, cpu.t = 3.0, 3.1             # one thread starved too: nothing fewer to go to
    watch.check()
    assert set_to == [1]
    fixed = Watchdog(2, set_to.append, enabled=False, clock=wall, cpu_clock=cpu)   # --threads N: kept
    wall.t += 1
    fixed.check()
    assert set_to == [1] and fixed.threads == 2


@pytest.mark.parametrize("got,threads", [(1.97, 2), (1.80, 2), (1.33, 1), (0.9, 1), (0.2, 1)])
def test_the_thread_count_follows_the_cpus_the_probe_got(monkeypatch, got, threads):
    monkeypatch.setattr(paired, "usable_cpus", lambda: 2)
    report = free_cpus(probe=lambda n: got)
    assert report.cpus == 2 and report.got == got and report.threads == threads
    assert f"a 2-thread probe got {got:.2f}" in report.describe()
    capped = free_cpus(probe=lambda n: got, limit=1)      # torch's default (physical cores, OMP_NUM_THREADS) caps it
    assert capped.threads == 1 and "torch's default: 1 thread)" in capped.describe()


def test_the_probe_measures_cpu_time_per_wall_time():
    got = probe_cpu(2, seconds=0.05)
    assert 0 < got <= 2.2
    assert 1 <= paired.usable_cpus() <= (torch.get_num_threads() + 64)


# ------------------------------------------------------------------ the command, with scripted run times
@pytest.fixture
def script(monkeypatch):
    """demo's runs decode for real (tiny model) but report scripted wall times; the CPU probe says 1 thread."""
    import tilespec.cli.demo as demo
    monkeypatch.setattr(demo, "free_cpus", lambda limit=None: CpuReport(1, 0.98, [0.5, 0.5, 0.5], 1))
    real = demo._timed

    def use(series):
        its = {name: cycle(times) for name, times in series.items()}

        def timed(name, dec, ids, args, watch=None):
            out, _, _ = real(name, dec, ids, args)
            wall = next(its[name])
            return out, wall, wall
        monkeypatch.setattr(demo, "_timed", timed)
    return use


def demo_args(tmp_path):
    return ["demo", "--target", "t", "--prompt", "abcabcabcabcabc", "--max-new-tokens", "12",
            "--json", str(tmp_path / "demo.json")]


def test_demo_prints_the_ratio_of_a_stable_series(registry, script, tmp_path, capsys):  # noqa: F811
    script({"target-only": [1.0, 1.004, 0.98], "speculative": [0.5]})
    threads = torch.get_num_threads()
    assert main(demo_args(tmp_path)) == 0
    assert torch.get_num_threads() == threads          # the caller's thread count is restored
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1]
    assert last.startswith("speedup 2.00× over target-only decoding (95 % interval 1.95-2.06×")
    assert last.endswith("from 2 alternating pairs; same run, same model); outputs identical: yes")   # 0.4 % apart
    assert "1 CPU thread (1 CPU usable, a 1-thread probe got 0.98, load average 0.50)" in " ".join(err.split())
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert rec["verdict"] == "measured" and rec["stopped"] == "stable" and rec["threads"] == 1
    assert rec["speedup"] == pytest.approx(2.0, rel=0.01) and rec["speedup_interval_95"][0] < 2.0
    assert rec["target_only_seconds"] == [1.0, 1.004] and rec["speculative_seconds"] == [0.5] * 2
    assert rec["tokens_per_second"]["speculative"] == pytest.approx(12 / 0.5)
    assert len(rec["pairs"]) == 2 and rec["cpu"]["probe_got"] == 0.98 and rec["outputs_identical"] is True


def test_demo_says_a_noisy_machine_is_too_busy_instead_of_a_ratio(registry, script, tmp_path, capsys):  # noqa: F811
    script({"target-only": [4.0, 9.0, 3.0, 12.0], "speculative": [6.0, 2.0, 4.0, 3.0]})
    assert main([*demo_args(tmp_path), "--repeats", "4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("speedup not measured within ±15 %: this machine is too busy (4 pairs; 95 % interval ")
    assert "paired ratios 0.67-4.50×" in last and "pair to pair" in last and "target-only 3-12 s, speculative 2-6 s a run" in last
    assert last.endswith("outputs identical: yes")
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert rec["verdict"] == "too busy to measure" and rec["speedup"] is None and rec["stopped"] == "pairs"
    assert rec["speedup_interval_95"][0] < 1 < rec["speedup_interval_95"][1] and rec["noise"] in last


def test_demo_says_when_too_few_pairs_fit_in_the_budget(registry, script, tmp_path, capsys):  # noqa: F811
    script({"target-only": [1.0, 1.02], "speculative": [0.5]})
    assert main([*demo_args(tmp_path), "--budget", "1e-9"]) == 0   # the first pair ends past it: no second one
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("speedup not measured within ±15 %: this machine is too busy (1 pair; target-only 1 s, ")
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert rec["stopped"] == "budget" and rec["speedup"] is None and rec["speedup_interval_95"] is None


def test_demo_refuses_a_single_pair(registry, tmp_path, capsys):  # noqa: F811
    assert main([*demo_args(tmp_path), "--repeats", "1"]) == 1
    assert "--repeats must be >= 2" in capsys.readouterr().err
