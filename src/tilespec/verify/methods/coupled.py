"""``coupled``: exact speculative sampling whose tokens do not depend on the draft (deterministic drafts).

For a deterministic draft (context drafters, greedy drafts: no draft logits / probabilities), position j's token is
the one target-only decoding would sample there, y_j = inverse CDF of p_j with the uniform keyed by (seed,
offset + j, SAMPLE) - the very draw ``reference`` makes for its next token. Draft token x_j is accepted iff
x_j == y_j; the first mismatch (or the bonus position) emits y_j. Law: x_j is accepted with probability p_j(x_j),
and on a rejection y_j follows p_j restricted to tokens != x_j, renormalised - exactly the law of speculative
sampling with a one-hot q (residual norm(max(0, p - q))). So the output law is the target's, acceptance is optimal,
and the emitted tokens equal target-only decoding with ``reference`` whatever was drafted, how many tokens, or
whether the step drafted at all: a server may switch speculation per request and per load without changing any
seeded request's tokens.

With draft logits / probabilities (a sampled draft model) or lenience < 1 this method is ``reference`` (exact, not
draft-invariant). Cost over ``reference``: one inverse-CDF draw per position ([B, K+1] rows) instead of one per
request.
On a GPU the draws come from the ``fused`` sampler (every position a row without drafts: two launches, no
probability tensor), as target-only steps do there (``registry.no_draft_method``), so the two stay the same draw.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import rng
from ..distributions import log_probs
from ..registry import no_draft_method, register_method
from ..types import VerifyInputs, VerifyResult, result_from_counts
from .reference import accept_prefix_length, assemble_output, reference


def keyed_draws(inputs: VerifyInputs, positions: torch.Tensor) -> torch.Tensor:
    """y [B, R]: the keyed inverse-CDF draw of every target row (R = K + 1) at ``positions`` [B, R] -- the token
    target-only decoding samples at that position (on a GPU by ``fused``, each row a request without drafts)."""
    batch, rows, vocab = inputs.target_logits.shape
    sampling = inputs.sampling
    if no_draft_method("coupled", inputs.device) == "fused":
        from ..kernels.launch import fused_verify
        n = batch * rows
        per_row = replace(sampling, **{f: getattr(sampling, f).repeat_interleave(rows)
                                       for f in ("temperature", "top_k", "top_p", "min_p", "lenience")})
        none = torch.zeros(n, dtype=torch.int64, device=inputs.device)
        flat = VerifyInputs(target_logits=inputs.target_logits.reshape(n, 1, vocab),
                            draft_tokens=none[:, None][:, :0], num_draft_tokens=none, sampling=per_row,
                            seeds=inputs.seeds.repeat_interleave(rows), offsets=positions.reshape(-1))
        return fused_verify(flat).output_tokens[:, 0].view(batch, rows)
    weights = log_probs(inputs.target_logits, sampling).exp()                                     # [B, R, V]
    u = rng.uniform(inputs.seeds[:, None], positions, rng.PURPOSE_SAMPLE)                          # [B, R]
    return rng.inverse_cdf(weights.reshape(-1, vocab), u.reshape(-1)).view(batch, rows)


@register_method("coupled", exact=True, keyed_draws=True, graph_safe=True, evaluate=False,
                 description="exact; deterministic drafts accepted iff they equal the target's own keyed draw, so "
                             "tokens equal target-only decoding whatever is drafted (else reference)")
def coupled(inputs: VerifyInputs) -> VerifyResult:
    sampling = inputs.sampling
    if inputs.draft_logits is not None or inputs.draft_probs is not None or sampling.has_lenience:
        result = reference(inputs)
        result.method = "coupled"
        return result
    k_max = inputs.max_draft
    tokens = inputs.draft_tokens
    positions = inputs.offsets[:, None] + torch.arange(k_max + 1, device=inputs.device)[None, :]   # [B, K+1]
    drawn = keyed_draws(inputs, positions)                                                         # y_j
    valid = torch.arange(k_max, device=inputs.device)[None, :] < inputs.num_draft_tokens[:, None]
    num_accepted = accept_prefix_length((tokens == drawn[:, :k_max]) & valid)
    next_token = drawn.gather(1, num_accepted[:, None]).squeeze(1)
    return result_from_counts(assemble_output(tokens, num_accepted, next_token), num_accepted, k_max, "coupled",
                              True)
