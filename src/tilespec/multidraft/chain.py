"""``verify_multidraft``: one verification round over K draft sequences of length L (a K-ary "bundle" of chains).

Draft k proposed tokens d_k[0..L-1] with laws q_k(. | c, d_k[:t]); the target scored every draft prefix, giving
p(. | c, d_k[:t]) for t = 0..L (one batched forward over the K sequences). Position by position:

  alive = all drafts;  for t = 0..L-1:
      the target law at this node is p(. | c, y_{<t}) (the same for every alive draft: their prefixes equal y_{<t});
      the candidates are the alive drafts' t-th tokens, with their own laws q_k (identical drafts: equal laws);
      y_t = TLSR(p, {q_k, d_k[t]}_{k alive});   alive = {k alive : d_k[t] == y_t};   stop if alive is empty.
  if every position continued, a bonus token y_L ~ p(. | c, y_{<L}) (from the first alive draft's row L).

Continuing with every draft whose token equals y_t (even when y_t came from a residual draw) keeps the output
law exact: given the past, the alive drafts' next tokens are independent draws from their assumed laws.
Randomness of position t is keyed by (seed_b, offsets_b + t), like ``tilespec.verify`` (K = 1 with scheme 'sd'
uses the same accept uniforms as the ``reference`` method, and its sampling law with ``sampler="cdf"``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..verify import rng
from ..verify.distributions import log_probs
from ..verify.types import SamplingParams, VerifyResult
from ..verify.validation import resolve_sampling
from .common import DTYPE, Stream, check_law
from .schemes import SchemeSpec, parse_scheme, select


def sampling_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """[B, R, V] logits -> float64 probabilities under ``sampling`` (per request b)."""
    resolved = resolve_sampling(sampling, logits.shape[0], logits.device)
    probs = torch.exp(log_probs(logits, resolved).to(DTYPE))
    return probs / probs.sum(-1, keepdim=True)          # float64 renormalisation of the float32 log-softmax


def _check(name: str, x: Optional[torch.Tensor], shape: tuple) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def verify_multidraft(target_logits: Optional[torch.Tensor], draft_tokens: torch.Tensor, *,
                      draft_logits: Optional[torch.Tensor] = None, draft_probs: Optional[torch.Tensor] = None,
                      target_probs: Optional[torch.Tensor] = None, scheme: Union[str, SchemeSpec] = "is",
                      sampling: SamplingParams = SamplingParams(),
                      draft_sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                      seed=0, offsets=0, sampler: str = "gumbel",
                      check_values: bool = True) -> VerifyResult:
    """Verify K draft sequences per request; returns a VerifyResult plus multi-draft extras.

    Args:
        target_logits: [B, K, L+1, V] target logits after each draft prefix (or give ``target_probs``, same shape,
            already processed). Row t of draft k is p(. | c, d_k[:t]).
        draft_tokens: [B, K, L] int64.
        draft_logits / draft_probs: [B, K, L, V]; logits are processed with ``draft_sampling`` (one
            SamplingParams for all drafts, or one per draft k, e.g. different temperatures; default ``sampling``),
            probabilities are used as given (they must be the laws the tokens were drawn from).
        scheme: a name accepted by :func:`~.schemes.parse_scheme` ('is', 'specinfer', 'spectr', 'sd', ...).
        seed: int (request b uses seed + b) or [B] seeds; offsets: int or [B] absolute position of the first draft
            token (randomness is keyed by seed and offsets + t).
        check_values: check the laws once (finite, >= 0, rows sum to 1); per-position checks are skipped.
        sampler: 'gumbel' or 'cdf' (inverse CDF, the reference method's law; far cheaper for large V on CPU).

    Returns:
        VerifyResult: output_tokens [B, L+1] (-1 padded), num_accepted [B] (positions that continued with a draft),
        num_emitted = num_accepted + 1, accepted [B, L]; extras: ``followed`` [B, L] int64 (first alive draft
        whose token was emitted, -1 after the stop), ``test_pass`` [B, L] bool, ``alive`` [B, K] bool (drafts
        that matched every emitted token), ``scheme`` (name).
    """
    spec = scheme if isinstance(scheme, SchemeSpec) else parse_scheme(scheme)
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 3:
        raise ValueError("draft_tokens must be a [B, K, L] tensor")
    b, k, L = draft_tokens.shape
    if k < 1:
        raise ValueError("need at least one draft sequence (K >= 1)")
    if (target_logits is None) == (target_probs is None):
        raise ValueError("give exactly one of target_logits and target_probs")
    tgt = target_logits if target_logits is not None else target_probs
    if not isinstance(tgt, torch.Tensor) or tgt.dim() != 4:
        raise ValueError("target logits/probs must be a [B, K, L+1, V] tensor")
    v = tgt.shape[-1]
    _check("target", tgt, (b, k, L + 1, v))
    if (draft_logits is None) == (draft_probs is None):
        raise ValueError("give exactly one of draft_logits and draft_probs")
    _check("draft_logits", draft_logits, (b, k, L, v))
    _check("draft_probs", draft_probs, (b, k, L, v))
    dev = tgt.device
    tokens = draft_tokens.long().to(dev)
    if bool((tokens < 0).any()) or bool((tokens >= v).any()):
        raise ValueError(f"draft tokens must lie in [0, {v})")

    if target_probs is not None:
        p_all = target_probs.to(DTYPE)
    else:
        p_all = sampling_probs(target_logits.reshape(b, k * (L + 1), v), sampling).view(b, k, L + 1, v)
    if draft_probs is not None:
        q_all = draft_probs.to(DTYPE)
    else:
        per = draft_sampling if draft_sampling is not None else sampling
        per = [per] * k if isinstance(per, SamplingParams) else list(per)
        if len(per) != k:
            raise ValueError(f"draft_sampling must be one SamplingParams or {k} of them, got {len(per)}")
        q_all = torch.stack([sampling_probs(draft_logits[:, i], per[i]) for i in range(k)], dim=1)

    if check_values:
        check_law(p_all, "target probabilities")
        check_law(q_all, "draft probabilities")
    seeds = rng.seeds_from(seed, b, dev)
    offs = torch.as_tensor(offsets, dtype=torch.int64, device=dev).expand(b)
    out = torch.full((b, L + 1), -1, dtype=torch.int64, device=dev)
    followed = torch.full((b, L), -1, dtype=torch.int64, device=dev)
    test_pass = torch.zeros(b, L, dtype=torch.bool, device=dev)
    alive = torch.ones(b, k, dtype=torch.bool, device=dev)
    going = torch.ones(b, dtype=torch.bool, device=dev)
    n_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    for t in range(L + 1):
        rows = going.nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        ref = alive[rows].long().argmax(dim=1)
        p_t = p_all[rows, ref, t]
        stream = Stream(seeds[rows], offs[rows] + t, sampler)
        if t == L:
            out[rows, t] = stream.sample(p_t)
            break
        toks = tokens[rows, :, t]
        sel = select(spec, p_t, q_all[rows, :, t], toks, stream, alive[rows], validate=False)
        out[rows, t] = sel.token
        test_pass[rows, t] = sel.test_pass
        match = alive[rows] & (toks == sel.token[:, None])
        cont = match.any(dim=1)
        followed[rows[cont], t] = sel.index[cont]
        alive[rows] = match
        n_acc[rows[cont]] += 1
        going[rows[~cont]] = False
    positions = torch.arange(L, device=dev)[None, :]
    result = VerifyResult(output_tokens=out, num_accepted=n_acc, num_emitted=n_acc + 1,
                          accepted=positions < n_acc[:, None], method=f"multidraft:{spec.name}", exact=True)
    result.extras = {"followed": followed, "test_pass": test_pass, "alive": alive, "scheme": spec.name}
    return result
