"""``fused``: tilespec's exact verification kernel, logits in (two Triton launches, no host sync).

Pass 1 reads every used logit row once and writes per-chunk (max, sum-exp, argmax); pass 2 tests the drafts in
log space, sums the first rejected row's residual (or the bonus row) per tile and lets the last program (a
self-resetting counter) draw the token by inverse CDF with one counter-based uniform, scanning only one tile. Probabilities are never written. Temperature,
greedy, lenience and draft logits / probabilities / none run in-kernel; top-k / top-p / min-p add an exact
selection pass in PyTorch (one threshold per row, see ``kernels.launch.keep_thresholds``). See docs/kernels.md.
"""
from __future__ import annotations

from ..registry import register_method
from ..types import VerifyInputs, VerifyResult


@register_method("fused", exact=True, keyed_draws=True, graph_safe=True, needs_triton=True,
                 description="exact; Triton, logits in, online log-sum-exp, lazy residual, inverse CDF, 2 launches")
def fused(inputs: VerifyInputs) -> VerifyResult:
    from ..kernels.launch import fused_verify
    return fused_verify(inputs)
