"""verify/logit_transforms.py: penalties, logit_bias and min_tokens on the target's logits of a speculative block.

1. The formula, position by position, against a plain-Python reference (drafts of the block count as generated).
2. Exactness: a speculative loop over a toy target / draft (tables indexed by the last two tokens, vocab 4), with
   the transforms applied before ``verify()``, produces the sequence law of target-only sampling under the same
   transforms (computed independently, by enumeration), for ``reference`` with sampled drafts and ``coupled`` with
   deterministic drafts. A planted bug (penalties that ignore the block's earlier drafts) must fail the same test.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import tilespec
from tilespec.exactness.stats import fit_test
from tilespec.verify.distributions import log_probs
from tilespec.verify.logit_transforms import LogitSettings, TransformBatch, transform_logits
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling


def naive(row: torch.Tensor, generated: list, s: LogitSettings) -> torch.Tensor:
    """One position's transformed logits [V], written out from the OpenAI / vLLM definitions."""
    out = row.double().clone()
    for t in set(generated):
        n = generated.count(t)
        out[t] -= s.frequency_penalty * n + s.presence_penalty
    for t, bias in s.logit_bias.items():
        out[t] += bias
    if len(generated) < s.min_tokens:
        for t in s.banned:
            out[t] = float("-inf")
    return out.float()


def test_each_position_counts_the_tokens_and_drafts_before_it():
    torch.manual_seed(0)
    b, k, v = 5, 4, 9
    settings = [LogitSettings(0.5, 0.3, {2: 1.0, 7: -3.0}, min_tokens=4, banned=(0, 5)),
                None,
                LogitSettings(frequency_penalty=-1.2),
                LogitSettings(presence_penalty=2.0, min_tokens=1, banned=(3,)),
                LogitSettings(logit_bias={1: 100.0})]
    tokens = [[1, 1, 4], [], [2, 2, 2, 6], [], [8]]
    drafts = torch.tensor([[1, 4, 1, 1], [0, 0, 0, 0], [2, 3, 2, 6], [3, 3, 8, 0], [8, 8, 1, 2]])
    logits = torch.randn(b, k + 1, v)
    out = transform_logits(logits, drafts, TransformBatch.from_settings(settings, tokens, v, "cpu"))
    for r in range(b):
        for i in range(k + 1):
            seen = tokens[r] + drafts[r, :i].tolist()
            expect = naive(logits[r, i], seen, settings[r] or LogitSettings())
            assert torch.allclose(out[r, i], expect, atol=1e-5), (r, i)
    plain = TransformBatch.from_settings([None] * b, tokens, v, "cpu")
    assert torch.equal(transform_logits(logits, drafts, plain), logits)     # no settings: the logits unchanged


def test_bad_settings_and_shapes_are_refused():
    with pytest.raises(ValueError, match="presence_penalty"):
        LogitSettings(presence_penalty=3.0).check(10)
    with pytest.raises(ValueError, match="logit_bias key 12"):
        LogitSettings(logit_bias={12: 1.0}).check(10)
    with pytest.raises(ValueError, match=r"logit_bias\[1\]"):
        LogitSettings(logit_bias={1: 101.0}).check(10)
    with pytest.raises(ValueError, match="min_tokens"):
        LogitSettings(min_tokens=-1).check(10)
    batch = TransformBatch.from_settings([None], [[]], 10, "cpu")
    with pytest.raises(ValueError, match=r"\[B, K\+1, V\]"):
        transform_logits(torch.zeros(1, 3, 10), torch.zeros(1, 1, dtype=torch.long), batch)


# ------------------------------------------------------------------------------------------------ exactness
V, LENGTH, K, N = 4, 4, 3, 24_000
PROMPT = [1, 2]
SETTINGS = LogitSettings(presence_penalty=0.8, frequency_penalty=0.9, logit_bias={1: 1.0, 3: -1.5},
                         min_tokens=2, banned=(0,))
SAMPLING = SamplingParams(temperature=0.9, top_k=3)


def tables(seed: int = 0):
    """Target and draft logit tables [V, V, V] (next-token logits given the last two tokens)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, V, generator=g) * 1.5
    return target, target + torch.randn(V, V, V, generator=g) * 0.7


def exact_law(target: torch.Tensor) -> np.ndarray:
    """Target-only sampling's law of the first LENGTH tokens under SETTINGS (the naive transform, then the verify
    contract's filtered law), over all V ** LENGTH sequences in lexicographic order."""
    resolved = resolve_sampling(SAMPLING, 1, "cpu")
    law = np.zeros([V] * LENGTH)
    for seq in itertools.product(range(V), repeat=LENGTH):
        ctx, p = list(PROMPT), 1.0
        for i, t in enumerate(seq):
            row = naive(target[ctx[-2], ctx[-1]], list(seq[:i]), SETTINGS)
            p *= float(torch.exp(log_probs(row[None, None], resolved))[0, 0, t])
            ctx.append(t)
        law[seq] = p
    return law.ravel()


def settings_rows(seq: torch.Tensor, length: torch.Tensor) -> TransformBatch:
    """SETTINGS for every row of ``seq`` [N, W] (generated tokens: columns len(PROMPT) .. length - 1)."""
    one = TransformBatch.from_settings([SETTINGS], [[]], V, "cpu")
    cols = torch.arange(seq.shape[1])[None]
    made = ((cols >= len(PROMPT)) & (cols < length[:, None])).float()
    counts = torch.zeros(seq.shape[0], V).scatter_add_(1, seq, made)
    rows = {f: getattr(one, f).expand(seq.shape[0], *getattr(one, f).shape[1:]) for f in vars(one)}
    return TransformBatch(**{**rows, "counts": counts, "generated": length - len(PROMPT)})


def speculative_law(target, draft, method: str, sampled: bool, planted_bug: bool = False):
    """N sequences by the speculative loop (K drafts per block, transforms before verify) -> (counts of each
    sequence, accepted drafts, drafted tokens)."""
    g = torch.Generator().manual_seed(7)
    width = len(PROMPT) + (K + 1) * LENGTH          # rows done go on stepping (and are cut to LENGTH)
    seq = torch.zeros(N, width, dtype=torch.long)
    seq[:, :len(PROMPT)] = torch.tensor(PROMPT)
    length = torch.full((N,), len(PROMPT))
    rows = torch.arange(N)
    seeds = torch.arange(N) * 3 + 11
    accepted = drafted = 0
    resolved = resolve_sampling(SAMPLING, N, "cpu")
    while int(length.min()) < len(PROMPT) + LENGTH:
        a, c = seq[rows, length - 2], seq[rows, length - 1]
        drafts, dlogits = [], []
        for _ in range(K):
            q = draft[a, c]           # sampled from the processed law verify() derives from these draft logits
            law = torch.exp(log_probs(q[:, None], resolved))[:, 0]
            d = torch.multinomial(law, 1, generator=g)[:, 0] if sampled else q.argmax(-1)
            drafts.append(d)
            dlogits.append(torch.log_softmax(q, -1))
            a, c = c, d
        d = torch.stack(drafts, 1)
        ctx = torch.cat([seq[rows, length - 2][:, None], seq[rows, length - 1][:, None], d], 1)
        logits = torch.stack([target[ctx[:, i], ctx[:, i + 1]] for i in range(K + 1)], 1)
        batch = settings_rows(seq, length)
        if planted_bug:      # every position penalised as if the block's drafts were not generated tokens
            logits = torch.cat([transform_logits(logits[:, i:i + 1], d[:, :0], batch) for i in range(K + 1)], 1)
        else:
            logits = transform_logits(logits, d, batch)
        res = tilespec.verify(logits, d, draft_logits=torch.stack(dlogits, 1) if sampled else None,
                              sampling=SAMPLING, method=method, seed=seeds, offsets=length)
        n = res.num_emitted
        accepted += int((n - 1).sum())
        drafted += N * K
        for j in range(K + 1):
            take = j < n
            seq[rows[take], length[take] + j] = res.output_tokens[take, j]
        length = length + n
    out = seq[:, len(PROMPT):len(PROMPT) + LENGTH].numpy()
    index = np.ravel_multi_index(out.T, [V] * LENGTH)
    return np.bincount(index, minlength=V ** LENGTH), accepted, drafted


@pytest.mark.parametrize("method,sampled", [("reference", True), ("coupled", False)])
def test_speculative_law_equals_target_only_law_under_the_transforms(method, sampled):
    target, draft = tables()
    law = exact_law(target)
    assert law.reshape([V] * LENGTH)[0].sum() == 0 and law.reshape([V] * LENGTH)[:, 0].sum() == 0   # min_tokens
    counts, accepted, drafted = speculative_law(target, draft, method, sampled)
    assert 0.2 * drafted < accepted < 0.9 * drafted          # blocks accept and reject: the drafts' counts matter
    result = fit_test(counts, law)
    assert result.impossible == 0 and result.p_value > 1e-6, result
    bug, _, _ = speculative_law(target, draft, method, sampled, planted_bug=True)
    assert fit_test(bug, law).p_value < 1e-6                  # the test sees penalties that ignore the drafts
