"""The split-KV decode attention kernels (engine/native/attention.py) against SDPA, in Triton's CPU interpreter:
GQA groups, several query tokens, transposed q, holes in the mask, unused capacity skipped, padding rows finite."""
import pytest
import torch
import torch.nn.functional as F

from tilespec.engine.native import attention
from tiers import fast_first

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or attention._INTERPRET),
                                reason="needs CUDA or the Triton interpreter")


def _inputs(b, h, hkv, nq, d, c, dtype, seed=0, valid=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=g).to(dtype).transpose(1, 2)     # the engine's transposed view
    k = torch.randn(b, hkv, c, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, c, d, generator=g).to(dtype)
    keep = torch.zeros(b, 1, nq, c, dtype=torch.bool)
    for i in range(b):
        n = valid if valid is not None else int(torch.randint(nq + 1, c, (1,), generator=g))
        keep[i, 0, :, :n] = torch.rand(n, generator=g) > 0.2                  # holes (rejected drafts)
        for t in range(nq):                                                  # causal over the new tokens
            keep[i, 0, t, n - nq + t] = True
            keep[i, 0, t, n - nq + t + 1:n] = False
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, torch.finfo(dtype).min)
    return q, k, v, mask


@pytest.mark.parametrize("b,h,hkv,nq,d,c", fast_first([(1, 12, 2, 1, 64, 512), (3, 4, 4, 2, 32, 256),
                                                       (2, 8, 2, 6, 64, 768), (1, 12, 2, 3, 128, 256),
                                                       (2, 12, 2, 32, 32, 512), (1, 12, 2, 64, 16, 256)], 2))
def test_decode_attention_matches_sdpa_fp32(b, h, hkv, nq, d, c):
    q, k, v, mask = _inputs(b, h, hkv, nq, d, c, torch.float32)
    assert attention.supported(q, k)
    got = attention.decode_attention(q, k, v, mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, attention.decode_attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_decode_attention_bf16_and_unused_capacity():
    q, k, v, mask = _inputs(2, 8, 2, 2, 64, 1024, torch.bfloat16, seed=4, valid=300)   # 3 of 4 pieces unused
    got = attention.decode_attention(q, k, v, mask)
    want = attention.decode_attention_reference(q, k, v, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_fully_masked_row_stays_finite_and_others_unaffected():
    q, k, v, mask = _inputs(2, 4, 2, 1, 32, 256, torch.float32, seed=7)
    mask[1] = torch.finfo(torch.float32).min                                 # a padding request
    got = attention.decode_attention(q, k, v, mask)
    assert torch.isfinite(got).all()
    want = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=mask[:1], enable_gqa=True)
    torch.testing.assert_close(got[:1], want, rtol=1e-5, atol=1e-5)


def test_supported_says_no_to_what_it_cannot_run():
    q, k, _, _ = _inputs(1, 4, 2, 1, 32, 256, torch.float32)
    assert not attention.supported(q.double(), k.double())
    assert not attention.supported(q[..., :24], k[..., :24])                 # D not a power of two
    long_q = torch.randn(1, 4, attention.MAX_Q + 1, 32)
    assert not attention.supported(long_q, k)                                # prefill-sized
    assert not attention.supported(torch.randn(1, 3, 1, 32), k)              # heads not a multiple of H_kv


def test_operator_form_for_compiled_code():
    q, k, v, mask = _inputs(2, 8, 2, 2, 32, 256, torch.float32, seed=2)
    out = torch.ops.tilespec.decode_attention(q, k, v, mask)
    assert out.shape == (2, 2, 8, 32) and out.is_contiguous()                # [B, Q, H, D]
    torch.testing.assert_close(out.transpose(1, 2), attention.decode_attention(q, k, v, mask))
    torch.library.opcheck(torch.ops.tilespec.decode_attention.default, (q, k, v, mask),
                          test_utils=("test_schema", "test_faketensor"))


def test_preferred_follows_the_measured_shapes():
    """cuDNN keeps single-token steps of small batches and the trees of a few requests over small caches; the
    kernels take every 2-8 token verify, one request's tree, large caches and large batches (attention.preferred)."""
    def pick(b, nq, c):
        q = torch.empty(b, 12, nq, 32)
        return attention.preferred(q, torch.empty(b, 2, c, 32))
    assert not pick(1, 1, 512) and not pick(8, 1, 4352)
    assert pick(64, 1, 4352) and not pick(64, 1, 512)
    assert pick(1, 2, 512) and pick(1, 5, 4352) and pick(8, 8, 512)
    assert pick(1, 32, 512) and pick(1, 32, 1280) and pick(64, 32, 512)
    assert not pick(8, 32, 512) and pick(8, 32, 1280)
    assert not attention.preferred(torch.empty(1, 12, attention.MAX_Q + 1, 32), torch.empty(1, 2, 512, 32))
    assert [attention.split_for(1, 2, c) for c in (512, 1280, 4352)] == [64, 128, 256]
    assert [attention.split_for(64, 2, c) for c in (512, 4352)] == [256, 512]
