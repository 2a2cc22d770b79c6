"""The paged engine's verify step: the sampling requests' drafts, seeds and offsets packed for one copy to the device,
their logit transforms, ``verify()``, and the logprobs of what it emitted (from the logits it already has)."""
from __future__ import annotations

import numpy as np
import torch

from tilespec.verify.api import verify
from tilespec.verify.logit_transforms import TransformBatch, transform_logits
from tilespec.verify.types import SamplingParams

from .layout import pack_aligned


def verify_rows(sampling: list, logits: torch.Tensor, *, pad: int, method: str, draft_logits=None,
                chains=None) -> tuple:
    """verify() over the sampling items (scheduler.Item) and ``logits`` [bucket rows, 1 + K, V] (both step paths give
    the rows bucket; absent rows: no drafts, seed 0, whatever logits the padding holds), so its shapes are few ->
    (the VerifyResult on the device, the logits after the requests' transforms). ``draft_logits`` [n, K, V]: the
    law each draft was sampled from (a draft model's, draft_model.py; None: deterministic drafts). ``chains``: the
    drafts verified per row (default each request's ``seq.drafts``; a draft tree's row verifies none here: tree.py)."""
    n, rows, k = len(sampling), logits.shape[0], logits.shape[1] - 1
    reqs = [it.seq.req for it in sampling]
    table = np.zeros((3, rows), dtype=np.int64)      # counts, seeds, offsets, drafts: one copy to the device
    drafts = np.full((rows, k), pad, dtype=np.int64)
    chain = [it.seq.drafts for it in sampling] if chains is None else chains
    table[0, :n] = [len(d) for d in chain]                 # columns from lists: a row loop cost ~1 ms at 256 rows
    table[1, :n] = [it.seq.req.seed for it in sampling]
    table[2, :n] = [len(it.seq.tokens) for it in sampling]
    for i, d in enumerate(chain):
        if d:
            drafts[i, :len(d)] = d
    counts, seeds, offsets, drafts = pack_aligned([*table, drafts.ravel()], np.int64, logits.device)
    drafts = drafts.view(rows, k)
    settings = [r.logits if r.logits is not None and r.logits.active else None for r in reqs]
    if any(settings):        # penalties etc. on the target's law; position i counts the block's drafts < i
        logits = transform_logits(logits, drafts, TransformBatch.from_settings(
            settings + [None] * (rows - n), [r.tokens for r in reqs] + [[]] * (rows - n), logits.shape[-1],
            logits.device))
    if draft_logits is not None and draft_logits.shape[0] < rows:      # absent rows draft nothing: any law
        draft_logits = torch.cat([draft_logits, draft_logits[:1].expand(rows - n, -1, -1)])
    result = verify(logits, drafts, draft_logits=draft_logits, num_draft_tokens=counts, method=method,
                    sampling=sampling_params(reqs + reqs[:1] * (rows - n)), seed=seeds, offsets=offsets,
                    check_values=False)
    return result, logits


def sampling_params(reqs: list) -> SamplingParams:
    """The requests' sampling: scalars when they all agree (verify's cheaper path), else one value per request."""
    values = [(r.temperature, r.top_k, r.top_p, r.min_p) for r in reqs]
    if all(v == values[0] for v in values):
        return SamplingParams(*values[0])
    return SamplingParams(*[list(col) for col in zip(*values)])


def emitted_logprobs(logits: torch.Tensor, reqs: list, result, emitted: list) -> list:
    """Per request (None unless it asked): each emitted token's raw log-probability (the target's log-softmax at the
    position it was drawn at: accepted drafts and the resampled or bonus token alike) and the top ``logprobs``
    alternatives there, from the logits the step already verified ([rows, 1 + K, V]); ``emitted``: tokens per request
    (host)."""
    want = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    out = [None] * len(reqs)
    if not want:
        return out
    rows = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits[rows].float(), dim=-1)                        # [w, 1 + K, V]
    tokens = result.output_tokens[rows].clamp(min=0)
    chosen = lp.gather(-1, tokens[..., None]).squeeze(-1).cpu().tolist()
    top = max(reqs[i].logprobs for i in want)
    if top > 0:
        values, ids = lp.topk(top, dim=-1)
        values, ids = values.cpu().tolist(), ids.cpu().tolist()
    for w, i in enumerate(want):
        k = reqs[i].logprobs
        out[i] = [(chosen[w][j], list(zip(ids[w][j][:k], values[w][j][:k])) if k else [])
                  for j in range(emitted[i])]
    return out


def score_prompts(items: list, fed: list, logits: torch.Tensor) -> None:
    """Append to each scoring request's ``prompt_lps`` its scored positions' raw log-probability of the next prompt
    token and its top alternatives (``prompt_logprobs`` of them), from ``logits`` [scored rows, V] (layout.py's
    order: request by request)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    rows = [(it.seq, f) for it, f in zip(items, fed) if f.scored]
    nexts = [t for seq, f in rows for t in seq.req.prompt[f.start + f.score_from + 1:][:f.scored]]
    chosen = lp.gather(-1, torch.tensor(nexts, device=lp.device)[:, None]).squeeze(-1).tolist()
    top = max(seq.req.prompt_logprobs for seq, _ in rows)
    values, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    values, ids, at = values.tolist(), ids.tolist(), 0
    for seq, f in rows:
        k = seq.req.prompt_logprobs
        seq.prompt_lps += [(chosen[j], list(zip(ids[j][:k], values[j][:k]))) for j in range(at, at + f.scored)]
        at += f.scored
