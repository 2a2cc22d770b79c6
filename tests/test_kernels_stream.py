"""CPU tests (TRITON_INTERPRET=1) of the streaming pass 1 of ``fused`` (``stream.row_stats_stream_kernel``, the
per-request layout) against PyTorch and ``reference``.

* Per-chunk statistics against PyTorch on the kernel's own inputs: m = the chunk max and a = its first argmax
  exactly, s = sum exp(z - m) to fp32 rounding; fully masked chunks (top-k) give m = -inf, s = 0.
* The same bits for every CPP value and whatever the batch (batch invariance).
* Tokens: identical to ``reference`` on well-separated cases; greedy ties across lanes, slices and chunks pick the
  first id.
* ``launch._aligned``: the ALIGNED (16-byte load) variant is chosen only for aligned rows, and gives the same
  outputs as the unaligned one.
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams
from tiers import fast_first

launch = pytest.importorskip("tilespec.verify.kernels.launch")

CHUNK, SUB, BATCH, K = 64, 16, 4, 3
VOCAB = 3 * CHUNK + 24                   # NC = 4 chunks, the last one ragged (and V % 8 == 0)


@pytest.fixture(autouse=True)
def stream_layout(monkeypatch):
    monkeypatch.setattr(launch, "ROW_ELEMS", 1)
    monkeypatch.setattr(launch, "CHUNK1", CHUNK)
    monkeypatch.setattr(launch, "SUB1_STREAM", SUB)   # 4 slices per chunk
    monkeypatch.setattr(launch, "BLOCK2", 32)
    monkeypatch.setattr(launch, "_PLANS", {})


def _case(seed=0, scale=2.0, batch=BATCH, vocab=VOCAB):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, K + 1, vocab, generator=gen) * scale
    dlog = 0.6 * target[:, :K] + 0.4 * torch.randn(batch, K, vocab, generator=gen) * scale
    tokens = torch.multinomial(torch.softmax(dlog, -1).view(-1, vocab), 1, generator=gen).view(batch, K)
    return target, dlog, tokens


def _stats(target, dlog, tokens, sampling, **kw):
    """(result, m, s, a) of one fused call; m / s / a: the plan's pass-1 scratch [B, 2K + 1, NC] (a copy)."""
    batch, vocab = target.shape[0], target.shape[-1]
    has_thr = sampling.top_k != 0 or sampling.top_p != 1.0
    plan = launch._plan(target.device, batch, K, vocab, launch.MODE_LOGITS, launch.DRAFT_LOGITS, has_thr, True)
    for t in (plan.m, plan.s):
        t.fill_(7.0)
    plan.a.fill_(-7)
    got = verify(target, tokens, draft_logits=dlog, method="fused", sampling=sampling, seed=3,
                 offsets=torch.arange(batch), **kw)
    assert plan.kernel1 == "stream"
    return got, plan.m.clone(), plan.s.clone(), plan.a.clone()


def _torch_chunk_stats(z: torch.Tensor):
    """Per-chunk (max, sum exp(z - max), first argmax) of rows z [..., V] (fp32, -inf = masked)."""
    nc = -(-z.shape[-1] // CHUNK)
    zp = torch.nn.functional.pad(z, (0, nc * CHUNK - z.shape[-1]), value=float("-inf"))
    zc = zp.view(*z.shape[:-1], nc, CHUNK)
    m = zc.amax(-1)
    safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.exp(zc - safe[..., None]).sum(-1)
    a = torch.argmax(zc, dim=-1) + torch.arange(nc) * CHUNK   # torch.argmax: the first maximal index
    return m, s, a


@pytest.mark.parametrize("top_k", fast_first([5, 0], 1))
def test_chunk_statistics_match_torch(top_k):
    target, dlog, tokens = _case()
    temp = [0.0, 0.7, 1.0, 1.3]
    sampling = SamplingParams(temperature=temp, top_k=top_k)
    _, m, s, a = _stats(target, dlog, tokens, sampling)
    scale = torch.tensor([t if t > 0 else 1.0 for t in temp])
    for rows, first in ((target, 0), (dlog, K + 1)):
        z = rows.float() / scale[:, None, None]
        if top_k:   # the top-k set: z >= the k-th largest z of the row (ties kept, as the kernels)
            z = torch.where(z >= z.topk(top_k, -1).values[..., -1:], z, float("-inf"))
        tm, ts, ta = _torch_chunk_stats(z)
        for b in range(BATCH):
            used = range(rows.shape[1]) if first == 0 else (range(K) if temp[b] > 0 else [])
            for r in used:
                got_m, got_s = m[b, first + r], s[b, first + r]
                assert torch.equal(got_m, tm[b, r]), (b, r)
                assert torch.allclose(got_s, ts[b, r], rtol=2e-6, atol=0), (b, r)
                if first == 0 and temp[b] == 0:
                    assert torch.equal(a[b, r].long(), ta[b, r]), (b, r)
    if top_k:   # top-5 of 216 ids leaves most chunks empty: m = -inf, s = 0 there
        assert bool(torch.isneginf(m[:, :K + 1]).any()) and bool((s[torch.isneginf(m)] == 0).all())


def test_same_bits_for_every_cpp_and_batch(monkeypatch):
    target, dlog, tokens = _case(seed=1)
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.2], lenience=[1.0, 1.0, 0.5, 1.0])
    runs = []
    for cpp in (1, 3):   # NC = 4: programs of 3 + 1 chunks (tests/test_kernels_pass1_loop.py: more values)
        monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", cpp)
        runs.append(_stats(target, dlog, tokens, sampling))
    for run in runs[1:]:
        for x, y in zip(runs[0][1:], run[1:]):
            assert torch.equal(x, y)
        assert torch.equal(run[0].output_tokens, runs[0][0].output_tokens)
    monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", 1)
    alone = _stats(target[2:3], dlog[2:3], tokens[2:3], SamplingParams(temperature=1.0, lenience=0.5))
    used = [r for r in range(2 * K + 1)]
    for x, y in zip(runs[0][1:], alone[1:]):
        assert torch.equal(x[2, used], y[0, used])


def test_tokens_match_reference():
    # well separated: large logit scale, so fp32 rounding of the sums cannot move a draw
    for seed in range(2):
        target, dlog, tokens = _case(seed=10 + seed, scale=6.0)
        sampling = SamplingParams(temperature=[0.0, 0.6, 1.0, 1.0], lenience=[1.0, 1.0, 1.0, 0.7])
        kw = dict(draft_logits=dlog, sampling=sampling, seed=3, offsets=torch.arange(BATCH))
        ref = verify(target, tokens, method="reference", **kw)
        got = verify(target, tokens, method="fused", **kw)
        for name in ("output_tokens", "num_accepted", "accepted"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (seed, name)


def test_greedy_ties_pick_the_first_id():
    target, dlog, tokens = _case(seed=4)
    target = target.clone()
    top = target.amax() + 1.0
    # request b: its maxima at ids (lane 3 of slice 2 of chunk 1) and later ones in other lanes / slices / chunks
    spots = [[CHUNK + 2 * SUB + 3, CHUNK + 2 * SUB + 1 + SUB, 3 * CHUNK + 5], [5, 4 + SUB, CHUNK],
             [2 * CHUNK + SUB - 1, 2 * CHUNK + SUB, VOCAB - 1], [VOCAB - 1]]
    for b, ids in enumerate(spots):
        target[b, :, ids] = top
    got = verify(target, tokens, draft_logits=dlog, method="fused", sampling=SamplingParams(temperature=0.0),
                 seed=1)
    ref = verify(target, tokens, draft_logits=dlog, method="reference", sampling=SamplingParams(temperature=0.0),
                 seed=1)
    assert torch.equal(got.output_tokens, ref.output_tokens)
    n = got.num_accepted
    for b, ids in enumerate(spots):
        assert int(got.output_tokens[b, n[b]]) == min(ids)


def test_aligned_variant_choice_and_same_outputs(monkeypatch):
    target, dlog, tokens = _case(seed=5)
    strides = (target.stride(0), target.stride(1), dlog.stride(0), dlog.stride(1))
    assert launch._aligned(target, dlog, strides, VOCAB)
    assert not launch._aligned(target, dlog, strides, VOCAB - 1)
    shifted = torch.cat([torch.zeros(BATCH, K + 1, 1), target], -1)[..., 1:]       # rows start 4 bytes late
    assert not launch._aligned(shifted, dlog, (shifted.stride(0), shifted.stride(1)) + strides[2:], VOCAB)
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.2])
    aligned = _stats(target, dlog, tokens, sampling)
    unaligned = _stats(shifted, dlog, tokens, sampling)    # the same values, the ALIGNED=False variant
    for x, y in zip(aligned[1:], unaligned[1:]):
        assert torch.equal(x, y)
    assert torch.equal(aligned[0].output_tokens, unaligned[0].output_tokens)


def test_negative_float_max_logits_and_bf16():
    # -FLT_MAX is the lanes' initial running max: a chunk whose values are all -FLT_MAX must still count them
    target, dlog, tokens = _case(seed=6)
    target = target.clone()
    target[:, :, :CHUNK] = torch.finfo(torch.float32).min
    sampling = SamplingParams(temperature=[0.0, 1.0, 1.0, 1.0])
    _, m, s, a = _stats(target, dlog, tokens, sampling)
    assert torch.equal(m[:, :K + 1, 0], torch.full((BATCH, K + 1), torch.finfo(torch.float32).min))
    assert torch.equal(s[:, :K + 1, 0], torch.full((BATCH, K + 1), float(CHUNK)))
    assert torch.equal(a[0, :K + 1, 0], torch.zeros(K + 1, dtype=a.dtype))
    bf = [t.bfloat16() for t in _case(seed=7, scale=6.0)[:2]]
    kw = dict(draft_logits=bf[1], sampling=SamplingParams(temperature=[0.0, 0.9, 1.0, 1.0]), seed=2)
    assert torch.equal(verify(bf[0], tokens, method="fused", **kw).output_tokens,
                       verify(bf[0], tokens, method="reference", **kw).output_tokens)
