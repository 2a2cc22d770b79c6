"""``hf``: the transformers 4.38 ``_speculative_sampling`` step (the seed paper's baseline), written for tilespec.

Semantics per request (B = 1 in transformers; here applied request by request): q = softmax(draft logits),
p = softmax(target logits) after the same warpers; ratio = p(x)/q(x); accept while rand <= ratio (the cumsum of
rejections trick); at the first rejection sample ``torch.multinomial`` from clamp(p - q, min=0) / sum, else from the
bonus row. It uses torch generators (one per request, seeded from the request seed) instead of tilespec's
counter-based stream, and host syncs like the original. It is exact but slow; use it as a baseline.
"""
from __future__ import annotations

import torch

from ..distributions import draft_log_probs, log_probs
from ..registry import register_method
from ..types import VerifyInputs, VerifyResult, result_from_counts
from ..validation import as_seed_list
from .reference import assemble_output


def _hf_step(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """One request: p [K+1, V], q [K, V], tokens [K]. Returns (n_matches, next token)."""
    gamma = tokens.shape[0]
    idx = torch.arange(gamma, device=p.device)
    p_i, q_i = p[idx, tokens], q[idx, tokens]
    ratio = p_i / q_i
    r_i = torch.rand(ratio.shape, generator=gen, device=p.device, dtype=ratio.dtype)
    is_accepted = r_i <= ratio
    n_matches = int(((~is_accepted).cumsum(dim=-1) < 1).sum())
    if n_matches < gamma:
        p_prime = torch.clamp(p[n_matches] - q[n_matches], min=0)
        p_prime = p_prime.div_(p_prime.sum())
    else:
        p_prime = p[n_matches]
    token = int(torch.multinomial(p_prime, 1, generator=gen))
    return n_matches, token


@register_method("hf", exact=True,
                 description="exact; transformers 4.38 _speculative_sampling semantics, one request at a time")
def hf(inputs: VerifyInputs) -> VerifyResult:
    if inputs.sampling.has_lenience:
        raise NotImplementedError("method 'hf' has no lenience (transformers never had it); use 'reference'")
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    p_all = log_probs(inputs.target_logits, inputs.sampling).exp()
    q_all = draft_log_probs(inputs.draft_tokens, vocab, inputs.sampling, inputs.draft_logits,
                            inputs.draft_probs).exp()
    seeds = as_seed_list(inputs.seeds)
    offsets = inputs.offsets.tolist()
    counts = inputs.num_draft_tokens.tolist()
    accepted, next_tokens = [], []
    for b in range(batch):
        k_b = counts[b]
        gen = inputs.generator
        if gen is None or gen.device != inputs.device:
            gen = torch.Generator(device=inputs.device)
            gen.manual_seed((seeds[b] * 1_000_003 + offsets[b]) % (2**63))
        n, tok = _hf_step(p_all[b, :k_b + 1], q_all[b, :k_b], inputs.draft_tokens[b, :k_b], gen)
        accepted.append(n)
        next_tokens.append(tok)
    num_accepted = torch.tensor(accepted, device=inputs.device, dtype=torch.int64)
    next_token = torch.tensor(next_tokens, device=inputs.device, dtype=torch.int64)
    output = assemble_output(inputs.draft_tokens, num_accepted, next_token)
    return result_from_counts(output, num_accepted, k_max, "hf", True)
