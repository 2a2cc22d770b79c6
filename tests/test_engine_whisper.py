"""The engine on an encoder-decoder model: tiny random Whisper, greedy speculative == greedy target-only."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.runner import shares_encoder
from tilespec.verify import SamplingParams

from engine_models import tiny_whisper, whisper_layer_skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def naive_greedy(model, features, prefix, n):
    """Greedy decoding by full forwards without a cache (the plainest possible reference)."""
    seq = list(prefix)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_features=features, decoder_input_ids=torch.tensor([seq])).logits
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(prefix):]


def test_whisper_greedy_matches_and_shares_encoder():
    target = tiny_whisper(0)
    draft = whisper_layer_skip(target, 1)
    assert shares_encoder(target, draft)
    torch.manual_seed(3)
    feats = torch.randn(3, 16, 32)
    prefixes = [[1, 5, 6], [1, 5, 6], [1, 5, 6]]
    expected = [naive_greedy(target, feats[i:i + 1], prefixes[i], 20) for i in range(3)]
    for gamma, schedule in [(3, "constant"), (5, "heuristic")]:
        dec = SpeculativeDecoder(target, draft, gamma=gamma, gamma_schedule=schedule,
                                 sampling=SamplingParams.greedy(), eos_token_id=[])
        out = dec.generate(prefixes, max_new_tokens=20, input_features=feats)
        assert out.sequences == expected
        assert out.stats.alpha > 0.0
    ar = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(), eos_token_id=[])
    assert ar.generate(prefixes[:1], max_new_tokens=20, input_features=feats[:1]).sequences == expected[:1]


def test_whisper_needs_features():
    target = tiny_whisper(0)
    dec = SpeculativeDecoder(target, whisper_layer_skip(target, 1))
    with pytest.raises(ValueError, match="input_features"):
        dec.generate([[1, 5]], max_new_tokens=3)
    with pytest.raises(ValueError, match="rows"):
        dec.generate([[1, 5]], max_new_tokens=3, input_features=torch.randn(2, 16, 32))
