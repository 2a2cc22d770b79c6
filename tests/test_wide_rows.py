"""verify/wide_rows.py: the chunked reductions equal torch's one-pass ops (ties, -inf, tails, few and many rows)."""
import pytest
import torch

from tilespec.verify import wide_rows
from tilespec.verify.wide_rows import CHUNK

WIDTHS = [7, CHUNK, CHUNK + 1, 3 * CHUNK - 5, 151_936]


def _rows(v: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, v, generator=g)
    x[0, 0, -1] = 50.0                      # the maximum in the padded tail chunk
    x[0, 1] = -float("inf")                 # a row of -inf
    x[0, 2, v // 2:] = -float("inf")
    x[1, 0] = torch.round(x[1, 0])          # many exact ties
    x[1, 1, :] = 1.0                        # all tied: the first index wins
    return x.to(dtype)


@pytest.mark.parametrize("v", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_the_first_maximum(v, dtype):
    x = _rows(v, dtype=dtype)
    assert torch.equal(wide_rows.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("v", WIDTHS)
@pytest.mark.parametrize("k", [1, 8, 10])
def test_topk_values_equal_torch(v, k):
    x = _rows(v, seed=1)
    k = min(k, v)
    top, idx = wide_rows.topk(x, k)
    ref, _ = x.topk(k, dim=-1)
    assert torch.equal(top, ref)
    assert idx.min() >= 0 and idx.max() < v
    finite = torch.isfinite(top)
    assert torch.equal(x.gather(-1, idx)[finite], top[finite])   # the indices hold those values


@pytest.mark.parametrize("v", WIDTHS)
def test_logsumexp_and_log_softmax_match_torch(v):
    x = _rows(v, seed=2) * 7
    x[2, 3, 0] = float("inf")
    ref = torch.logsumexp(x, dim=-1)
    got = wide_rows.logsumexp(x)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-6, equal_nan=True)
    assert got[0, 1] == -float("inf") and got[2, 3] == float("inf")
    ok = torch.isfinite(ref)
    assert torch.allclose(wide_rows.log_softmax(x)[ok], torch.log_softmax(x, dim=-1)[ok], atol=1e-5)
