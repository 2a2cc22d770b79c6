"""CPU tests (TRITON_INTERPRET=1) of ``fused``'s per-request layout: pass 1's last program per request runs the
acceptance test (``stats._accept_tail``) and ``sample.sample_row_kernel`` (``launch.PASS2 = "tile"``; the default
"wide" pass 2 has tests/test_kernels_wide.py) only sums tiles of row n and draws.

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
    monkeypatch.setattr(launch, "PASS2", "tile")      # sample_row_kernel (tests/test_kernels_wide.py: the default)


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


@pytest.mark.parametrize("draft", ["logits", "probs"])
def test_pass2_tile_masses_same_bits_for_every_tiles_per_program(draft, monkeypatch):
    # issue 15: sample_row_kernel with several tiles per program loads the next tile before the current one's
    # arithmetic (PREFETCH2); every tile's masses (hence the tokens) must be the same bits for any tiles-per-program
    # value, prefetch or not, and for the batch-size-dependent auto choice
    batch, k, vocab = 8, 2, 150
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    dlog = 0.5 * target[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    tokens = torch.distributions.Categorical(logits=dlog).sample()
    kwargs = {"draft_logits": dlog} if draft == "logits" else {"draft_probs": torch.softmax(dlog, -1)}
    kind = launch.DRAFT_LOGITS if draft == "logits" else launch.DRAFT_PROBS
    sampling = SamplingParams(temperature=[0.8, 1.0, 1.3, 1.0] * 2)
    n_tiles = -(-vocab // launch.BLOCK2)

    def masses(tiles, prefetch, auto_min=16):
        monkeypatch.setattr(launch, "SAMPLE_TILES", tiles)
        monkeypatch.setattr(launch, "PREFETCH2", prefetch)
        monkeypatch.setattr(launch, "TILES_AUTO_MIN_BATCH", auto_min)
        got = _run(target, tokens, sampling=sampling, seed=3, offsets=torch.arange(batch), **kwargs)
        plan = launch._plan(target.device, batch, k, vocab, launch.MODE_LOGITS, kind, False, True)
        return got, plan.tiles, plan.const2["PREFETCH"], plan.tsum[:, :n_tiles].clone()

    base, one, pre, tsum = masses(1, True)
    assert (one, pre) == (1, False)
    for tiles, prefetch, auto_min, want in ((3, True, 16, 3), (3, False, 16, 3), (4, True, 16, 4),
                                            (0, True, 1, launch.TILES_AUTO), (0, True, 16, 1)):
        got, used, pre, again = masses(tiles, prefetch, auto_min)
        assert used == want and pre == (prefetch and want > 1)
        assert torch.equal(tsum.view(torch.int32), again.view(torch.int32)), (tiles, prefetch)
        assert torch.equal(base.output_tokens, got.output_tokens)
