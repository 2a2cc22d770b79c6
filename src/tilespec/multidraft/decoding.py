"""Sequence-level multi-draft speculative decoding over Hugging Face causal LMs.

One round from a context c (B requests of equal length, or one request with a prefix KV cache):

1. drafting: K draft sequences of length L per request, row (b, k) sampled from the draft model with its own
   SamplingParams (i.i.d. drafts: the same temperature for every k; non-identical drafts: different ones);
   the laws q_k(. | c, d_k[:t]) are kept, [B, K, L, V].
2. scoring: ONE batched target forward over the B*K sequences c + d_k (with a prefix cache: the cache is
   repeated K times and only the pending tokens + drafts are fed), giving p(. | c, d_k[:t]), t = 0..L.
3. selection: :func:`~.chain.verify_multidraft` position by position, continuing with the drafts whose prefix
   matches the emitted tokens; a bonus token when all L positions continue.

The prefix caches cover the committed context except the ``pending`` tokens (those emitted by the previous
round, >= 1); after a round both caches are reduced to row 0 and cropped to the committed length, so no
rejected draft state survives. Drafting randomness comes from a torch.Generator; verification randomness is
keyed by (seed, position) as in ``tilespec.verify``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..models.cache_keyword import cache_kwarg, output_cache
from ..verify.types import SamplingParams, VerifyResult
from .chain import sampling_probs, verify_multidraft


@dataclass
class Round:
    """Everything one round produced before selection (B requests, K drafts, L tokens, vocabulary V)."""

    target_logits: torch.Tensor      # [B, K, L+1, V] float32
    draft_tokens: torch.Tensor       # [B, K, L] int64
    draft_probs: torch.Tensor        # [B, K, L, V] float64, the laws the tokens were drawn from
    draft_logits: torch.Tensor       # [B, K, L, V] float32 raw (before temperature / top-p)
    pending_logits: Optional[torch.Tensor] = None   # [P, V] target logits after each pending token (row 0)
    pending_draft_logits: Optional[torch.Tensor] = None


def _expand(cache, reps: int):
    if cache is not None and reps > 1:
        cache.batch_repeat_interleave(reps)
    return cache


def _shrink(cache, length: int):
    if cache is None:
        return
    keys = cache.layers[0].keys
    if keys is not None and keys.shape[0] > 1:
        cache.batch_select_indices(torch.tensor([0], device=keys.device))
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)            # transformers >= 5: a negative argument removes that many tokens


@torch.no_grad()
def draft_and_score(target, draft, pending: torch.Tensor, *, draft_sampling: Sequence[SamplingParams], L: int,
                    generator: Optional[torch.Generator] = None, target_cache=None, draft_cache=None) -> Round:
    """Draft K = len(draft_sampling) sequences of length L after ``pending`` [B, P] and score them.

    With caches (B must be 1) the caches hold the context before ``pending``; they are left expanded to K rows
    and must be reduced with :func:`commit` after selection.
    """
    if pending.dim() != 2 or pending.shape[1] < 1:
        raise ValueError("pending must be [B, P] with P >= 1")
    if L < 1:
        raise ValueError(f"draft length L must be >= 1, got {L}")
    b, plen = pending.shape
    k = len(draft_sampling)
    if k < 1:
        raise ValueError("need at least one draft (draft_sampling is empty)")
    if (target_cache is not None or draft_cache is not None) and b != 1:
        raise ValueError("prefix caches need a single request (B = 1)")
    rows = pending.repeat_interleave(k, dim=0)                                     # [B*K, P], row = b*K + k
    temps = [ds.temperature for ds in draft_sampling] * b
    row_sampling = SamplingParams(temperature=temps, top_k=draft_sampling[0].top_k, top_p=draft_sampling[0].top_p,
                                  min_p=draft_sampling[0].min_p)
    cache = _expand(draft_cache, k)
    tokens, raw, probs = [], [], []
    inp = rows
    pending_draft = None
    for t in range(L):
        out = draft(input_ids=inp, use_cache=True, **{cache_kwarg(draft): cache})
        cache = output_cache(out)
        logits = out.logits[:, -1].float()
        if t == 0 and plen > 1:
            pending_draft = out.logits[0, :-1].float()
        q = sampling_probs(logits[:, None], row_sampling)[:, 0]                       # [B*K, V] float64
        q = q[_canonical_rows(rows, tokens, temps)]
        tok = torch.multinomial(q.float(), 1, generator=generator).squeeze(1)
        tokens.append(tok), raw.append(logits), probs.append(q)
        inp = tok[:, None]
    d_tok = torch.stack(tokens, 1)
    tcache = _expand(target_cache, k)
    out = target(input_ids=torch.cat([rows, d_tok], 1), use_cache=target_cache is not None,
                 **{cache_kwarg(target): tcache})
    t_logits = out.logits[:, plen - 1:].float()                                      # [B*K, L+1, V]
    v = t_logits.shape[-1]
    if raw[0].shape[-1] != v:
        raise ValueError(f"target and draft vocabularies differ ({v} vs {raw[0].shape[-1]})")
    return Round(target_logits=t_logits.view(b, k, L + 1, v), draft_tokens=d_tok.view(b, k, L),
                 draft_probs=torch.stack(probs, 1).view(b, k, L, v), draft_logits=torch.stack(raw, 1).view(b, k, L, v),
                 pending_logits=out.logits[0, :plen - 1].float() if plen > 1 else None,
                 pending_draft_logits=pending_draft)


def _canonical_rows(rows: torch.Tensor, tokens: list, temps: list) -> torch.Tensor:
    """[R] index of the first row with the same context, drafted prefix and temperature as each row.

    Rows with equal inputs must use ONE law: batched float32 kernels can differ in the last bits between rows,
    which can flip a token across the top-p boundary and make i.i.d. drafts look non-identical.
    """
    prefix = torch.cat([rows] + [t[:, None] for t in tokens], 1).tolist()
    first, out = {}, []
    for r, key in enumerate(prefix):
        out.append(first.setdefault((temps[r],) + tuple(key), r))
    return torch.tensor(out, device=rows.device)


def commit(target_cache, draft_cache, committed_len: int) -> None:
    """Reduce both prefix caches to one row holding the first ``committed_len`` tokens."""
    _shrink(target_cache, committed_len)
    _shrink(draft_cache, committed_len)


@dataclass
class MultiDraftDecoder:
    """Multi-draft speculative decoding of one request with prefix KV caches: the research reference (eager
    transformers forwards, host-side selection; any draft model, per-draft temperatures). The fast path for the same
    schemes is :class:`tilespec.engine.SpeculativeDecoder` with ``chains=(K, L)`` (docs/trees.md).

    draft_temperatures: K floats (equal: i.i.d. drafts; different: non-identical drafts); ``sampling`` is the
    target's SamplingParams (its top-k / top-p also apply to the drafts); ``scheme``: a selection scheme name.
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    draft_temperatures: Sequence[float]
    L: int = 5
    scheme: str = "is"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    eos_token_id: Optional[int] = None

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        """prompt_ids [1, T] (T >= 1) -> (new tokens, stats with rounds and block efficiency)."""
        from transformers import DynamicCache

        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
            raise ValueError("prompt_ids must be [1, T] with T >= 1")
        ds = [SamplingParams(temperature=t, top_k=self.sampling.top_k, top_p=self.sampling.top_p,
                             min_p=self.sampling.min_p) for t in self.draft_temperatures]
        gen = torch.Generator(device=prompt_ids.device).manual_seed(self.seed)
        tcache, dcache = DynamicCache(), DynamicCache()
        if prompt_ids.shape[1] > 1:
            self.target(input_ids=prompt_ids[:, :-1], use_cache=True, **{cache_kwarg(self.target): tcache})
            self.draft(input_ids=prompt_ids[:, :-1], use_cache=True, **{cache_kwarg(self.draft): dcache})
        committed = prompt_ids.shape[1] - 1
        pending = prompt_ids[:, -1:]
        new: list[int] = []
        accepted = []
        while len(new) < max_new_tokens:
            rnd = draft_and_score(self.target, self.draft, pending, draft_sampling=ds, L=self.L, generator=gen,
                                  target_cache=tcache, draft_cache=dcache)
            res: VerifyResult = verify_multidraft(rnd.target_logits, rnd.draft_tokens, draft_probs=rnd.draft_probs,
                                                  scheme=self.scheme, sampling=self.sampling, seed=self.seed,
                                                  offsets=committed + pending.shape[1])
            committed += pending.shape[1]
            commit(tcache, dcache, committed)
            emitted = res.tokens(0)
            accepted.append(int(res.num_accepted[0]))
            stop = len(emitted)
            if self.eos_token_id is not None and self.eos_token_id in emitted:
                stop = emitted.index(self.eos_token_id) + 1
            new.extend(emitted[:stop])
            if stop < len(emitted) or (self.eos_token_id is not None and emitted[stop - 1] == self.eos_token_id):
                break
            pending = torch.tensor([emitted], dtype=torch.long, device=prompt_ids.device)
        stats = {"rounds": len(accepted), "accepted": accepted,
                 "block_efficiency": sum(a + 1 for a in accepted) / max(len(accepted), 1)}
        return new[:max_new_tokens], stats


@torch.no_grad()
def decode_batch(target, draft, contexts: torch.Tensor, *, draft_sampling: Sequence[SamplingParams], L: int,
                 scheme: str, sampling: SamplingParams, seed: int, generator: torch.Generator) -> VerifyResult:
    """One cache-free round for B contexts of equal length [B, T] (recomputes the prefix; for tests)."""
    rnd = draft_and_score(target, draft, contexts, draft_sampling=draft_sampling, L=L, generator=generator)
    return verify_multidraft(rnd.target_logits, rnd.draft_tokens, draft_probs=rnd.draft_probs, scheme=scheme,
                             sampling=sampling, seed=seed, offsets=contexts.shape[1])
