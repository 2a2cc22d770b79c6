"""One decoding step: draft γ tokens, score γ+1 positions with the target, verify. No host syncs in here.

All functions take the :class:`~tilespec.engine.state.BatchState` (B active requests, write pointer W) and return
device tensors; the caller reads the emitted counts once per step.

Random streams: the draft samples token i (logical position seq_len - 1 + i) with Gumbel noise keyed by
(seed, position, PURPOSE_EXTRA, vocab id) -- a stream ``verify()`` never uses -- while ``verify()`` keys its
acceptance uniforms and residual/bonus samples by (seed, position, PURPOSE_ACCEPT / PURPOSE_SAMPLE). Positions only
ever move forward, so each random number influences the output at most once and the output law is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilespec.verify import rng, verify
from tilespec.verify.distributions import log_probs
from tilespec.verify.registry import get_method
from tilespec.verify.types import ResolvedSampling, SamplingParams

from .graphs import GraphCache
from .metrics import PhaseTimer
from .runner import CUDA_GRAPH_MODES, ModelRunner
from .state import BatchState, chunk_mask


@dataclass
class StepOutput:
    """draft_tokens [B, γ]; num_emitted [B]; output_tokens [B, γ+1] (-1 padded); hidden [B, d]: a draft head's new
    state (drafters/head.py), applied at the commit, or None."""

    draft_tokens: torch.Tensor
    num_emitted: torch.Tensor
    output_tokens: torch.Tensor
    hidden: Optional[torch.Tensor] = None


def sample_draft(logits: torch.Tensor, resolved: ResolvedSampling, seeds: torch.Tensor, positions: torch.Tensor,
                 greedy: bool) -> torch.Tensor:
    """Sample one token per row from the processed draft distribution: logits [B, V] -> tokens [B] int64.

    Samples exactly from exp(log_probs(logits, resolved)), the law reported to verify() as draft_logits.
    """
    if greedy:
        return logits.argmax(dim=-1)
    logp = log_probs(logits[:, None, :], resolved)[:, 0]
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    noise = rng.gumbel(seeds[:, None], positions[:, None], rng.PURPOSE_EXTRA, vocab[None, :])
    return torch.argmax(logp + noise, dim=-1)


_COMPILED_SAMPLER = None
_FLAG_NAMES = ("any_greedy", "all_greedy", "has_top_k", "has_top_p", "has_min_p", "has_lenience")


def _graph_sample(logits, seeds, positions, temperature, top_k, top_p, min_p, lenience, *, key):
    resolved = ResolvedSampling(temperature, top_k, top_p, min_p, lenience, *key)
    return sample_draft(logits, resolved, seeds, positions, greedy=False)


_SAMPLER_GRAPHS = GraphCache(_graph_sample)


def _graphed_sampler(logits, resolved, seeds, positions, greedy):
    if greedy:
        return logits.argmax(dim=-1)
    out = _SAMPLER_GRAPHS(logits, seeds, positions, resolved.temperature, resolved.top_k, resolved.top_p,
                          resolved.min_p, resolved.lenience, key=tuple(getattr(resolved, f) for f in _FLAG_NAMES))
    return out.clone()  # the graph's output buffer is reused by the next draft position


def _sampler(mode: str):
    """sample_draft for a runner mode (the Philox noise over V is ~150 small kernels in eager mode, so the fast
    paths run it as one CUDA graph or one compiled function)."""
    global _COMPILED_SAMPLER
    if mode in CUDA_GRAPH_MODES:
        return _graphed_sampler
    if mode == "eager":
        return sample_draft
    if _COMPILED_SAMPLER is None:
        _COMPILED_SAMPLER = torch.compile(sample_draft, dynamic=False)
    return _COMPILED_SAMPLER


def _graph_verify(target_logits, draft_tokens, seeds, offsets, *extra, key):
    method, sampling, options, has_logits = key
    draft_logits = extra[0] if has_logits else None
    counts = extra[1 if has_logits else 0] if len(extra) > int(has_logits) else None
    res = verify(target_logits, draft_tokens, draft_logits=draft_logits, num_draft_tokens=counts,
                 sampling=sampling, method=method, options=dict(options), seed=seeds, offsets=offsets,
                 check_values=False)
    return res.num_emitted, res.output_tokens


_VERIFY_GRAPHS = GraphCache(_graph_verify)


def run_verify(target_logits, draft_tokens, draft_logits, sampling: SamplingParams, method: str, seeds, offsets,
               graphs: bool, num_draft_tokens: Optional[torch.Tensor] = None,
               options: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """verify() -> (num_emitted [B], output_tokens [B, K+1]); replayed as a CUDA graph when ``graphs`` and the
    method (its registry record's ``graph_safe``) and sampling allow it (scalar sampling parameters: they are baked
    into the graph's key, and so are the method's resolved ``options``, ((name, value), ...)).
    num_draft_tokens [B]: per-request draft lengths of a ragged (context-drafted) step, None = K for all."""
    try:
        hash(sampling)
        hashable = True
    except TypeError:
        hashable = False
    if graphs and hashable and target_logits.is_cuda and get_method(method).graph_safe:
        extra = (draft_logits,) if draft_logits is not None else ()
        extra += (num_draft_tokens,) if num_draft_tokens is not None else ()
        num_emitted, out = _VERIFY_GRAPHS(target_logits, draft_tokens, seeds, offsets, *extra,
                                          key=(method, sampling, tuple(options), draft_logits is not None))
        return num_emitted.clone(), out.clone()
    res = verify(target_logits, draft_tokens, draft_logits=draft_logits, num_draft_tokens=num_draft_tokens,
                 sampling=sampling, method=method, options=dict(options), seed=seeds, offsets=offsets,
                 check_values=False)
    return res.num_emitted, res.output_tokens


def draft_block(draft: ModelRunner, state: BatchState, gamma: int, resolved: ResolvedSampling, greedy: bool,
                timer: Optional[PhaseTimer] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Draft γ tokens autoregressively -> (tokens [B, γ], logits [B, γ, V] or None when greedy).

    The first forward re-feeds [prev, pending] at slots [W-1, W] (see state.py); forward i >= 1 feeds draft token i
    at slot W + i. γ forwards in all; slot W + γ (the last draft token) is filled by the next step's re-feed.
    """
    w, pos0 = state.write, state.seq_len - 1                         # pos0 [B]: position of the pending token
    tokens_in = torch.stack([state.prev, state.pending], dim=1)
    positions = torch.stack([(pos0 - 1).clamp(min=0), pos0], dim=1)
    mask = chunk_mask(state.valid, w, w - 1, 2)
    logits = draft.forward(tokens_in, positions, mask, w - 1, keep=1)[:, 0]
    tokens, all_logits = [], []
    sample = _sampler(draft.mode)
    for i in range(1, gamma + 1):
        tok = sample(logits, resolved, state.seeds, pos0 + i, greedy)
        tokens.append(tok)
        if not greedy:
            all_logits.append(logits)
        if i < gamma:
            mask = chunk_mask(state.valid, w, w + i, 1)
            logits = draft.forward(tok[:, None], (pos0 + i)[:, None], mask, w + i)[:, 0]
    draft_tokens = torch.stack(tokens, dim=1)
    return draft_tokens, (torch.stack(all_logits, dim=1) if all_logits else None)


def target_block(target: ModelRunner, state: BatchState, draft_tokens: torch.Tensor, capture: tuple = ()):
    """Score [pending, d_1 .. d_γ] at slots [W, W+γ] in one target forward -> logits [B, γ+1, V] (with ``capture``:
    (logits, features [B, γ+1, n d]) for a draft head)."""
    k = draft_tokens.shape[1]
    tokens_in = torch.cat([state.pending[:, None], draft_tokens], dim=1)
    positions = (state.seq_len - 1)[:, None] + torch.arange(k + 1, device=tokens_in.device)[None, :]
    mask = chunk_mask(state.valid, state.write, state.write, k + 1)
    if capture:
        return target.forward(tokens_in, positions, mask, state.write, capture=capture)
    return target.forward(tokens_in, positions, mask, state.write)


def speculative_step(target: ModelRunner, draft: Optional[ModelRunner], state: BatchState, gamma: int,
                     sampling: SamplingParams, resolved: ResolvedSampling, method: str,
                     timer: PhaseTimer, graph_verify: bool = True, verify_fn=None,
                     context: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     method_options: tuple = ()) -> StepOutput:
    """One step of speculative decoding (γ >= 1 with a draft) or plain decoding (γ = 0 or no draft).

    context: (draft_tokens [B, K], num_draft_tokens [B]) proposed on the host by a context drafter (deterministic,
    ragged); then ``draft`` (a fallback model's runner, or None) only scores the same chunk as the target, so its
    cache stays complete for later model-drafted steps. A draft head's runner (``observes_target``) drafts with its
    ``propose`` and is fed the target's features after verification (``observe``; StepOutput.hidden).
    verify_fn: replaces :func:`run_verify` (same signature). method_options: the method's resolved options,
    ((name, value), ...).
    """
    verify_fn = verify_fn or run_verify
    greedy = resolved.all_greedy
    b = state.size
    counts = None
    head = draft if getattr(draft, "observes_target", False) else None
    if context is not None:
        draft_tokens, counts = context
        draft_logits = None
        if draft is not None and head is None:
            timer.start("draft")
            target_block(draft, state, draft_tokens)
            timer.stop("draft")
    elif draft is not None and gamma > 0:
        timer.start("draft")
        if head is not None:
            draft_tokens, draft_logits = head.propose(state.hidden, state.valid, state.seq_len, state.seeds,
                                                      state.write, resolved, gamma, greedy, _sampler(head.mode))
        else:
            draft_tokens, draft_logits = draft_block(draft, state, gamma, resolved, greedy)
        timer.stop("draft")
    else:
        draft_tokens = torch.zeros((b, 0), dtype=torch.int64, device=state.pending.device)
        draft_logits = None
    timer.start("target")
    if head is not None:
        target_logits, feats = target_block(target, state, draft_tokens, capture=head.features)
    else:
        target_logits = target_block(target, state, draft_tokens)
    timer.stop("target")
    timer.start("verify")
    if greedy and draft_tokens.shape[1] == 0:
        nxt = target_logits[:, 0].argmax(dim=-1)
        num_emitted = torch.ones(b, dtype=torch.int64, device=nxt.device)
        out = nxt[:, None]
    else:
        graphs = graph_verify and target.mode in CUDA_GRAPH_MODES
        extra = {} if counts is None else {"num_draft_tokens": counts}
        num_emitted, out = verify_fn(target_logits, draft_tokens, draft_logits, sampling, method, state.seeds,
                                     state.seq_len, graphs=graphs, options=method_options, **extra)
    timer.stop("verify")
    hidden = None
    if head is not None:
        timer.start("draft")
        hidden = head.observe(feats, out, num_emitted, state.valid, state.seq_len, state.write)
        timer.stop("draft")
    return StepOutput(draft_tokens=draft_tokens, num_emitted=num_emitted, output_tokens=out, hidden=hidden)
