"""``reference``: exact speculative sampling in clear, batched PyTorch (the semantics every other method matches).

Per request b with K_b draft tokens x_0..x_{K_b-1}:
  1. accept x_i while log u_i < log p_i(x_i) - log q_i(x_i) - log l   (u_i uniform, keyed by (seed, position));
     q_i(x_i) = 0 always rejects; greedy rows accept iff x_i is the target's argmax (or, with lenience l < 1,
     iff p1(x_i) >= l * max p1);
  2. at the first rejected position n sample from the residual norm(max(0, p_n - l q_n)); if every draft token was
     accepted (n = K_b) sample the bonus token from p_{K_b}. Sampling is the inverse CDF of the weights exp(log w)
     with one uniform keyed by (seed, position, SAMPLE) (:func:`tilespec.verify.rng.inverse_cdf`, tile by tile).
     If the residual's weights underflow to zero (p_n == q_n up to rounding, where a rejection has probability ~0)
     it falls back to p_n.
The residual weights are max(0, exp(log p) - exp(log l q)) in fp32, the same expression as the ``fused`` kernel's
pass 2 (rather than the log-space log p + log1p(-exp(log(l q) - log p)), then exp). Both forms lose the same
~1e-7 * p to rounding where p ~ l q; the linear one keeps the kernel's and the reference's fp32 weights close, which
is what keeps their inverse-CDF draws token-identical over a 150k vocabulary (a systematic 1e-7 difference in the
weights moves ~1 % of draws there).
"""
from __future__ import annotations

import torch

from .. import rng
from ..distributions import NEG_INF, draft_log_probs, lenient_greedy_logprobs, log_probs
from ..registry import register_method
from ..types import VerifyInputs, VerifyResult, result_from_counts


def accept_prefix_length(accepted: torch.Tensor) -> torch.Tensor:
    """[B, K] bool per-position test results -> [B] int64 length of the leading run of True."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def residual_weights(logp_row: torch.Tensor, logq_row: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) from log-space rows (q already scaled by lenience), in linear space as the ``fused`` kernel
    evaluates it (exp of each, then the difference; fp32)."""
    return (logp_row.exp() - logq_row.exp()).clamp(min=0.0)


def cdf_sample(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sample one token per row [B, V] from non-negative weights: inverse CDF, one keyed uniform per row."""
    return rng.inverse_cdf(weights, rng.uniform(seeds, positions, rng.PURPOSE_SAMPLE))


def assemble_output(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """[B, K+1] int64: accepted draft tokens, then next_token at index num_accepted, then -1."""
    batch, k_max = draft_tokens.shape
    cols = torch.arange(k_max + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, torch.full_like(padded, -1))
    return torch.where(cols == num_accepted[:, None], next_token[:, None], out)


@register_method("reference", exact=True, keyed_draws=True, graph_safe=True, evaluate=False,
                 description="exact; batched PyTorch, log-space test, inverse-CDF residual (the semantics oracle)")
def reference(inputs: VerifyInputs) -> VerifyResult:
    sampling = inputs.sampling
    batch, k_max, vocab = inputs.batch_size, inputs.max_draft, inputs.vocab_size
    tokens = inputs.draft_tokens
    logp = log_probs(inputs.target_logits, sampling)                                    # [B, K+1, V]
    logq = draft_log_probs(tokens, vocab, sampling, inputs.draft_logits, inputs.draft_probs)  # [B, K, V]
    log_l = torch.log(sampling.lenience)[:, None]                                       # [B, 1]
    positions = inputs.offsets[:, None] + torch.arange(k_max + 1, device=inputs.device)[None, :]

    lp_x = logp[:, :k_max].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)                 # [B, K]
    lq_x = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    log_u = torch.log(rng.uniform(inputs.seeds[:, None], positions[:, :k_max], rng.PURPOSE_ACCEPT))
    ratio = torch.where(lq_x > NEG_INF, lp_x - lq_x - log_l, torch.full_like(lp_x, NEG_INF))
    accept = log_u < ratio
    if sampling.any_greedy:
        greedy = (sampling.temperature == 0)[:, None]
        lenient = (sampling.lenience < 1)[:, None]
        is_argmax = lp_x == 0                       # greedy target rows are one-hot: log p = 0 only at the argmax
        if sampling.has_lenience:
            logp1 = lenient_greedy_logprobs(inputs.target_logits[:, :k_max], sampling)
            lp1_x = logp1.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            close_enough = lp1_x >= logp1.max(dim=-1).values + log_l
            is_argmax = torch.where(lenient, close_enough, is_argmax)
        accept = torch.where(greedy, is_argmax, accept)
    valid = torch.arange(k_max, device=inputs.device)[None, :] < inputs.num_draft_tokens[:, None]
    num_accepted = accept_prefix_length(accept & valid)                                # [B]

    row = num_accepted.view(-1, 1, 1).expand(batch, 1, vocab)
    w = logp.gather(1, row).squeeze(1).exp()                                            # [B, V] p_n
    if k_max > 0:
        logq_row = logq.gather(1, row.clamp(max=k_max - 1)).squeeze(1) + log_l
        residual = residual_weights(logp.gather(1, row).squeeze(1), logq_row)
        rejected = (num_accepted < inputs.num_draft_tokens) & (residual > 0).any(dim=-1)
        w = torch.where(rejected[:, None], residual, w)
    next_token = cdf_sample(w, inputs.seeds, positions.gather(1, num_accepted[:, None]).squeeze(1))
    output = assemble_output(tokens, num_accepted, next_token)
    return result_from_counts(output, num_accepted, k_max, "reference", True)
