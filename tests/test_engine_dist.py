"""Sequence-level exactness of the engine with sampling: emitted sequences vs the target's law by enumeration."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.exactness.stats import fit_test
from tilespec.verify import SamplingParams

from engine_models import exact_sequence_law, tiny_lm

VOCAB, LENGTH, N = 6, 3, 6000
PROMPT = [1, 4]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def exact_law(model, sampling: SamplingParams) -> np.ndarray:
    return exact_sequence_law(model, sampling, PROMPT, VOCAB, LENGTH)


@pytest.mark.parametrize("sampling,gamma,method", [
    (SamplingParams(temperature=1.0), 2, "reference"),
    (SamplingParams(temperature=0.8, top_k=4), 3, "reference"),
    (SamplingParams(temperature=1.0), 2, "hf"),
])
def test_sampled_sequences_follow_target_law(sampling, gamma, method):
    target = tiny_lm(10, vocab=VOCAB, logit_scale=20.0)
    draft = tiny_lm(11, vocab=VOCAB, layers=1, logit_scale=20.0)
    dec = SpeculativeDecoder(target, draft, gamma=gamma, method=method, sampling=sampling, eos_token_id=[])
    out = dec.generate([PROMPT] * N, max_new_tokens=LENGTH, seed=12345)
    assert 0.05 < out.stats.alpha < 0.95  # both acceptance and rejection paths are exercised
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    observed = np.bincount(index, minlength=VOCAB ** LENGTH)
    result = fit_test(observed, exact_law(target, sampling))
    assert result.impossible == 0
    assert result.p_value > 1e-6, result


def test_target_only_sampling_follows_law():
    target = tiny_lm(10, vocab=VOCAB, logit_scale=20.0)
    dec = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=1.0), eos_token_id=[])
    out = dec.generate([PROMPT] * 3000, max_new_tokens=LENGTH, seed=7)
    index = [int(np.ravel_multi_index(s, [VOCAB] * LENGTH)) for s in out.sequences]
    result = fit_test(np.bincount(index, minlength=VOCAB ** LENGTH), exact_law(target, SamplingParams()))
    assert result.p_value > 1e-6, result
