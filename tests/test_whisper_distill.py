"""A Distil-Whisper-style draft trained by the library (tilespec.training.whisper_draft) on a tiny random Whisper (CPU):
its measured acceptance on the target's own transcripts rises far above the untrained copy's, greedy decoding with
it equals target-only decoding, and the target is left untouched."""
from __future__ import annotations

import pytest
import torch

from tilespec.training.whisper_draft import distill, encoder_states, pseudo_labels, student, trainable
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.runner import shares_encoder
from tilespec.verify import SamplingParams

from engine_models import tiny_lm, tiny_whisper

pytestmark = pytest.mark.usefixtures("one_thread")


def alpha(target, draft, feats, prefix, n):
    dec = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams.greedy(), eos_token_id=[])
    out = dec.generate([list(prefix)] * feats.shape[0], max_new_tokens=n, input_features=feats)
    return out.stats.accepted / out.stats.tested, out.sequences


def distinct_target():
    """A tiny random Whisper whose later decoder layers change its greedy tokens (the plain one repeats its start
    token whatever the audio, which any draft predicts): decoder layers scaled up, the LM head scaled down."""
    target = tiny_whisper(0, decoder_layers=4)
    with torch.no_grad():
        target.proj_out.weight.mul_(0.2)
        for p in target.model.decoder.layers.parameters():
            p.mul_(3.0)
    return target


def test_distilled_draft_learns_the_targets_transcripts():
    target = distinct_target()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(12, target.config.num_mel_bins, 2 * target.config.max_source_positions, generator=g)
    prefix, n = [1], 12
    draft = student(target, (0, 3))
    assert shares_encoder(target, draft) and draft.config.decoder_layers == 2
    before = {k: v.clone() for k, v in target.state_dict().items()}
    grads = [p.requires_grad for p in target.parameters()]
    seqs = pseudo_labels(target, feats, prefix, n)
    states = encoder_states(target, feats)
    a0, _ = alpha(target, draft, feats, prefix, n)
    losses = distill(target, draft, states, seqs, prefix_len=len(prefix), steps=100, lr=3e-3, batch_size=6)
    a1, sequences = alpha(target, draft, feats, prefix, n)
    reference = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(), eos_token_id=[]).generate(
        [list(prefix)] * feats.shape[0], max_new_tokens=n, input_features=feats).sequences
    assert sequences == reference
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert a1 > 0.8 and a1 > a0 + 0.3, (a0, a1)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())   # the target is untouched
    assert all(not p.requires_grad for p in trainable(draft))
    assert grads == [p.requires_grad for p in target.parameters()]


def test_student_rejects_bad_targets_and_layers():
    with pytest.raises(ValueError, match="WhisperForConditionalGeneration"):
        student(tiny_lm(0))
    with pytest.raises(ValueError, match="layers must be indices"):
        student(tiny_whisper(0, decoder_layers=2), (0, 2))
