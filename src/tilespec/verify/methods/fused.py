"""``fused``: tilespec's exact verification kernel, logits in (two Triton launches, no host sync).

Pass 1 reads every used logit row once and writes per-chunk (max, sum-exp, argmax); pass 2 tests the drafts in
log space, samples only the first rejected row's residual (or the bonus row) by Gumbel-max with counter-based
noise, and reduces across programs with a self-resetting counter. Probabilities are never written. Temperature,
greedy, lenience and draft logits / probabilities / none run in-kernel; top-k / top-p / min-p add an exact
selection pass in PyTorch (one threshold per row, see ``kernels.launch.keep_thresholds``). See docs/kernels.md.
"""
from __future__ import annotations

from ..registry import register_method
from ..types import VerifyInputs, VerifyResult


@register_method("fused", exact=True, graph_safe=True, needs_triton=True,
                 description="exact; Triton, logits in, online log-sum-exp, lazy residual, Gumbel-max, 2 launches")
def fused(inputs: VerifyInputs) -> VerifyResult:
    from ..kernels.launch import fused_verify
    return fused_verify(inputs)
