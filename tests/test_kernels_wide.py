"""CPU tests (TRITON_INTERPRET=1) of ``fused``'s pass 2 in the per-request layout, ``residual.sample_wide_kernel``:
several tiles per program in one block, linear residual weights max(0, p - l q).

* Tokens: the reference's on well-separated cases (every draft kind, ragged K_b, greedy / lenience / top-k mixed
  in one batch) and >= 99 % of rows on ordinary random cases (the weights are the log-space ones up to fp32
  rounding, so only draws within rounding of a cumulative boundary may move).
* A residual that lives in one id is drawn every time (exact zero elsewhere), also when that id is in the last,
  ragged tile; a residual that is zero everywhere (p == q) falls back to p.
* The tile masses do not depend on the tiles per program (interpreter sums: the same bits; GPU: fp32 order) and
  the counters reset (a second call gives the same tokens).
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

launch = pytest.importorskip("tilespec.verify.kernels.launch")


@pytest.fixture(autouse=True)
def wide_layout(monkeypatch):
    monkeypatch.setattr(launch, "ROW_ELEMS", 1)       # the GPU layout: one request per program
    monkeypatch.setattr(launch, "CHUNK1", 64)
    monkeypatch.setattr(launch, "SUB1_STREAM", 16)
    monkeypatch.setattr(launch, "BLOCK2", 16)
    monkeypatch.setattr(launch, "WIDE_TILES", 4)
    monkeypatch.setattr(launch, "_PLANS", {})


def _case(seed, batch=16, k=3, vocab=150, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * scale
    dlog = 0.6 * target[:, :k] + 0.4 * torch.randn(batch, k, vocab, generator=gen) * scale
    tokens = torch.distributions.Categorical(logits=dlog).sample()
    return target, dlog, tokens


def _kwargs(draft, dlog):
    return {"logits": {"draft_logits": dlog}, "probs": {"draft_probs": torch.softmax(dlog, -1)}, "none": {}}[draft]


# draft probs by default (draft logits and none in this layout by default: tests/test_kernels_pass1_loop.py), the
# rest of the grid of draft kind x top-k off / on: -m slow
@pytest.mark.parametrize("top_k, draft", [(0, "probs"), *(pytest.param(k, d, marks=pytest.mark.slow) for k, d in
                                                          ((20, "logits"), (20, "none"), (0, "logits"), (20, "probs"),
                                                           (0, "none")))],
                         ids=["0-probs", "20-logits", "20-none", "0-logits", "20-probs", "0-none"])
def test_tokens_match_reference(draft, top_k):
    target, dlog, tokens = _case(1 + top_k, batch=8, scale=6.0)     # well separated: rounding cannot move a draw
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.3] * 2, lenience=[1.0, 1.0, 0.5, 1.0] * 2, top_k=top_k)
    args = dict(num_draft_tokens=torch.tensor([3, 0, 1, 2] * 2), sampling=sampling, seed=5,
                offsets=torch.arange(8), **_kwargs(draft, dlog))
    got = verify(target, tokens, method="fused", **args)
    ref = verify(target, tokens, method="reference", **args)
    for name in ("output_tokens", "num_accepted", "accepted", "num_emitted"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    again = verify(target, tokens, method="fused", **args)        # counters were reset by the last program
    assert torch.equal(again.output_tokens, got.output_tokens)


@pytest.mark.slow   # statistical (>= 99 % of 128 random rows); the well-separated cases above run by default
def test_ordinary_cases_agree_with_reference():
    rows = same_ref = 0
    for seed in range(4):
        target, dlog, tokens = _case(20 + seed, batch=32, vocab=203)
        args = dict(draft_logits=dlog, sampling=SamplingParams(temperature=1.0), seed=seed,
                    offsets=torch.arange(32))
        got = verify(target, tokens, method="fused", **args).output_tokens
        ref = verify(target, tokens, method="reference", **args).output_tokens
        rows += got.shape[0]
        same_ref += int((got == ref).all(1).sum())
    assert same_ref >= 0.99 * rows


@pytest.mark.parametrize("vocab", [150, 160])      # the residual's id in a ragged / full last tile
def test_residual_in_one_id_is_always_drawn(vocab):
    batch = 6             # q(0) ~ 1 >> p(0): nearly every request rejects its draft
    z = torch.randn(batch, 2, vocab)
    target, draft = z.clone(), z[:, :1].clone()
    target[:, :, -1] = 9.0
    draft[:, 0, 0] = 9.0
    tokens = torch.zeros(batch, 1, dtype=torch.long)
    got = verify(target, tokens, draft_logits=draft, seed=torch.arange(batch), method="fused")
    rejected = got.num_accepted == 0
    assert bool(rejected.any())
    assert bool((got.output_tokens[rejected, 0] == vocab - 1).all())


def test_zero_residual_falls_back_to_p():
    # q == p: a rejection has probability 0 in exact arithmetic, but lenience 0.5 makes acceptance certain; with
    # l = 1 and identical rows the residual is exactly 0 everywhere, and a forced rejection must still emit a
    # token of p (here: every id but the drafted one has weight, so any id < V is valid; the reference agrees)
    batch, vocab = 4, 150
    target = torch.randn(batch, 2, vocab) * 3
    draft = target[:, :1].clone()
    tokens = torch.zeros(batch, 1, dtype=torch.long)
    args = dict(draft_logits=draft, seed=torch.arange(batch))
    got = verify(target, tokens, method="fused", **args)
    ref = verify(target, tokens, method="reference", **args)
    assert torch.equal(got.output_tokens, ref.output_tokens)
    assert bool((got.output_tokens[:, :2] >= 0).all())


def test_tile_masses_do_not_depend_on_tiles_per_program(monkeypatch):
    target, dlog, tokens = _case(3, batch=4, k=2, vocab=150)
    sampling = SamplingParams(temperature=[0.8, 1.0, 1.3, 1.0])
    n_tiles = -(-150 // launch.BLOCK2)
    runs = []
    for tiles in (1, 4, 16):
        monkeypatch.setattr(launch, "WIDE_TILES", tiles)
        got = verify(target, tokens, draft_logits=dlog, sampling=sampling, seed=3, offsets=torch.arange(4),
                     method="fused")
        plan = launch._plan(target.device, 4, 2, 150, launch.MODE_LOGITS, launch.DRAFT_LOGITS, False, True)
        assert plan.split and plan.tiles == min(tiles, 16) and plan.nc2 == -(-n_tiles // plan.tiles)
        runs.append((got.output_tokens, plan.tsum.clone()))
    for tokens_, masses in runs[1:]:
        assert torch.equal(tokens_, runs[0][0])
        assert torch.allclose(masses, runs[0][1], rtol=1e-6, atol=1e-12)
