"""Top-p keep thresholds of 16-bit logits from a key-count window (kernels/topp16.py): the sort's kept sets, ties
and -0.0 / +0.0 included, the gated exact fallback for rows the window does not decide, and the route from
keep_thresholds."""
import math

import pytest
import torch

from tilespec.verify.filters import scaled_logits, top_p_threshold_sorted
from tilespec.verify.kernels import keep, topp16
from tilespec.verify.types import SamplingParams

from test_filters import _brute_keep
from test_kernels_topk16 import assert_routed_in_one_launch_set


def _check(logits, top_p, temperature, **kw):
    got = topp16.top_p_thresholds16(logits, top_p, temperature, **kw)
    z = scaled_logits(logits, temperature)
    want = top_p_threshold_sorted(z, top_p)
    assert got.dtype == torch.float32 and got.shape == logits.shape[:2]
    assert torch.equal(z >= got[..., None], z >= want[..., None])
    keep_b, near = _brute_keep(logits, temperature, [0] * len(top_p), top_p, [0.0] * len(top_p))
    kept = (z >= got[..., None]) & torch.isfinite(logits)
    assert torch.equal(kept[~near], (keep_b & torch.isfinite(logits))[~near])
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_thresholds_keep_the_sorted_set(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 2, 5001, generator=gen) * 3).to(dtype)   # 3 chunks of 2048, V not a multiple of 8
    logits[0, 1, :2500] = -math.inf
    logits[2, 0] = 0.0
    logits[2, 0, ::2] = -0.0                                           # one value, two keys
    logits[2, 0, :40] = 1.0                                            # a tied top
    _check(logits, torch.tensor([0.9, 0.5, 0.95]), torch.tensor([1.0, 0.0, 0.7]), chunk=2048)


def test_ties_at_the_boundary_and_edge_rows():
    logits = torch.full((4, 1, 300), -1.0)
    logits[0, 0, ::7] = 2.0
    logits[0, 0, 3::11] = 3.0
    logits[1] = -math.inf                                               # nothing finite
    logits[2] = 0.5                                                     # all equal
    logits[3, 0, -1] = 3e38                                             # the largest bf16 values
    _check(logits.bfloat16(), torch.tensor([0.3, 0.9, 0.5, 0.999]), torch.tensor([1.0, 1.0, 2.0, 1.0]),
           chunk=128)
    assert torch.isneginf(topp16.top_p_thresholds16(logits.bfloat16(), torch.tensor([1.0, 1.0, 0.5, 1.0]),
                                                    torch.ones(4), chunk=128)[[0, 1, 3]]).all()


def test_rows_below_the_window_take_the_exact_fallback():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 2, 3000, generator=gen) * 0.3).to(torch.bfloat16)   # flat rows: t_p far below max
    top_p, temperature = torch.tensor([0.9, 0.6]), torch.tensor([1.0, 1.3])
    without = topp16.top_p_thresholds16(logits, top_p, temperature, window=16, chunk=1024, fallback=False)
    got = _check(logits, top_p, temperature, window=16, chunk=1024)
    assert not torch.equal(got, without)                               # the window alone did not decide them


def test_batch_invariance_and_strided_rows():
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(3, 4, 2100, generator=gen) * 2).to(torch.bfloat16)
    logits = base[:, 1:3, 16:2064]                                      # strided, offset rows
    top_p, temperature = torch.tensor([0.8, 1.0, 0.6]), torch.tensor([0.7, 1.0, 1.2])
    got = _check(logits, top_p, temperature, chunk=1024)
    assert torch.isneginf(got[1]).all()
    for i in range(3):
        alone = topp16.top_p_thresholds16(logits[i:i + 1].clone(), top_p[i:i + 1], temperature[i:i + 1],
                                          chunk=1024)
        assert torch.equal(alone, got[i:i + 1])


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="bf16 / fp16"):
        topp16.top_p_thresholds16(torch.zeros(1, 1, 8), torch.tensor([0.5]), torch.tensor([1.0]))
    logits = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="top_p must be"):
        topp16.top_p_thresholds16(logits, torch.tensor([0.5]), torch.ones(2))
    with pytest.raises(ValueError, match="powers of 2"):
        topp16.top_p_thresholds16(logits, torch.ones(2) / 2, torch.ones(2), window=100)


def test_keep_thresholds_routes_16_bit_top_p_here(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(2, 3, 300, generator=gen) * 3).bfloat16()
    draft = (torch.randn(2, 2, 300, generator=gen) * 3).bfloat16()
    tokens = torch.randint(0, 300, (2, 2), generator=gen)
    assert_routed_in_one_launch_set(monkeypatch, "top_p_thresholds16", logits, draft, tokens,
                                    SamplingParams(top_p=[0.8, 0.95], temperature=[0.7, 1.2]))


def test_target_and_draft_rows_in_one_call():
    gen = torch.Generator().manual_seed(7)
    target = (torch.randn(2, 3, 2500, generator=gen) * 3).bfloat16()
    draft = (torch.randn(2, 2, 2500, generator=gen) * 3).bfloat16()
    top_p, temperature = torch.tensor([0.9, 0.7]), torch.tensor([1.0, 0.6])
    got_t, got_d = topp16.top_p_thresholds16(target, top_p, temperature, draft, chunk=1024)
    assert torch.equal(got_t, topp16.top_p_thresholds16(target, top_p, temperature, chunk=1024))
    assert torch.equal(got_d, topp16.top_p_thresholds16(draft, top_p, temperature, chunk=1024))
    _check(draft, top_p, temperature, chunk=1024)


# window 16: some rows take the fallback, which keeps the max of its t_p and min-p's threshold
@pytest.mark.parametrize("dtype, window", [(torch.bfloat16, 0), (torch.float16, 16)])
def test_min_p_alone_and_after_top_p(dtype, window):
    from tilespec.verify.distributions import filtered_logits
    from tilespec.verify.validation import resolve_sampling
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(4, 2, 1500, generator=gen) * 3).to(dtype)
    logits[1, 0, :700] = -math.inf
    logits[3, 1] = 0.25                                                    # all equal
    temp, top_p, min_p = [1.0, 0.7, 0.0, 1.3], [1.0, 0.9, 0.5, 1.0], [0.05, 0.1, 0.2, 0.0]
    s = resolve_sampling(SamplingParams(temperature=temp, top_p=top_p, min_p=min_p), 4, "cpu")
    got = topp16.top_p_thresholds16(logits, s.top_p, s.temperature, min_p=s.min_p, chunk=1024, window=window)
    z = scaled_logits(logits, s.temperature)
    kept = (z >= got[..., None]) & torch.isfinite(logits)
    want, near = _brute_keep(logits, temp, [0] * 4, top_p, min_p)
    assert torch.equal(kept[~near], (want & torch.isfinite(logits))[~near])
    ref = torch.isfinite(filtered_logits(logits, s, method="sort")) & torch.isfinite(logits)
    assert torch.equal(kept, ref)
    assert torch.isneginf(got[3]).all()                                      # no filter on


def test_a_threshold_kernel_that_fails_on_the_gpu_falls_back_once(monkeypatch):
    """A 16-bit threshold kernel that a machine's Triton rejects: one warning, then the general exact path (None
    here) for the rest of the process; on CPU (the interpreter) the error is raised, as tests must see it."""
    monkeypatch.setattr(keep, "_FAILED", set())
    calls = []

    def broken(logits, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("unsupported construct\nmore detail")

    class OnGpu:
        is_cuda = True

    with pytest.warns(UserWarning, match="topp16 threshold kernels failed on this GPU .*unsupported construct"):
        assert keep._guarded("topp16", broken, OnGpu()) is None
    assert keep._guarded("topp16", broken, OnGpu()) is None and calls == [1]      # not tried again
    with pytest.raises(RuntimeError, match="unsupported"):
        keep._guarded("topk16", broken, torch.zeros(1))
