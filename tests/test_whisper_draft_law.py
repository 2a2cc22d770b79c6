"""A distilled Whisper draft in the engine (CPU, tiny random Whisper): sampled sequences follow the target's law
(T = 1, enumeration over a 6-token vocabulary), and with the default ``optimal`` schedule a draft that never agrees
costs at most 3 % over target-only decoding, counted in forwards; ``transcribe`` without a draft is target-only."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import tilespec
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.payoff import DEFAULT_SLOPE
from tilespec.exactness.stats import fit_test
from tilespec.models.distilled import student
from tilespec.verify import SamplingParams

from engine_models import stub_whisper_io, tiny_whisper

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, LENGTH, N, PREFIX = 6, 3, 3000, [1]


def whisper_law(model, feats: torch.Tensor, sampling) -> np.ndarray:
    """P(x_1..x_LENGTH | PREFIX, audio) of ``model`` for every sequence over VOCAB tokens, by full forwards."""
    from tilespec.verify.distributions import log_probs
    from tilespec.verify.validation import resolve_sampling
    resolved = resolve_sampling(sampling, 1, "cpu")
    probs = np.ones([VOCAB] * LENGTH)
    with torch.no_grad():
        for depth in range(LENGTH):
            for prefix in itertools.product(range(VOCAB), repeat=depth):
                ids = torch.tensor([PREFIX + list(prefix)])
                logits = model(input_features=feats, decoder_input_ids=ids).logits[:, -1:].float()
                p = torch.exp(log_probs(logits, resolved))[0, 0].double().numpy()
                probs[prefix] *= p.reshape([VOCAB] + [1] * (LENGTH - depth - 1))
    return probs.ravel()


@pytest.mark.parametrize("compile", [False, pytest.param("native", marks=pytest.mark.slow)])   # native: ~14 s
def test_distilled_draft_sampling_follows_the_target_law(compile):
    target = tiny_whisper(3, decoder_layers=3, vocab=VOCAB)
    with torch.no_grad():
        target.proj_out.weight.mul_(0.15)          # a law spread over several tokens (×20 in tiny_whisper)
    draft = student(target, (0,))
    torch.manual_seed(4)
    with torch.no_grad():                         # a draft that is close but not equal: accepts and rejects
        for p in draft.model.decoder.layers.parameters():
            p.add_(0.3 * torch.randn_like(p))
    feats = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(9))
    sampling = SamplingParams(temperature=1.0)
    dec = SpeculativeDecoder(target, draft, gamma=2, sampling=sampling, eos_token_id=[], compile=compile)
    out = dec.generate([PREFIX] * N, max_new_tokens=LENGTH, seed=2024, input_features=feats.expand(N, -1, -1))
    s = out.stats
    assert 100 < s.accepted < s.drafted - 100
    index = [int(np.ravel_multi_index(q, [VOCAB] * LENGTH)) for q in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), whisper_law(target, feats, sampling))
    assert result.impossible == 0
    assert result.p_value > 1e-6, result


def count_forwards(model) -> list:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_a_distilled_draft_that_never_agrees_costs_under_three_percent(monkeypatch):
    """The draft's final norm is zeroed: its logits are all 0 and its greedy token is 0, whose target logit is 0
    (row 0 of the tied LM head zeroed) while the target's greedy choice has a large positive logit: α = 0."""
    target = tiny_whisper(0, decoder_layers=4)
    draft = student(target, (0,))
    with torch.no_grad():
        target.proj_out.weight[0].zero_()
        draft.model.decoder.layer_norm.weight.zero_()
        draft.model.decoder.layer_norm.bias.zero_()
    feats = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    n, greedy = 120, SamplingParams.greedy()
    reference = SpeculativeDecoder(target, None, sampling=greedy, eos_token_id=[]).generate(
        [PREFIX], max_new_tokens=n, input_features=feats)
    dec = SpeculativeDecoder(target, draft, gamma=5, gamma_schedule="optimal", sampling=greedy, eos_token_id=[])
    drafts = count_forwards(draft)
    try:
        first = dec.generate([PREFIX], max_new_tokens=n, input_features=feats)
        after_first = drafts[0]
        second = dec.generate([PREFIX], max_new_tokens=n, input_features=feats)
    finally:
        draft._forward_hooks.clear()
    for out in (first, second):
        assert out.sequences == reference.sequences and out.stats.accepted == 0
    cost = first.stats.target_calls + 0.25 * after_first + DEFAULT_SLOPE * sum(first.stats.gammas)
    assert cost <= 1.03 * reference.stats.target_calls, (cost, reference.stats.target_calls, first.stats.gammas[:8])
    assert first.stats.fallback_at_step is not None and first.stats.fallback_at_step <= 4
    assert second.stats.fallback_at_step == 0 and drafts[0] == after_first   # no draft forward at all

    proc = stub_whisper_io(monkeypatch, target)        # transcribe's defaults: no draft, target-only decoding
    out = tilespec.transcribe([np.zeros(10, dtype=np.float32)], target=target, processor=proc, max_new_tokens=8)
    assert out.stats.drafted == 0 and out.stats.method == "target-only"
