"""GPU checks of batches above CUDA's grid limit of 65,535 on axes 1 / 2 (``kernels/batch_split.py``):
``pytest -m gpu tests/test_kernels_gpu_batch.py`` on a CUDA machine.

Two shapes, at B = 70,000 (two slices) and 250,000 (four): vLLM's rejection-sampler test shape (V = 10, K = 2,
draft probabilities, random rows, T = 1) and a tiny vocabulary with ragged drafts and per-request seeds
(V = 3, K = 2, draft logits). ``fused`` and ``tiled`` must run, agree with ``reference`` on (nearly) every row
(they differ from it only in fp32 summation order, so a row can differ where a uniform lands within rounding of a
CDF boundary), and give a window of rows across the first slice boundary the same outputs bit for bit as a
separate call on those rows alone (per-request keys travel with the rows).
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)


def _vllm_shape(batch, gen):
    """V = 10, K = 2, every request drafts K tokens; draft probabilities given."""
    vocab, k = 10, 2
    target = torch.randn(batch, k + 1, vocab, device="cuda", generator=gen)
    probs = torch.softmax(torch.randn(batch, k, vocab, device="cuda", generator=gen), -1)
    tokens = torch.randint(0, vocab, (batch, k), device="cuda", generator=gen)
    return target, tokens, dict(draft_probs=probs, seed=1234)


def _ragged_tiny(batch, gen):
    """V = 3, K = 2, K_b in {0, 1, 2}, per-request seeds and offsets, draft logits."""
    vocab, k = 3, 2
    target = torch.randn(batch, k + 1, vocab, device="cuda", generator=gen) * 2
    dlog = torch.randn(batch, k, vocab, device="cuda", generator=gen) * 2
    tokens = torch.randint(0, vocab, (batch, k), device="cuda", generator=gen)
    return target, tokens, dict(draft_logits=dlog, num_draft_tokens=torch.randint(0, k + 1, (batch,), device="cuda",
                                                                                   generator=gen),
                                seed=torch.randint(0, 2**62, (batch,), device="cuda", generator=gen),
                                offsets=torch.randint(0, 10**6, (batch,), device="cuda", generator=gen))


def _rows(kw, lo, hi):
    """The keyword arguments of rows lo .. hi - 1 alone (an int seed s gives request b the seed s + b)."""
    out = {k: (v[lo:hi] if torch.is_tensor(v) else v) for k, v in kw.items()}
    if isinstance(kw["seed"], int):
        out["seed"] = kw["seed"] + lo
    return out


@pytest.mark.parametrize("batch", [70_000, 250_000])
@pytest.mark.parametrize("shape", [_vllm_shape, _ragged_tiny], ids=["V10-K2-probs", "V3-K2-ragged-seeds"])
@pytest.mark.parametrize("method", ["fused", "tiled"])
def test_large_batch_matches_reference(method, shape, batch):
    gen = torch.Generator(device="cuda").manual_seed(batch)
    target, tokens, kw = shape(batch, gen)
    got = verify(target, tokens, method=method, **kw)
    ref = verify(target, tokens, method="reference", **kw)
    torch.cuda.synchronize()
    assert got.output_tokens.shape == ref.output_tokens.shape
    same = (got.output_tokens == ref.output_tokens).all(1) & (got.num_accepted == ref.num_accepted)
    differ = int((~same).sum())
    print(f"{method} {shape.__name__} B={batch}: {differ} of {batch} rows differ from reference")
    assert differ <= max(2, batch // 100_000), f"{differ} rows differ from reference"
    lo, hi = 65_000, 66_000          # across the first slice boundary (65,535)
    alone = verify(target[lo:hi], tokens[lo:hi], method=method, **_rows(kw, lo, hi))
    assert torch.equal(alone.output_tokens, got.output_tokens[lo:hi])
    assert torch.equal(alone.accepted, got.accepted[lo:hi])
