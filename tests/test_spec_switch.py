"""The measured speculation switch (engine/spec_switch.py): explores both kinds of step per row count, then drafts
only where drafting measured faster, re-checking now and then."""
from tilespec.engine.spec_switch import SpecSwitch


def _drive(switch, rows, spec_rate, plain_rate, steps):
    chosen = []
    for _ in range(steps):
        d = switch.draft(rows)
        chosen.append(d)
        switch.observe(rows, d, 1.0, spec_rate if d else plain_rate)
    return chosen


def test_keeps_drafting_where_it_pays_and_stops_where_it_does_not():
    switch = SpecSwitch(min_steps=4, probe_every=4, recheck=50)
    fast = _drive(switch, 1, spec_rate=2.0, plain_rate=1.0, steps=100)
    slow = _drive(switch, 64, spec_rate=0.8, plain_rate=1.0, steps=100)
    assert 2 <= fast[:30].count(False) and fast[30:].count(False) <= 2        # probes, then drafts (one recheck)
    assert slow[40:].count(True) <= 2                                          # target-only after exploring
    state = switch.state()
    assert state[1]["drafting"] and not state[64]["drafting"]


def test_steps_that_compiled_are_not_counted():
    switch = SpecSwitch(min_steps=2)
    switch.observe(4, True, 5.0, 1.0, valid=False)
    switch.observe(4, True, 0.0, 1.0)
    assert 4 not in switch.buckets or switch.buckets[4].spec_n == 0
