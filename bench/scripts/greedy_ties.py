"""The greedy tie rule of the GPU soak (``soak.py``) and its diagnostic (``soak_tie_logits.py``): when may a T = 0
row differ from a reference greedy decoding (transformers' own ``generate`` of the same batch) in bf16?

Rule: compare each row up to its FIRST differing position j only (after it the two continuations have different
prefixes, so nothing later is comparable). The difference is a tie, and accepted, iff the reference's top two
logits at j are at most ``TIE_STEPS`` = 2 bf16 steps apart, a step being the bf16 spacing at the reference's top
logit (2^(floor(log2 |top|) - 7)). Any other difference is a failure; so is any difference with a larger gap.

Why 2: both runs round their logits to bf16. Rounding moves each of the two values by at most half a step (the
second value's step is at most the top's), so it moves their difference by at most one step in each run, two
between the runs. Two runs that agree on the real-valued logits can therefore still order the two tokens
differently (or see an exact tie, which the argmax breaks by the lower id) whenever the reference's gap is at most
two steps, and never when it is larger. A larger gap needs the logits themselves to differ by more than rounding,
which is a bug to report, not a tie. (An H100 soak saw a gap of exactly 2 steps, an H200 soak at most 1:
``bench/results/soak-greedy-ties-random-qwen2.5-1.5b-shaped-h100.json``.)
"""
from __future__ import annotations

TIE_STEPS = 2.0


def bf16_step(top):
    """The bf16 spacing (one step) at value(s) ``top`` (a float tensor): 2^(floor(log2 |top|) - 7)."""
    import torch
    return torch.exp2(torch.floor(torch.log2(top.abs().clamp(min=1e-30))) - 7)


def top2_gaps(logits) -> list:
    """Per row and step, the gap between the top two logits in bf16 steps of the top one: logits [B, steps, V]
    (float) -> nested list [B][steps]."""
    import torch
    top2 = torch.topk(logits.float(), 2, dim=-1).values
    return ((top2[..., 0] - top2[..., 1]) / bf16_step(top2[..., 0])).tolist()


def first_difference(got: list, want: list):
    """The first position where two token lists differ (a length difference counts at the shorter length), or
    None when they are equal."""
    for j, (x, y) in enumerate(zip(got, want)):
        if x != y:
            return j
    return None if len(got) == len(want) else min(len(got), len(want))


def judge(got_rows: list, want_rows: list, gaps: list, tie_steps: float = TIE_STEPS) -> tuple:
    """(divergences, ties, problems) of rows ``got_rows`` against the reference ``want_rows`` with the reference's
    top-two gaps ``gaps`` [row][step] (``top2_gaps``): one divergence record per differing row (row, first
    differing token, gap), counted as a tie when gap <= ``tie_steps``, else a problem (one line); rows of another
    length than the reference's are problems."""
    divergences, ties, problems = [], 0, []
    for r, (got, want) in enumerate(zip(got_rows, want_rows)):
        j = first_difference(got, want)
        if j is None:
            continue
        if j >= min(len(got), len(want)):      # one row is a prefix of the other: no tie explains a length
            problems.append(f"row {r} has {len(got)} tokens, the reference {len(want)}")
            continue
        gap = round(gaps[r][j], 2)
        divergences.append(dict(row=r, token=j, gap_bf16_steps=gap))
        if gap <= tie_steps:
            ties += 1
        else:
            problems.append(f"row {r} differs from target-only at token {j} (top-2 gap {gap} bf16 steps, "
                            f"more than the tie rule's {tie_steps})")
    return divergences, ties, problems
