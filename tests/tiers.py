"""Which cases of a parametrized test run in the default tier (CI's 2 cores, the README's test command) and which
only with ``-m slow``: the first cases of a grid cover each code path once, the rest repeat them at other sizes,
dtypes or settings. ``python -m pytest -m slow`` runs the rest."""
from __future__ import annotations

import pytest


def fast_first(cases, keep: int) -> list:
    """``cases`` as a parametrize list whose cases after the first ``keep`` carry the ``slow`` mark (ids unchanged)."""
    out = []
    for i, case in enumerate(cases):
        if i < keep:
            out.append(case)
        elif isinstance(case, type(pytest.param(0))):
            out.append(pytest.param(*case.values, marks=(*case.marks, pytest.mark.slow), id=case.id))
        else:
            out.append(pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow))
    return out
