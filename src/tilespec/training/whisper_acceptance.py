"""Held-out acceptance of a distilled Whisper draft at a sampling temperature, teacher forced along sequences.

Per position, with p = softmax(target logits / T) and q = softmax(draft logits / T) (Leviathan et al. 2023, Def. 3.1):
  * T = 0: a draft token is accepted iff it is the target's argmax: β = [argmax q == argmax p];
  * T > 0: speculative sampling accepts the draft's sample x ~ q with probability min(1, p(x) / q(x)), so
    β = Σ_x q(x) min(1, p(x) / q(x)) = Σ_x min(p(x), q(x)) = 1 - TV(p, q).
α at T is the mean of β over the transcript positions of sequences the target decoded at T (its greedy transcripts
at T = 0, its own samples at T > 0: the prefixes speculative decoding at T actually visits).

Chain statistics from the β_i of one sequence (i = 0 .. L-1): a chain of drafts started at i accepts its first k
with probability Π_{j<k} β_{i+j} (acceptances at different positions taken as independent given the prefix; exact
at T = 0, where β ∈ {0, 1}). ``alpha_per_step[k-1]`` = Σ_i Π_{j<k} β_{i+j} / Σ_i Π_{j<k-1} β_{i+j} over the starts
i whose k drafts fit (i + k <= L): P(draft k accepted | the first k - 1 were); ``tokens_per_step[γ]`` =
1 + Σ_{k<=γ} Π_{j<=k} alpha_per_step[j - 1] (Leviathan's expected tokens per target step with position-dependent α).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .whisper_draft import _autocast, _batch, _log_probs, _owners


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """β per position: logits [..., V] (or log-probabilities: the same distributions) of target and draft ->
    [...] float32 in [0, 1], the probability that the draft's token there is accepted at ``temperature``."""
    if target_logits.shape != draft_logits.shape or target_logits.dim() < 1:
        raise ValueError(f"target and draft logits must have one shape [..., V], got {tuple(target_logits.shape)} "
                         f"and {tuple(draft_logits.shape)}")
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if temperature == 0.0:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).float()
    p = torch.softmax(target_logits.float() / temperature, -1)
    q = torch.softmax(draft_logits.float() / temperature, -1)
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0)


def chain_statistics(betas: Sequence[Sequence[float]], max_gamma: int = 8) -> dict:
    """``alpha``, ``alpha_per_step`` (max_gamma entries), ``tokens_per_step`` {γ: τ} and ``positions`` from the
    per-position acceptances ``betas`` of several sequences (see the module docstring)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    offered, taken = [0.0] * max_gamma, [0.0] * max_gamma
    for b in betas:
        b = [float(x) for x in b]
        for i in range(len(b)):
            run = 1.0
            for k in range(min(max_gamma, len(b) - i)):
                offered[k] += run
                run *= b[i + k]
                taken[k] += run
    positions = sum(len(b) for b in betas)
    alpha = sum(float(x) for b in betas for x in b) / max(positions, 1)
    per_step = [taken[k] / offered[k] if offered[k] else 0.0 for k in range(max_gamma)]
    tokens, run, tau = {}, 1.0, 1.0
    for g in range(1, max_gamma + 1):
        run *= per_step[g - 1]
        tau += run
        tokens[g] = round(tau, 3)
    return {"alpha": round(alpha, 4), "alpha_per_step": [round(a, 4) for a in per_step], "tokens_per_step": tokens,
            "positions": positions}


@torch.no_grad()
def heldout_acceptance(target, draft, states: torch.Tensor, sequences: list, *, prefix_len: int, temperature: float,
                       owners: Optional[Sequence[int]] = None, max_gamma: int = 8, batch_size: int = 16) -> dict:
    """α of ``draft`` at ``temperature`` along ``sequences`` (prefix + transcript, teacher forced; ``owners``: the
    row of ``states`` [N, frames, d_model] of each, default one per sequence), over the positions predicting the
    transcript (EOS included, the forced prefix not), with :func:`chain_statistics` and ``temperature`` and
    ``sequences`` in the result."""
    if prefix_len < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    owners = _owners(states, sequences, owners)
    pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    was = draft.training
    draft.eval()
    betas = []
    try:
        for i in range(0, len(sequences), batch_size):
            seqs = sequences[i:i + batch_size]
            ids, _ = _batch(seqs, pad, states.device)
            enc = states[owners[i:i + batch_size]]
            with _autocast(states.device):
                t = _log_probs(target, enc, ids[:, :-1])
                d = _log_probs(draft, enc, ids[:, :-1])
            beta = acceptance(t, d, temperature).cpu()
            betas += [beta[j, prefix_len - 1:len(s) - 1].tolist() for j, s in enumerate(seqs)]
    finally:
        draft.train(was)
    return {"temperature": float(temperature), **chain_statistics(betas, max_gamma), "sequences": len(sequences)}
