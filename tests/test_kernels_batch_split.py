"""CPU tests (TRITON_INTERPRET=1) of batches larger than one launch (``kernels/batch_split.py``).

On a GPU the kernels run over slices of at most MAX_GRID_ROWS = 65,535 requests (CUDA's limit on grid axes 1 and
2). Here MAX_GRID_ROWS is shrunk so a batch runs as several slices (the last one shorter), in both layouts (the
interpreter's batched one: 16 requests in slices of 7; the GPU's per-request one, one interpreted Python call per
program: 5 requests in slices of 2), and the outputs must equal the one-launch outputs bit for
bit: per-request seeds and offsets travel with their rows. The per-request layout also runs V = 3 (a row narrower
than a pass-1 lane group of 8 ids: it failed to compile on the GPU before the group width was capped).
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

launch = pytest.importorskip("tilespec.verify.kernels.launch")
from tilespec.verify.kernels import batch_split  # noqa: E402
from tiers import fast_first  # noqa: E402

SIZES = {"batched": (16, 7), "per-request": (5, 2)}   # (batch, MAX_GRID_ROWS): 3 slices, the last one shorter


@pytest.fixture(params=list(SIZES))
def layout(request, monkeypatch):
    monkeypatch.setattr(launch, "_PLANS", {})
    if request.param == "per-request":     # the GPU layout: one request per program
        monkeypatch.setattr(launch, "ROW_ELEMS", 1)
    return SIZES[request.param]


def _case(batch, vocab, k, draft, seed=0):
    """(target logits, draft tokens, keyword arguments) of a random case: ragged drafts (K_b in 0..k), per-request
    seeds and offsets, a draft given as probabilities or logits."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * 2
    dlog = 0.5 * target[:, :k] + torch.randn(batch, k, vocab, generator=gen)
    probs = torch.softmax(dlog, -1)
    tokens = torch.multinomial(probs.view(-1, vocab), 1, generator=gen).view(batch, k)
    kw = dict(num_draft_tokens=torch.randint(0, k + 1, (batch,), generator=gen),
              seed=torch.randint(0, 2**62, (batch,), generator=gen), offsets=torch.randint(0, 1000, (batch,),
                                                                                          generator=gen))
    kw["draft_probs" if draft == "probs" else "draft_logits"] = probs if draft == "probs" else dlog
    return target, tokens, kw


def _outputs(result):
    return result.output_tokens, result.num_accepted, result.num_emitted, result.accepted


def _sliced_and_whole(monkeypatch, step, method, target, tokens, kw):
    batch = target.shape[0]
    calls = []
    real = batch_split.slice_inputs
    monkeypatch.setattr(batch_split, "slice_inputs", lambda *a: calls.append(a[1:]) or real(*a))
    whole = verify(target, tokens, method=method, **kw)
    assert not calls
    monkeypatch.setattr(batch_split, "MAX_GRID_ROWS", step)
    sliced = verify(target, tokens, method=method, **kw)
    assert calls == [(b0, min(b0 + step, batch)) for b0 in range(0, batch, step)]
    return sliced, whole


@pytest.mark.parametrize("method,vocab,draft", fast_first([("fused", 10, "probs"), ("tiled", 3, "logits"),
                                                           ("sigmoid", 3, "probs"), ("tiled", 10, "probs"),
                                                           ("fused", 3, "logits")], 3))
def test_slices_give_the_one_launch_outputs(layout, monkeypatch, method, vocab, draft):
    target, tokens, kw = _case(layout[0], vocab, 2, draft)
    sliced, whole = _sliced_and_whole(monkeypatch, layout[1], method, target, tokens, kw)
    for a, b in zip(_outputs(sliced), _outputs(whole)):
        assert a.shape == b.shape and torch.equal(a, b)
    assert sliced.method == whole.method and sliced.exact == whole.exact
    if method != "sigmoid":   # well-separated random rows: the exact methods emit reference's tokens
        ref = verify(target, tokens, method="reference", **kw)
        assert torch.equal(sliced.output_tokens, ref.output_tokens)


def test_slices_with_filters_and_greedy_requests(monkeypatch):
    batch, step = SIZES["batched"]
    monkeypatch.setattr(launch, "_PLANS", {})
    target, tokens, kw = _case(batch, 10, 3, "logits", seed=1)
    temps = torch.where(torch.arange(batch) % 3 == 0, 0.0, 0.8)   # every third request greedy
    kw["sampling"] = SamplingParams(temperature=temps, top_k=torch.randint(0, 6, (batch,)), top_p=0.9)
    sliced, whole = _sliced_and_whole(monkeypatch, step, "fused", target, tokens, kw)
    for a, b in zip(_outputs(sliced), _outputs(whole)):
        assert torch.equal(a, b)


def test_too_many_draft_tokens_is_a_clear_error(monkeypatch):
    target, tokens, kw = _case(4, 10, 3, "probs")
    monkeypatch.setattr(batch_split, "MAX_DRAFT", 2)
    with pytest.raises(ValueError, match="at most 2 draft tokens"):
        verify(target, tokens, method="fused", **kw)
