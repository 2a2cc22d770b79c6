"""The top-k selection fast path of the Triton methods gives exactly the reference's keep thresholds."""
import pytest
import torch

from tilespec.verify.distributions import filtered_logits
from tilespec.verify.kernels.launch import keep_thresholds
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import prepare_inputs, resolve_sampling


def _reference_thresholds(logits, sampling):
    z = filtered_logits(logits, sampling)
    return z.masked_fill(torch.isneginf(z), float("inf")).amin(dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (5, 0.7), ([3, 50, 1, 7], [1.0, 0.0, 0.3, 2.0]),
                                               (63, 1.3)])
def test_top_k_thresholds_match_reference(dtype, top_k, temperature):
    gen = torch.Generator().manual_seed(0)
    batch, rows, vocab = 4, 3, 64
    # coarse values force many ties, including at the k-th position
    logits = (torch.randint(-6, 6, (batch, rows, vocab), generator=gen).float() / 2).to(dtype)
    logits[0, 0, :5] = float("-inf")
    sampling = SamplingParams(temperature=temperature, top_k=top_k)
    resolved = resolve_sampling(sampling, batch, logits.device)
    assert resolved.top_k_range is not None
    inputs = prepare_inputs(logits, torch.zeros(batch, rows - 1, dtype=torch.int64), sampling=sampling)
    fast = keep_thresholds(logits, inputs)
    ref = _reference_thresholds(logits, resolved)
    finite = torch.isfinite(fast)   # -inf when fewer than k logits are finite: the reference then gives the
    assert torch.equal(fast[finite], ref[finite])   # smallest finite one, and both keep the same logits:
    scale = torch.where(resolved.temperature > 0, resolved.temperature, torch.ones_like(resolved.temperature))
    z = logits.float() / scale[:, None, None]
    keep_fast = torch.where(z >= fast[..., None], z, torch.full_like(z, float("-inf")))
    keep_ref = torch.where(z >= ref[..., None], z, torch.full_like(z, float("-inf")))
    assert torch.equal(keep_fast, keep_ref)


def _kept(logits, thr, sampling):
    scale = torch.where(sampling.temperature > 0, sampling.temperature, torch.ones_like(sampling.temperature))
    z = logits.float() / scale[:, None, None]
    return torch.where(z >= thr[..., None], z, torch.full_like(z, float("-inf")))


@pytest.mark.parametrize("sampling", [SamplingParams(top_k=4, top_p=0.9), SamplingParams(top_k=torch.tensor([4, 5])),
                                      SamplingParams(top_k=[4, 0]), SamplingParams(top_p=0.5),
                                      SamplingParams(top_p=[0.3, 1.0], temperature=[0.7, 1.0]),
                                      SamplingParams(top_p=0.8, temperature=0.0),
                                      SamplingParams(top_k=6, top_p=0.7, min_p=0.1)])
def test_top_k_top_p_min_p_keep_the_reference_set(sampling):
    """Top-p / ragged top-k / min-p: the thresholds the kernels get keep exactly filtered_logits' set (no fp32 copy
    of the rows without min-p; the values may differ, e.g. -inf for a row with no filter on)."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randint(-8, 8, (2, 3, 48), generator=gen).float() / 3).to(torch.bfloat16)   # ties
    logits[1, 2, :7] = float("-inf")
    inputs = prepare_inputs(logits, torch.zeros(2, 2, dtype=torch.int64), sampling=sampling)
    resolved = inputs.sampling
    thr = keep_thresholds(logits, inputs)
    assert thr.dtype == torch.float32 and thr.shape == (2, 3) and thr.is_contiguous()
    assert torch.equal(_kept(logits, thr, resolved), filtered_logits(logits, resolved))
    if resolved.has_min_p:   # the general pass: exactly the reference's thresholds
        assert torch.equal(thr, _reference_thresholds(logits, resolved))
