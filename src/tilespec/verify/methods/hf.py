"""``hf``: the transformers 4.38 ``_speculative_sampling`` step (the seed paper's baseline), written for tilespec.

Semantics per request (B = 1 in transformers; here applied request by request): q = softmax(draft logits),
p = softmax(target logits) after the same warpers; ratio = p(x)/q(x); accept while rand <= ratio (the cumsum of
rejections trick); at the first rejection sample ``torch.multinomial`` from clamp(p - q, min=0) / sum, else from the
bonus row. It draws from one torch generator (seeded from the first request's seed, or the caller's generator)
instead of tilespec's counter-based stream, so its tokens depend on batch composition, as in transformers; it is
registered ``batch_invariant=False`` and verify() refuses per-request seeds that differ. An all-zero residual
(which transformers would turn into NaN) falls back to p. It is exact but unfused; use it as the baseline. For
B = 1 it is exactly the 4.38 computation.
"""
from __future__ import annotations

import torch

from ..distributions import draft_log_probs, log_probs
from ..registry import register_method
from ..types import VerifyInputs, VerifyResult, result_from_counts
from ..validation import as_seed_list
from .reference import assemble_output


def _hf_batched(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, num_draft: torch.Tensor,
                gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 4.38's steps on a batch: p [B, K+1, V], q [B, K, V], tokens [B, K], num_draft [B].

    Returns (n_matches [B], next token [B]). Positions past K_b count as rejections so n_matches <= K_b.
    """
    batch, gamma = tokens.shape
    p_i = p[:, :gamma].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_i = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    probability_ratio = p_i / q_i
    r_i = torch.rand(probability_ratio.shape, generator=gen, device=p.device, dtype=probability_ratio.dtype)
    is_accepted = r_i <= probability_ratio
    is_accepted &= torch.arange(gamma, device=p.device)[None, :] < num_draft[:, None]
    n_matches = ((~is_accepted).cumsum(dim=-1) < 1).sum(dim=-1)
    row = n_matches.view(-1, 1, 1).expand(batch, 1, p.shape[-1])
    p_n = p.gather(1, row).squeeze(1)
    if gamma > 0:
        q_n = q.gather(1, row.clamp(max=gamma - 1)).squeeze(1)
        p_prime = torch.clamp(p_n - q_n, min=0)
        # transformers divides by the sum unguarded: an all-zero residual (q >= p everywhere, e.g. unnormalised q,
        # or p == q up to rounding, where a rejection has probability ~0) would hand NaN to multinomial. Fall back
        # to p_n there, as the other methods do.
        mass = p_prime.sum(-1, keepdim=True)
        p_prime = torch.where(mass > 0, p_prime / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_n)
        p_prime = torch.where((n_matches < num_draft)[:, None], p_prime, p_n)
    else:
        p_prime = p_n
    next_token = torch.multinomial(p_prime, 1, generator=gen).squeeze(1)
    return n_matches, next_token


@register_method("hf", exact=True, batch_invariant=False,
                 description="exact; transformers 4.38 _speculative_sampling semantics (softmax, ratio, cumsum, "
                             "clamp(p-q)/sum, multinomial), batched, torch generator")
def hf(inputs: VerifyInputs) -> VerifyResult:
    if inputs.sampling.has_lenience:
        raise NotImplementedError("method 'hf' has no lenience (transformers never had it); use 'reference'")
    vocab = inputs.vocab_size
    p = log_probs(inputs.target_logits, inputs.sampling).exp()
    q = draft_log_probs(inputs.draft_tokens, vocab, inputs.sampling, inputs.draft_logits, inputs.draft_probs).exp()
    gen = inputs.generator
    if gen is None or gen.device != inputs.device:
        # One generator for the batch, seeded from the first request (transformers draws from one global stream).
        gen = torch.Generator(device=inputs.device)
        first = as_seed_list(inputs.seeds[:1])[0]
        gen.manual_seed((first * 1_000_003 + int(inputs.offsets[0])) % (2**63))
    n_matches, next_token = _hf_batched(p, q, inputs.draft_tokens, inputs.num_draft_tokens, gen)
    output = assemble_output(inputs.draft_tokens, n_matches, next_token)
    return result_from_counts(output, n_matches, inputs.max_draft, "hf", True)
