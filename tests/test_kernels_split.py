"""CPU tests (TRITON_INTERPRET=1) of ``fused``'s per-request layout: pass 1's last program per request runs the
acceptance test (``stats._accept_tail``) and ``sample.sample_row_kernel`` only sums tiles of row n and draws.

It must emit exactly the tokens of the previous pass 2 (``accept_sample_kernel``, which recomputes the acceptance
in every program; ``launch.FUSED_SPLIT = False``) - same arithmetic, bit for bit - for any number of tiles per
program, and the reference's tokens where the draw is far from rounding boundaries (residual mass in the last
chunk / tile only, chunk-aligned and ragged vocabularies).
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

launch = pytest.importorskip("tilespec.verify.kernels.launch")


@pytest.fixture(autouse=True)
def per_request_layout(monkeypatch):
    monkeypatch.setattr(launch, "ROW_ELEMS", 1)       # the GPU layout: one request per program, several chunks
    monkeypatch.setattr(launch, "CHUNK1", 64)
    monkeypatch.setattr(launch, "SUB1", 32)
    monkeypatch.setattr(launch, "BLOCK2", 16)


def _run(target, tokens, **kwargs):
    return verify(target, tokens, method="fused", **kwargs)


@pytest.mark.parametrize("tiles", [1, 3])
@pytest.mark.parametrize("vocab", [128, 150])          # chunk-aligned / ragged last chunk and tile
@pytest.mark.parametrize("draft", ["logits", "probs", "none"])
def test_split_matches_previous_pass2_bit_for_bit(tiles, vocab, draft, monkeypatch):
    monkeypatch.setattr(launch, "SAMPLE_TILES", tiles)
    batch, k = 16, 3
    gen = torch.Generator().manual_seed(vocab + tiles)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    dlog = 0.6 * target[:, :k] + 0.4 * torch.randn(batch, k, vocab, generator=gen) * 2
    tokens = torch.distributions.Categorical(logits=dlog).sample()
    kwargs = {"logits": {"draft_logits": dlog}, "probs": {"draft_probs": torch.softmax(dlog, -1)},
              "none": {}}[draft]
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.3] * 4, lenience=[1.0, 1.0, 0.5, 1.0] * 4)
    args = dict(num_draft_tokens=torch.tensor([3, 0, 1, 2] * 4), sampling=sampling, seed=5,
                offsets=torch.arange(batch), **kwargs)
    split = _run(target, tokens, **args)
    monkeypatch.setattr(launch, "FUSED_SPLIT", False)
    previous = _run(target, tokens, **args)
    assert torch.equal(split.output_tokens, previous.output_tokens)
    assert torch.equal(split.accepted, previous.accepted)
    assert torch.equal(split.num_emitted, previous.num_emitted)
    ref = verify(target, tokens, method="reference", **args)
    assert (split.output_tokens == ref.output_tokens).all(dim=1).float().mean() >= 0.9


def test_residual_only_in_the_last_tile():
    # p and q share every logit except: q puts its mass on token 0 (the draft token, so it is rejected), p on the
    # last id. max(0, p - q) is then positive at the last id only (elsewhere p < q): it must be drawn every time.
    batch, vocab = 32, 150
    z = torch.randn(batch, 2, vocab)
    target, draft = z.clone(), z[:, :1].clone()
    target[:, :, -1] = 9.0
    draft[:, 0, 0] = 9.0
    tokens = torch.zeros(batch, 1, dtype=torch.long)
    got = _run(target, tokens, draft_logits=draft, seed=torch.arange(batch))
    ref = verify(target, tokens, draft_logits=draft, seed=torch.arange(batch), method="reference")
    rejected = got.num_accepted == 0
    assert bool(rejected.any())
    assert bool((got.output_tokens[rejected, 0] == vocab - 1).all())
    assert torch.equal(got.output_tokens, ref.output_tokens)


def test_greedy_outputs_come_from_pass_one_and_repeat():
    batch, k, vocab = 6, 4, 130
    target = torch.randn(batch, k + 1, vocab)
    tokens = target[:, :k].argmax(-1)
    tokens[::2, 2] = (tokens[::2, 2] + 1) % vocab          # even requests: rejected at position 2
    first = _run(target, tokens, sampling=SamplingParams(temperature=0.0), seed=1)
    again = _run(target, tokens, sampling=SamplingParams(temperature=0.0), seed=1)   # counters were reset
    ref = verify(target, tokens, sampling=SamplingParams(temperature=0.0), seed=1, method="reference")
    assert torch.equal(first.output_tokens, ref.output_tokens) and torch.equal(again.output_tokens, ref.output_tokens)
    assert first.num_accepted.tolist() == [2, 4, 2, 4, 2, 4]
