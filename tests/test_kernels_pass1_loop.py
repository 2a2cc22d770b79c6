"""CPU tests (TRITON_INTERPRET=1) of ``fused`` pass 1 with several chunks per program (``launch.CHUNKS_PER_PROGRAM``,
the ``CPP`` constexpr of ``stream.row_stats_stream_kernel``, per-request layout only).

A program runs the per-chunk arithmetic of CPP = 1 on each of its chunks (with the next slice prefetched), so the
pass-1 statistics m / s / a must be the same bits and the tokens the same, also when the number of chunks (5 here,
the last one ragged) is not a multiple of CPP; the plan cache must key on CPP.
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams
from tiers import fast_first

launch = pytest.importorskip("tilespec.verify.kernels.launch")

CHUNK, BATCH, K = 32, 4, 3           # the 4 requests: greedy, sampled, lenient, sampled
VOCAB = 4 * CHUNK + 9                   # NC = 5 chunks, the last one ragged
KINDS = {"logits": launch.DRAFT_LOGITS, "probs": launch.DRAFT_PROBS, "none": launch.DRAFT_NONE}
SENTINEL = 12345.0                      # pre-fills the scratch: slots pass 1 must not write stay equal too


@pytest.fixture(autouse=True)
def per_request_layout(monkeypatch):
    monkeypatch.setattr(launch, "ROW_ELEMS", 1)       # the GPU layout: one request per program, several chunks
    monkeypatch.setattr(launch, "CHUNK1", CHUNK)
    monkeypatch.setattr(launch, "SUB1_STREAM", 16)    # 2 slices per chunk: prefetches within and across chunks
    monkeypatch.setattr(launch, "BLOCK2", 16)
    monkeypatch.setattr(launch, "_PLANS", {})         # fresh cache: the plans below are the ones verify() uses


def _case(draft: str, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(BATCH, K + 1, VOCAB, generator=gen) * 2
    dlog = 0.6 * target[:, :K] + 0.4 * torch.randn(BATCH, K, VOCAB, generator=gen) * 2
    tokens = torch.multinomial(torch.softmax(dlog, -1).view(-1, VOCAB), 1, generator=gen).view(BATCH, K)
    kwargs = {"logits": {"draft_logits": dlog.to(dtype)}, "probs": {"draft_probs": torch.softmax(dlog, -1)},
              "none": {}}[draft]
    return target.to(dtype), tokens, kwargs


def _run(cpp: int, draft: str, sampling: SamplingParams, monkeypatch, dtype=torch.float32):
    """(result, m, s, a) of one fused call with CHUNKS_PER_PROGRAM = cpp; m / s / a: the plan's pass-1 scratch
    [B, 2K + 1, NC] after the call (pre-filled with sentinels, so unwritten slots compare too)."""
    monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", cpp)
    target, tokens, kwargs = _case(draft, dtype)
    has_thr = sampling.top_k != 0
    plan = launch._plan(target.device, BATCH, K, VOCAB, launch.MODE_LOGITS, KINDS[draft], has_thr, True)
    assert not plan.rows1 and plan.const1["CPP"] == cpp and plan.grid1[0] == -(-plan.nc1 // cpp)
    plan.m.fill_(SENTINEL)
    plan.s.fill_(SENTINEL)
    plan.a.fill_(-7)
    got = verify(target, tokens, method="fused", sampling=sampling, num_draft_tokens=torch.tensor([3, 0, 1, 2]),
                 seed=5, offsets=torch.arange(BATCH), **kwargs)
    assert any(p is plan for p in launch._PLANS.values())
    return got, plan.m.clone(), plan.s.clone(), plan.a.clone()


def _assert_same(one, many):
    got1, got2 = one[0], many[0]
    for name in ("output_tokens", "num_accepted", "num_emitted", "accepted"):
        assert torch.equal(getattr(got1, name), getattr(got2, name)), name
    for name, x1, x2 in zip("msa", one[1:], many[1:]):
        assert torch.equal(x1, x2), name
    assert bool((one[1] != SENTINEL).any()) and bool((one[3] != -7).any())   # pass 1 did write (greedy rows too)


@pytest.mark.parametrize("draft, filters", fast_first([("logits", "top-k"), ("none", "none"), ("logits", "none"),
                                                       ("probs", "none")], 2))
def test_statistics_and_tokens_match_one_chunk_per_program(draft, filters, monkeypatch):
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.3], lenience=[1.0, 1.0, 0.5, 1.0],
                              top_k=5 if filters == "top-k" else 0)
    one = _run(1, draft, sampling, monkeypatch)
    _assert_same(one, _run(3, draft, sampling, monkeypatch))   # 2 programs per row: the last has 2 chunks of 3


def test_low_precision_and_one_slice_per_chunk(monkeypatch):
    # bf16 logits (the prefetched slice stays bf16 until it is used); SUB = CHUNK: each prefetch is a next chunk's
    monkeypatch.setattr(launch, "SUB1_STREAM", CHUNK)
    sampling = SamplingParams(temperature=[0.0, 0.7] * 2)
    one = _run(1, "logits", sampling, monkeypatch, torch.bfloat16)
    _assert_same(one, _run(2, "logits", sampling, monkeypatch, torch.bfloat16))


def test_plan_cache_keys_on_chunks_per_program(monkeypatch):
    device, args = torch.device("cpu"), (BATCH, K, VOCAB, launch.MODE_LOGITS, launch.DRAFT_LOGITS, False, True)
    plans = {}
    for cpp in (1, 2, 3, 8):
        monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", cpp)
        plans[cpp] = launch._plan(device, *args)
        assert launch._plan(device, *args) is plans[cpp]                  # cached per value
    assert len({id(p) for p in plans.values()}) == 4                      # never a CPP = 1 plan for CPP = 2
    assert [plans[c].grid1 for c in (1, 2, 3, 8)] == [(5, 2 * K + 1, BATCH), (3, 2 * K + 1, BATCH),
                                                       (2, 2 * K + 1, BATCH), (1, 2 * K + 1, BATCH)]
    assert [plans[c].const1["CPP"] for c in (1, 2, 3, 8)] == [1, 2, 3, 5]   # at most NC: no all-skipped program
    monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", 0)                  # auto: by batch size
    monkeypatch.setattr(launch, "CPP_AUTO_MIN_BATCH", BATCH + 1)
    assert launch._plan(device, *args).const1["CPP"] == 1
    monkeypatch.setattr(launch, "CPP_AUTO_MIN_BATCH", BATCH)
    assert launch._plan(device, *args).const1["CPP"] == launch.CPP_AUTO
    monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", 2)                  # the batched layout ignores it
    monkeypatch.setattr(launch, "ROW_ELEMS", 1 << 20)
    batched = launch._plan(device, BATCH, K, 20, launch.MODE_LOGITS, launch.DRAFT_LOGITS, False, True)
    assert batched.rows1 and "CPP" not in batched.const1 and batched.grid1[0] == 1


def test_counters_reset_between_calls(monkeypatch):
    # the tail's last-program test counts ceil(NC / CPP) * R programs per request; a wrong count would leave
    # cnt1 non-zero (or never run the tail) and the second call's greedy outputs would differ
    sampling = SamplingParams(temperature=0.0)
    first = _run(2, "none", sampling, monkeypatch)
    again = _run(2, "none", sampling, monkeypatch)
    _assert_same(first, again)
    plan = launch._plan(torch.device("cpu"), BATCH, K, VOCAB, launch.MODE_LOGITS, launch.DRAFT_NONE, False, True)
    assert int(plan.cnt1.abs().sum()) == 0
    ref = verify(*_case("none")[:2], method="reference", sampling=sampling,
                 num_draft_tokens=torch.tensor([3, 0, 1, 2]), seed=5, offsets=torch.arange(BATCH))
    assert torch.equal(first[0].output_tokens, ref.output_tokens)
