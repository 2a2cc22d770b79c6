"""The ``coupled`` verification method: with deterministic drafts its tokens are target-only decoding's (reference
with K = 0, the same keyed draws) whatever is drafted, so a server can switch speculation per request and per load
without changing a seeded request's tokens. Its law is checked by the exactness suite (tilespec.exactness,
``run_suite(["coupled"])``: every case passes at 1e5 samples); here the token identity and the fallbacks."""
from __future__ import annotations

import torch

import tilespec
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.verify.types import SamplingParams

from engine_models import tiny_lm


def target_only_case(b: int, k: int, v: int) -> tuple:
    """(logits [B, K+1, V], seeds, offsets, sampling, alone [B, K+1]: every position's target-only token drawn by
    ``reference`` with K = 0, drafts [B, K]: 60 % of them those tokens) over mixed temperatures and filters."""
    torch.manual_seed(0)
    logits = torch.randn(b, k + 1, v) * 2
    seeds, offsets = torch.arange(b) * 7 + 1, torch.arange(b) % 5 + 3
    sampling = SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5] * (b // 4), top_p=0.9, top_k=[0, 5] * (b // 2))
    alone = torch.stack([tilespec.verify(logits[:, j:j + 1], torch.zeros(b, 0, dtype=torch.long), sampling=sampling,
                                         seed=seeds, offsets=offsets + j, method="reference").output_tokens[:, 0]
                         for j in range(k + 1)], dim=1)
    drafts = torch.where(torch.rand(b, k) < 0.6, alone[:, :k], torch.randint(0, v, (b, k)))
    return logits, seeds, offsets, sampling, alone, drafts


def test_tokens_are_the_target_only_draws_whatever_is_drafted():
    b, k, v = 64, 4, 16
    logits, seeds, offsets, sampling, alone, drafts = target_only_case(b, k, v)
    counts = torch.arange(b) % (k + 1)
    res = tilespec.verify(logits, drafts, num_draft_tokens=counts, sampling=sampling, method="coupled", seed=seeds,
                          offsets=offsets)
    match = ((drafts == alone[:, :k]) & (torch.arange(k)[None] < counts[:, None])).long().cumprod(dim=1).sum(dim=1)
    assert torch.equal(res.num_accepted, match) and res.method == "coupled"
    for i in range(b):
        n = int(res.num_emitted[i])
        assert res.output_tokens[i, :n].tolist() == alone[i, :n].tolist()


def test_with_draft_logits_or_lenience_it_is_reference():
    torch.manual_seed(1)
    logits, draft_logits = torch.randn(8, 4, 12), torch.randn(8, 3, 12)
    drafts = torch.randint(0, 12, (8, 3))
    for kw in ({"draft_logits": draft_logits}, {"sampling": SamplingParams(lenience=0.5)}):
        a = tilespec.verify(logits, drafts, method="coupled", seed=3, **kw)
        r = tilespec.verify(logits, drafts, method="reference", seed=3, **kw)
        assert torch.equal(a.output_tokens, r.output_tokens)


def test_served_ngram_speculation_gives_target_only_tokens_under_any_load_switch():
    torch.set_num_threads(1)
    target = tiny_lm(0, logit_scale=20.0)       # peaked laws: sampled outputs repeat, so n-gram drafts get accepted
    target.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [3, 4]]

    def run(draft, spec_max_batch=None):
        engine = BatchEngine(target, draft, max_batch=4, gamma=3, max_len=48, method="coupled",
                             spec_max_batch=spec_max_batch)
        reqs = [BatchRequest(prompt=p, max_tokens=24 - 8 * i, temperature=1.0, seed=11 + i)
                for i, p in enumerate(prompts)]       # requests end at different steps: the load switch flips
        for r in reqs:
            engine.submit(r)
        while engine.has_work:
            engine.step()
        return [r.tokens for r in reqs], engine.counters["accepted"], engine.counters["drafted"]

    plain, _, _ = run(None)
    spec, accepted, drafted = run("ngram")
    switched, _, switched_drafted = run("ngram", spec_max_batch=2)     # drafts only once <= 2 requests decode
    assert spec == plain == switched
    assert accepted > 0 and 0 < switched_drafted < drafted
