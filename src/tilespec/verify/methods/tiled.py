"""``tiled``: the seed paper's exact tiled method (Wagner et al. 2024, Sec. 3.2.1) in Triton, for any batch size.

Probabilities in: the target / draft distributions are formed in PyTorch (softmax after the sampling filters, as
the paper's code does), then one kernel computes per tile tau, f = p - l q, a = max(0, f) and b_k, and the shared
pass-2 kernel tests the drafts and samples the residual of the first rejected row by inverse CDF with tilespec's
keyed uniform (the ``reference`` law). Greedy requests with lenience < 1 are handed to ``reference`` (the lenient greedy rule needs the
temperature-1 distribution, which probabilities-in cannot see).
"""
from __future__ import annotations

from ..registry import register_method
from ..types import VerifyInputs, VerifyResult


@register_method("tiled", exact=True, keyed_draws=True, graph_safe=True, needs_triton=True,
                 description="exact; the seed paper's tiled kernel (tau, a, b_k per tile) on probabilities, Triton")
def tiled(inputs: VerifyInputs) -> VerifyResult:
    if inputs.sampling.any_greedy and inputs.sampling.has_lenience:
        from .reference import reference
        return reference(inputs)
    from ..kernels.launch import tiled_verify
    return tiled_verify(inputs)
