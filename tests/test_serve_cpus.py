"""The engine step loop's own core (serve/cpus.py): the choice, its errors, and that threads move off it."""
import os
import subprocess
import sys
import threading

import pytest

from tilespec.serve.cpus import MIN_CPUS, engine_cpus, keep_off, parse_cpus, reserve, siblings

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus("7\n") == {7}
    for bad in ("a", "3-1", "-2", "1-x"):
        with pytest.raises(ValueError, match="a CPU list looks like"):
            parse_cpus(bad)


def test_auto_takes_the_last_core_with_its_siblings_and_nothing_on_small_machines():
    usable = frozenset(range(16))
    got = engine_cpus("auto", usable)
    assert 15 in got and got <= usable and got == siblings(15) & usable
    assert engine_cpus("auto", range(MIN_CPUS - 1)) == frozenset()
    assert engine_cpus("none", usable) == frozenset()


def test_an_explicit_list_must_leave_cpus_for_the_rest():
    assert engine_cpus("6-7", range(8)) == {6, 7}
    with pytest.raises(ValueError, match="some, not all"):
        engine_cpus("0-7", range(8))
    with pytest.raises(ValueError, match="some, not all"):
        engine_cpus("9", range(8))


def test_the_cli_refuses_a_bad_list_with_the_fix():
    from tilespec.cli.serve import engine_cpus_choice
    import argparse
    assert engine_cpus_choice("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match="auto / none"):
        engine_cpus_choice("100000")


@linux_only
def test_reserve_pins_this_thread_and_moves_every_other_thread_off():
    code = """
import os, threading, time
from tilespec.serve.cpus import reserve, allowed
every = allowed()
mine = frozenset({max(every)})
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()
time.sleep(0.05)
assert reserve(mine) == mine
assert os.sched_getaffinity(0) == mine
assert os.sched_getaffinity(t.native_id) == every - mine
stop.set(); t.join()
print("ok")
"""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_nothing_reserved_changes_nothing():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert reserve(frozenset()) == frozenset()
    keep_off(frozenset())
    if before is not None:
        assert os.sched_getaffinity(0) == before
    assert threading.active_count() >= 1
