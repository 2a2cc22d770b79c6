"""The chunked radix-select threshold kernel (kernels/radix.py) against the one-program-per-row kernel, the torch
bisection and a float64 brute force: chunk boundaries, ties across chunks, -inf, k >= V, p = 1, tiny V, V not a
multiple of the chunk, batch invariance. Small chunks (16 - 64 tokens) so that a row spans many programs."""
import math

import pytest
import torch

from tilespec.verify.filters import keep_threshold
from tilespec.verify.kernels.radix import radix_thresholds
from tilespec.verify.kernels.thresholds import filter_thresholds
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from test_filters import _brute_keep


def _both(logits, sp, **kw):
    s = resolve_sampling(sp, logits.shape[0], "cpu")
    args = (logits, s.temperature, s.top_k, s.top_p, s.has_top_k, s.has_top_p)
    return s, radix_thresholds(*args, **kw), filter_thresholds(*args)


def _assert_same_keep_as_brute(logits, s, thr, values):
    want, near = _brute_keep(logits, *values)
    scale = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    z = logits.float() / scale[:, None, None]
    got = (z >= thr[..., None]) & torch.isfinite(logits)
    want &= torch.isfinite(logits)
    assert torch.equal(got[~near], want[~near])


CASES = [(torch.float32, 4, 32, 203), (torch.bfloat16, 4, 64, 130), (torch.float16, 2, 16, 45),
         (torch.float32, 8, 64, 100)]


def _strided_case(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    full = (torch.randn(3, 4, vocab, generator=gen) * 2).to(dtype)
    logits = full[:, 1:3]                                      # non-contiguous over rows
    sp = SamplingParams(temperature=[0.7, 0.0, 1.3], top_k=[40, 0, 3], top_p=[0.9, 0.6, 1.0])
    return logits, resolve_sampling(sp, 3, "cpu")


# by default every dtype and search width once
@pytest.mark.parametrize("dtype,bits,chunk,vocab", [pytest.param(*CASES[0], marks=pytest.mark.slow), *CASES[1:]])
def test_radix_equals_row_kernel_and_search(dtype, bits, chunk, vocab):
    """Bit-identical thresholds, strided rows, V not a multiple of the chunk, every search width."""
    logits, s = _strided_case(dtype, vocab)
    got = radix_thresholds(logits, s.temperature, s.top_k, s.top_p, True, True, bits=bits, chunk=chunk, block=16)
    assert torch.equal(got, filter_thresholds(logits, s.temperature, s.top_k, s.top_p, True, True))
    assert torch.equal(got, keep_threshold(logits, s, method="search"))


# top-k alone and top-p alone (the searches above with one filter off); by default on one case
@pytest.mark.parametrize("dtype,bits,chunk,vocab", [pytest.param(*c, marks=pytest.mark.slow) if c != CASES[1] else c
                                                    for c in CASES])
def test_radix_with_one_filter_equals_row_kernel(dtype, bits, chunk, vocab):
    logits, s = _strided_case(dtype, vocab)
    for dk, dp in ((True, False), (False, True)):
        one = radix_thresholds(logits, s.temperature, s.top_k, s.top_p, dk, dp, bits=bits, chunk=chunk, block=16)
        assert torch.equal(one, filter_thresholds(logits, s.temperature, s.top_k, s.top_p, dk, dp))


def test_ties_across_chunks_are_kept_together():
    """The k-th value and the top-p boundary value occur in many chunks: all copies are kept or dropped."""
    vocab = 160
    logits = torch.full((1, 2, vocab), -1.0)
    logits[0, :, ::7] = 2.0                                    # 23 tied tokens spread over 5 chunks of 32
    logits[0, :, 3::11] = 3.0                                  # 15 larger ones (some overwrite: fine)
    logits[0, 1, 100:] = -math.inf
    for top_k, top_p in ((20, 1.0), (1, 1.0), (0, 0.3), (0, 0.9), (30, 0.8)):
        sp = SamplingParams(top_k=top_k, top_p=top_p)
        s, got, row = _both(logits, sp, chunk=32, block=16)
        assert torch.equal(got, row), (top_k, top_p)
        _assert_same_keep_as_brute(logits, s, got, ([1.0], [top_k], [top_p], [0.0]))


def test_edge_rows():
    """-inf rows and chunks, all-equal rows, a huge logit, k >= V, k = V - 1, p = 1, tiny V (1, 2, 3 tokens)."""
    for vocab in (1, 2, 3, 40):
        logits = torch.randn(6, 1, vocab)
        logits[0] = -math.inf                                  # nothing finite
        logits[1] = 0.25                                       # all equal
        logits[2, 0, : vocab // 2] = -math.inf                 # leading -inf chunk(s)
        logits[3, 0, -1] = 3e38                                # near the fp32 max
        top_k = [1, 2, vocab - 1, vocab, vocab + 3, 0]
        top_p = [0.5, 0.5, 1.0, 0.999, 0.2, 1.0]
        temp = [1.0, 0.5, 0.0, 2.0, 1.0, 1.0]
        sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p)
        s, got, row = _both(logits, sp, chunk=16, block=16)
        assert torch.equal(got, row), vocab
        assert torch.isneginf(got[5]).all()                     # no filter on
        _assert_same_keep_as_brute(logits, s, got, (temp, top_k, top_p, [0.0] * 6))


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 3])   # both coarse (ties everywhere)
def test_random_rows_match_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    b, vocab = 4, 300
    logits = torch.randn(b, 2, vocab, generator=gen) * 3
    if seed % 3 == 0:
        logits = (logits * 2).round() / 2                      # coarse grid: ties everywhere
    logits[1, 0, 50:170] = -math.inf
    temp, top_k, top_p = [1.0, 0.7, 0.0, 1.5], [5, 0, 50, 299], [0.9, 0.5, 1.0, 0.05]
    sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p)
    s, got, row = _both(logits, sp, chunk=64, block=32)
    assert torch.equal(got, row)
    _assert_same_keep_as_brute(logits, s, got, (temp, top_k, top_p, [0.0] * b))


def test_batch_invariance():
    """A row's threshold does not depend on the other rows (the chunking depends on V only)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 2, 65, generator=gen).to(torch.bfloat16)        # 3 chunks of 32, the last partial
    temp, top_k, top_p = [0.8, 1.0, 1.2], [7, 0, 50], [0.95, 0.7, 0.5]
    s, got, row = _both(logits, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p), chunk=32, block=16)
    assert torch.equal(got, row)
    for rows in (slice(0, 2), slice(2, 3)):                     # rows 0-1 without row 2, row 2 alone
        part = resolve_sampling(SamplingParams(temperature=temp[rows], top_k=top_k[rows], top_p=top_p[rows]),
                                len(temp[rows]), "cpu")
        alone = radix_thresholds(logits[rows].clone(), part.temperature, part.top_k, part.top_p, part.has_top_k,
                                 part.has_top_p, chunk=32, block=16)
        assert torch.equal(alone, got[rows])


def test_default_chunking_and_routing():
    """Default chunk / block at a V larger than one chunk, through keep_threshold's "triton" route."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 2, 4500, generator=gen) * 4
    s = resolve_sampling(SamplingParams(top_k=[64], top_p=[0.8]), 1, "cpu")
    got = keep_threshold(logits, s, method="triton")
    assert torch.equal(got, keep_threshold(logits, s, method="search"))
    with pytest.raises(ValueError):
        radix_thresholds(logits, s.temperature, s.top_k, s.top_p, True, True, bits=3)


# greedy rows (scaled by 1) and a scaled row (scaled rows by default: the tests above)
@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.7, marks=pytest.mark.slow)])
def test_top_p_stops_reading_once_one_value_is_left(temperature):
    """bf16 rows whose top-p boundary value is shared by tokens in every chunk: once the interval holds that one
    value, no chunk is read again (the stop), and the thresholds stay bit-identical to the row kernel's."""
    gen = torch.Generator().manual_seed(7)
    vocab = 128
    logits = torch.full((2, 2, vocab), -2.0)
    logits[..., ::5] = 1.5                                      # the boundary value, in every chunk of 16
    logits[..., 2::9] = (torch.randn(2, 2, 14, generator=gen) + 4.0)   # a head above it
    logits = logits.to(torch.bfloat16)
    sp = SamplingParams(temperature=temperature, top_p=0.97)
    s = resolve_sampling(sp, 2, "cpu")
    counts = []
    got = radix_thresholds(logits, s.temperature, s.top_k, s.top_p, False, True, chunk=16, block=16,
                           active_counts=counts)
    assert torch.equal(got, filter_thresholds(logits, s.temperature, s.top_k, s.top_p, False, True))
    _assert_same_keep_as_brute(logits, s, got, ([temperature] * 2, [0] * 2, [0.97] * 2, [0.0] * 2))
    assert len(counts) == 8 and counts[-1] == 0
    assert 0 in counts[:-1], counts                              # stopped before the last pass
    slow = []
    off = radix_thresholds(logits, s.temperature, s.top_k, s.top_p, False, True, chunk=16, block=16,
                           active_counts=slow, stop=False)
    assert torch.equal(off, got) and sum(slow) > sum(counts)
