"""Per-request transforms of the TARGET's logits before verification: OpenAI's ``presence_penalty``,
``frequency_penalty`` and ``logit_bias``, and vLLM's ``min_tokens`` (stop ids banned until a request has that many
tokens). Every exact verification method stays exact with respect to the transformed law, because the transform is
applied to the target's logits at every verified position exactly as target-only decoding would apply it there.

The one subtlety is the speculative block. Verification scores positions 0..K of a block whose inputs are
``[pending, d_1 .. d_K]``; position i is the next-token law *after* drafts d_1..d_i, so the penalties there count the
tokens generated before the block PLUS the block's first i drafts (the draft at position i is accepted only if all
before it were, so whenever position i's law is used those drafts are generated tokens). :func:`transform_logits`
does exactly that with a [B, K+1, K] correction, never a [B, K+1, V] count tensor:

    n_i(t)  = counts[t] + #{j < i : d_j = t}                    (tokens generated before position i)
    out[i, t] = logits[i, t] + bias[t] - frequency * n_i(t) - presence * [n_i(t) > 0]
    out[i, t] = -inf  for t in banned  while  generated + i < min_tokens

This module is pure tensor code: no engine, no host syncs, no state. A serving engine keeps each request's
:class:`LogitSettings` (verify/logit_settings.py: torch-free, for the API processes that build them) and its
generated tokens, and per step builds :class:`TransformBatch` (``from_settings``) and calls :func:`transform_logits`
on the target's logits before ``verify()`` (and before a greedy argmax).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .logit_settings import LogitSettings

__all__ = ["LogitSettings", "TransformBatch", "transform_logits"]


@dataclass
class TransformBatch:
    """The tensors of one step's transforms over B rows (rows without transforms hold zeros / padding):

    counts [B, V] float32: each row's generated tokens before the block, per token id;
    presence, frequency [B] float32; generated, min_tokens [B] int64;
    bias_ids [B, M] int64 and bias_values [B, M] float32 (padding: id 0, value 0; M may be 0);
    banned_ids [B, S] int64 (each row's ids first, then padding -1; S may be 0)."""

    counts: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    generated: torch.Tensor
    min_tokens: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    banned_ids: torch.Tensor

    @classmethod
    def from_settings(cls, settings: Sequence[Optional[LogitSettings]], tokens: Sequence[Sequence[int]], vocab: int,
                      device) -> "TransformBatch":
        """Row b: ``settings[b]`` (None: no transform) after generating ``tokens[b]`` (ids in [0, vocab))."""
        b = len(settings)
        none = LogitSettings()
        rows = [s or none for s in settings]
        counts = torch.zeros((b, vocab), dtype=torch.float32)
        for r, (s, toks) in enumerate(zip(rows, tokens)):
            if (s.presence_penalty or s.frequency_penalty) and len(toks):
                counts[r] = torch.bincount(torch.as_tensor(list(toks), dtype=torch.int64), minlength=vocab)[:vocab]
        m = max((len(s.logit_bias) for s in rows), default=0)
        bias_ids = torch.zeros((b, m), dtype=torch.int64)
        bias_values = torch.zeros((b, m), dtype=torch.float32)
        for r, s in enumerate(rows):
            if s.logit_bias:
                bias_ids[r, :len(s.logit_bias)] = torch.tensor(list(s.logit_bias.keys()), dtype=torch.int64)
                bias_values[r, :len(s.logit_bias)] = torch.tensor(list(s.logit_bias.values()), dtype=torch.float32)
        width = max((len(s.banned) for s in rows if s.min_tokens > 0), default=0)
        banned = torch.full((b, width), -1, dtype=torch.int64)
        for r, s in enumerate(rows):
            if s.min_tokens > 0 and s.banned:
                banned[r, :len(s.banned)] = torch.tensor(list(s.banned), dtype=torch.int64)
        to = dict(device=device)
        return cls(counts=counts.to(**to),
                   presence=torch.tensor([s.presence_penalty for s in rows], dtype=torch.float32, **to),
                   frequency=torch.tensor([s.frequency_penalty for s in rows], dtype=torch.float32, **to),
                   generated=torch.tensor([len(t) for t in tokens], dtype=torch.int64, **to),
                   min_tokens=torch.tensor([s.min_tokens for s in rows], dtype=torch.int64, **to),
                   bias_ids=bias_ids.to(**to), bias_values=bias_values.to(**to), banned_ids=banned.to(**to))


def _penalty(n: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """frequency * n + presence * [n > 0]; n [..., X], presence / frequency broadcast to it."""
    return frequency * n + presence * (n > 0).to(n.dtype)


def transform_logits(logits: torch.Tensor, draft_tokens: torch.Tensor, batch: TransformBatch) -> torch.Tensor:
    """The transformed target logits of one speculative block (see the module docstring for the formula).

    logits [B, K+1, V] float (position i: the law after the block's first i drafts); draft_tokens [B, K] int64 ids
    in [0, V) (padding past a row's own draft length must be ids too: only positions after it see them, and
    verification never reads those); ``batch``: :class:`TransformBatch` over the same B rows and V. Returns a new
    float32 tensor [B, K+1, V]; ``logits`` is not modified. K = 0 is target-only decoding's one position."""
    bsz, q, vocab = logits.shape
    k = draft_tokens.shape[1]
    if q != k + 1 or draft_tokens.shape[0] != bsz or batch.counts.shape != (bsz, vocab):
        raise ValueError(f"transform_logits: logits {tuple(logits.shape)}, draft_tokens "
                         f"{tuple(draft_tokens.shape)} and counts {tuple(batch.counts.shape)} do not match "
                         f"([B, K+1, V], [B, K], [B, V])")
    pres, freq = batch.presence[:, None, None], batch.frequency[:, None, None]
    out = logits.float() - _penalty(batch.counts[:, None, :], pres, freq)
    if k > 0:
        # n_i(d_j) = counts[d_j] + #{j' < i : d_j' = d_j}: the same value for every j holding one token, so the
        # scatter below writes equal values at repeated ids (deterministic).
        same = (draft_tokens[:, :, None] == draft_tokens[:, None, :]).float()               # [B, K(j), K(j')]
        before = torch.cat([torch.zeros_like(same[:, :, :1]), same.cumsum(dim=2)], dim=2)   # [B, K(j), K+1(i)]
        base = batch.counts.gather(1, draft_tokens)                                           # [B, K]
        n = base[:, None, :] + before.transpose(1, 2)                                         # [B, K+1(i), K(j)]
        index = draft_tokens[:, None, :].expand(bsz, q, k)
        raw = logits.float().gather(2, index)
        out.scatter_(2, index, raw - _penalty(n, pres, freq))
    if batch.bias_ids.shape[1]:
        out.scatter_add_(2, batch.bias_ids[:, None, :].expand(bsz, q, -1),
                         batch.bias_values[:, None, :].expand(bsz, q, -1))
    if batch.banned_ids.shape[1]:
        position = torch.arange(q, device=logits.device)[None, :]
        early = (batch.generated[:, None] + position) < batch.min_tokens[:, None]                # [B, K+1]
        # padding (-1) repeats the row's first id, so repeated ids carry the same value (deterministic scatter)
        ids = torch.where(batch.banned_ids >= 0, batch.banned_ids, batch.banned_ids[:, :1])
        hit = early[:, :, None] & (ids >= 0)[:, None, :]
        ids = ids.clamp(min=0)[:, None, :].expand(bsz, q, -1)
        out.scatter_(2, ids, torch.where(hit, float("-inf"), out.gather(2, ids)))
    return out
