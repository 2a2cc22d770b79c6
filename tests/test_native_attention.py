"""engine/native/attention.py's decode attention against its PyTorch reference and SDPA, in Triton's CPU interpreter
(or on CUDA when present): every (B, H/H_kv, Q, D, C) combination of the decode / verification shapes, the engine's
transposed q, causal-ish masks with holes, fp32 and bf16, fully masked (padding) rows, ``supported``."""
import itertools
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported (attention.py does the same)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tilespec.engine.native import attention  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or attention._INTERPRET),
                                reason="needs CUDA or the Triton interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = [(12, 2), (4, 4), (8, 2)]


def _inputs(b, h, hkv, nq, d, c, dtype, seed=0):
    """q [B, H, Q, D] as the transpose of a [B, Q, H, D] tensor; K/V [B, H_kv, C, D]; additive mask [B, 1, Q, C]:
    each request attends to a random prefix of n slots with ~20% holes, its Q new tokens causal over the last Q."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=g).to(dtype).to(DEV).transpose(1, 2)
    k = torch.randn(b, hkv, c, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(b, hkv, c, d, generator=g).to(dtype).to(DEV)
    keep = torch.zeros(b, 1, nq, c, dtype=torch.bool)
    for i in range(b):
        n = int(torch.randint(nq + 1, c + 1, (1,), generator=g))
        keep[i, 0, :, :n] = torch.rand(nq, n, generator=g) > 0.2
        for t in range(nq):
            keep[i, 0, t, n - nq + t] = True
            keep[i, 0, t, n - nq + t + 1:n] = False
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min).to(DEV)
    return q, k, v, mask


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


# the full product in fp32 except D=128 with C=512, which runs once (the interpreter's slowest shape)
CASES = [(b, h, hkv, nq, d, c) for b, (h, hkv), nq, d, c in itertools.product((1, 3), HEADS, (1, 2, 6), (64, 128),
                                                                            (256, 512)) if not (d == 128 and c == 512)]
CASES.append((3, 12, 2, 6, 128, 512))


def _pairwise(cases: list) -> list:
    """A subset of ``cases`` holding every pair of values of any two parameters that ``cases`` holds (greedy, in
    list order: the same subset every run)."""
    def pairs(case):
        return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}
    need, chosen = set().union(*map(pairs, cases)), []
    while need:
        best = max(cases, key=lambda case: len(pairs(case) & need))
        chosen.append(best)
        need -= pairs(best)
    return chosen


PAIRWISE = _pairwise(CASES)   # 9 of the 55 cases by default; the full product: -m slow


@pytest.mark.parametrize("b,h,hkv,nq,d,c", [case if case in PAIRWISE else pytest.param(*case, marks=pytest.mark.slow)
                                            for case in CASES])
def test_matches_reference_and_sdpa_fp32(b, h, hkv, nq, d, c):
    q, k, v, mask = _inputs(b, h, hkv, nq, d, c, torch.float32, seed=b * 1000 + h * 100 + nq * 10 + d + c)
    assert q.stride(1) == d and attention.supported(q, k)              # heads innermost but one: a transposed view
    got = attention.decode_attention(q, k, v, mask)
    assert got.shape == (b, h, nq, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, attention.decode_attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask), rtol=1e-5, atol=1e-5)
    # the caller's flattening of the heads
    flat = got.transpose(1, 2).reshape(b, nq, h * d)
    torch.testing.assert_close(flat, _sdpa(q, k, v, mask).transpose(1, 2).reshape(b, nq, h * d), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,h,hkv,nq,d,c", [(1, 12, 2, 1, 64, 256), (3, 8, 2, 6, 64, 512), (1, 4, 4, 2, 128, 256),
                                            (3, 12, 2, 2, 128, 512)])
def test_matches_reference_and_sdpa_bf16(b, h, hkv, nq, d, c):
    q, k, v, mask = _inputs(b, h, hkv, nq, d, c, torch.bfloat16, seed=7 + b + nq)
    got = attention.decode_attention(q, k, v, mask)
    assert got.shape == (b, h, nq, d) and got.dtype == torch.bfloat16
    want = attention.decode_attention_reference(q, k, v, mask)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), _sdpa(q, k, v, mask).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_stay_finite_and_others_match(dtype):
    """A padding query row (masked everywhere) inside a group whose other rows attend, and a whole padding request:
    the output stays finite there (any finite value is allowed), and every other row equals SDPA."""
    b, h, hkv, nq, d, c = 3, 8, 2, 2, 64, 256
    q, k, v, mask = _inputs(b, h, hkv, nq, d, c, dtype, seed=11)
    lo = torch.finfo(dtype).min
    mask[0, 0, 1] = lo                     # request 0: its second query token is padding
    mask[2] = lo                           # request 2: padding everywhere
    got = attention.decode_attention(q, k, v, mask)
    assert torch.isfinite(got.float()).all()
    want = _sdpa(q, k, v, mask)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0, :, 0].float(), want[0, :, 0].float(), **tol)
    torch.testing.assert_close(got[1].float(), want[1].float(), **tol)
    assert torch.isfinite(attention.decode_attention_reference(q, k, v, mask).float()).all()


def test_supported():
    q, k, _, _ = _inputs(1, 8, 2, 2, 64, 256, torch.float32)
    assert attention.supported(q, k) and attention.supported(q.bfloat16(), k.bfloat16())
    assert attention.supported(q.half(), k.half())
    assert not attention.supported(q.double(), k.double())                       # dtype
    assert not attention.supported(q.bfloat16(), k)                              # mixed dtypes
    assert not attention.supported(q[..., :48], k[..., :48].contiguous())        # D not a power of two
    assert not attention.supported(q, k.transpose(2, 3).contiguous().transpose(2, 3))   # K not contiguous
    assert not attention.supported(torch.randn(1, 8, attention.MAX_Q + 1, 64, device=DEV), k)   # prefill-sized Q
    k4 = torch.randn(1, 4, 256, 64, device=DEV)
    assert not attention.supported(torch.randn(1, 6, 1, 64, device=DEV), k4)      # H % H_kv != 0
    assert not attention.supported(torch.randn(2, 8, 1, 64, device=DEV), k)      # batch mismatch
    assert not attention.supported(torch.randn(1, 8, 1, 32, device=DEV), k)      # head dim mismatch
