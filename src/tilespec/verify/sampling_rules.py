"""The value rules of :class:`~tilespec.verify.types.SamplingParams`' fields, without torch: verify/validation.py
applies them to Python values and tensors alike, and :func:`check_plain` checks one request's Python numbers with
them, so a server's API process refuses a bad request without importing torch."""
from __future__ import annotations

import math

# name -> (the test: comparisons and ``&`` work on a float and on a float64 tensor alike, the rule its error states)
RULES = {"temperature": (lambda t: (t >= 0) & (t < math.inf), "a finite number >= 0"),
         "top_k": (lambda t: t >= 0, "an integer >= 0"),
         "top_p": (lambda t: (t > 0) & (t <= 1), "in (0, 1]"),
         "min_p": (lambda t: (t >= 0) & (t <= 1), "in [0, 1]"),
         "lenience": (lambda t: (t > 0) & (t <= 1), "in (0, 1]")}

FLOAT32_SAFE = 3.4e38       # below float32's largest value: torch stores it without an overflow error
EXACT_INT = 2**53           # an integer float64 holds exactly: top_k's integer check cannot be fooled by rounding


def _plain(value, integer: bool) -> bool:
    """Whether ``value`` is a number resolve_sampling would store as a tensor without an error of torch's own (an
    overflow), so that the rules alone decide it."""
    if isinstance(value, int):      # compared as an int: a huge one does not convert to float
        return abs(value) <= (EXACT_INT if integer else 2**63 - 1)
    if not isinstance(value, float):
        return False
    if integer:
        return math.isfinite(value) and abs(value) <= EXACT_INT
    return not math.isfinite(value) or abs(value) <= FLOAT32_SAFE


def check_plain(temperature, top_k, top_p, min_p, lenience=1.0) -> bool:
    """Raise ValueError as ``validation.resolve_sampling`` does (same order, same messages) for one request's
    sampling given as Python numbers; False, having checked nothing, for anything else (tensors, sequences, values
    torch itself refuses to store): the caller then asks resolve_sampling."""
    values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "lenience": lenience}
    if not all(_plain(v, name == "top_k") for name, v in values.items()):
        return False
    for name, value in values.items():
        ok, rule = RULES[name]
        if not ok(float(value)):
            raise ValueError(f"sampling.{name} must be {rule}, got {value}")
        if name == "top_k" and float(value) != int(value):
            raise ValueError("sampling.top_k must be an integer")
    return True
