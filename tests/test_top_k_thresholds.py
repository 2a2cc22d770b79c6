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


def test_top_k_with_top_p_or_unknown_k_uses_the_general_pass():
    logits = torch.randn(2, 2, 32)
    for sampling in (SamplingParams(top_k=4, top_p=0.9), SamplingParams(top_k=torch.tensor([4, 5])),
                     SamplingParams(top_k=[4, 0])):
        inputs = prepare_inputs(logits, torch.zeros(2, 1, dtype=torch.int64), sampling=sampling)
        resolved = inputs.sampling
        assert torch.equal(keep_thresholds(logits, inputs), _reference_thresholds(logits, resolved))
