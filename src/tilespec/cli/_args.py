"""argparse ``type`` checkers shared by the commands; nothing heavy is imported here, so a command module that
needs only these (``serve``) registers its parser without pulling in the engine."""
from __future__ import annotations

import argparse


def _number(kind, low: float, rule: str, high: float = float("inf")):
    """An argparse ``type`` that parses ``kind`` and requires low <= value <= high (argparse names the flag)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


positive_int = _number(int, 1, "an integer >= 1")
non_negative_int = _number(int, 0, "an integer >= 0")
non_negative_float = _number(float, 0.0, "a finite number >= 0", high=1e300)
probability = _number(float, 1e-300, "a number in (0, 1]", high=1.0)
