"""Sort-free top-k / top-p / min-p (tilespec.verify.filters, kernels.thresholds) against a brute-force float64
evaluation of the definitions in filtered_logits' docstring: same kept sets, tie rule, batch invariance."""
import math

import pytest
import torch

from tilespec.verify.distributions import filtered_logits
from tilespec.verify.filters import KEY_NEG_INF, key_float, keep_threshold, order_key
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

METHODS = ("search", "sort", "triton", "triton_row")
NEAR = 1e-5   # rows with a top-p mass or a min-p log-ratio this close to the boundary are skipped (float rounding)


def _brute_keep(logits, temperature, top_k, top_p, min_p):
    """Kept mask [B, R, V] by the definitions, row by row in float64 (fp32 scaling as filtered_logits), and a
    [B, R] flag for rows with a near-tie at a top-p / min-p boundary."""
    b, r, v = logits.shape
    keep = torch.zeros(b, r, v, dtype=torch.bool)
    near = torch.zeros(b, r, dtype=torch.bool)
    for i in range(b):
        t = float(temperature[i])
        z_all = logits[i].float() / torch.tensor(t if t > 0 else 1.0, dtype=torch.float32)
        for j in range(r):
            z = z_all[j]
            kept = torch.ones(v, dtype=torch.bool)
            k = int(top_k[i])
            if 0 < k < v:
                kept &= z >= torch.sort(z, descending=True).values[k - 1]
            p = float(top_p[i])
            if p < 1.0:
                zk = torch.where(kept, z, torch.full_like(z, -math.inf)).double()
                pi = torch.softmax(zk, dim=0)
                vals, inv = torch.unique(zk, return_inverse=True)            # ascending distinct values
                mass = torch.zeros(len(vals), dtype=torch.float64).index_add_(0, inv, pi)
                above = mass.flip(0).cumsum(0).flip(0) - mass                 # mass of values strictly greater
                s = above[inv]
                kept &= s < p
                near[i, j] |= bool(((s - p).abs() < NEAR).any())
            mp = float(min_p[i])
            if mp > 0:
                zk = torch.where(kept, z, torch.full_like(z, -math.inf)).double()
                ratio = zk - zk.max() - math.log(mp)
                kept &= ratio >= 0
                near[i, j] |= bool((ratio.abs() < 1e-4).any())
            keep[i, j] = kept
    return keep, near


def _random_case(seed, vocab, as_tensors):
    gen = torch.Generator().manual_seed(seed)
    b, r = 5, 3
    logits = torch.randn(b, r, vocab, generator=gen) * (0.5 + 3 * torch.rand((), generator=gen))
    if seed % 3 == 0:                                       # coarse grid: many exact ties
        logits = (logits * 2).round() / 2
    logits[0, 0, : vocab // 7] = -math.inf
    pick = lambda options: [options[int(x)] for x in torch.randint(len(options), (b,), generator=gen)]  # noqa: E731
    temperature = pick([0.0, 0.5, 1.0, 1.7])
    top_k = pick([0, 1, 3, 50, vocab, vocab + 5])
    top_p = pick([1.0, 0.9, 0.5, 0.05, 0.999])
    min_p = pick([0.0, 0.0, 0.05])
    if as_tensors:
        sp = SamplingParams(temperature=torch.tensor(temperature), top_k=torch.tensor(top_k),
                            top_p=torch.tensor(top_p), min_p=torch.tensor(min_p))
    else:
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return logits, sp, (temperature, top_k, top_p, min_p)


def _check_against_brute(logits, sp, values, method):
    resolved = resolve_sampling(sp, logits.shape[0], logits.device)
    want, near = _brute_keep(logits, *values)
    got = torch.isfinite(filtered_logits(logits, resolved, method=method))
    want &= torch.isfinite(logits)
    ok = ~near
    assert torch.equal(got[ok], want[ok])
    return int(ok.sum())


@pytest.mark.parametrize("method", ("search", "sort"))
@pytest.mark.parametrize("as_tensors", (False, True))
def test_kept_sets_match_the_definition(method, as_tensors):
    checked = total = 0
    for seed in range(24):
        vocab = (97, 256, 1000, 4096)[seed % 4]
        logits, sp, values = _random_case(seed, vocab, as_tensors)
        checked += _check_against_brute(logits, sp, values, method)
        total += logits.shape[0] * logits.shape[1]
    assert checked >= 0.9 * total


# as_tensors only changes how the parameters are given (lists or tensors; both by the torch methods above), not the
# kernel's inputs: by default each case runs one of them; two chunks of radix.CHUNK (V = 4096): -m slow (many chunks
# per row: test_radix_thresholds.py)
@pytest.mark.parametrize("seed,vocab,as_tensors", [
    (2, 333, True), (3, 1000, False),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in ((1, 97, False), (1, 97, True), (2, 333, False),
                                                                 (3, 1000, True),
                                                                 (5, 4096, False), (5, 4096, True)))])
def test_triton_kernel_kept_sets_match_the_definition(seed, vocab, as_tensors):
    logits, sp, values = _random_case(seed, vocab, as_tensors)
    _check_against_brute(logits, sp, values, "triton")


@pytest.mark.parametrize("dtype,bits", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float16, 4),
                                        (torch.float32, 1), (torch.bfloat16, 2), (torch.float32, 8)])
def test_triton_thresholds_equal_torch_search(dtype, bits):
    """Same thresholds, bit for bit, from raw half-precision logits and a strided (sliced) layout, for every
    search width (key bits fixed per pass)."""
    from tilespec.verify.kernels.thresholds import filter_thresholds

    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(3, 5, 700, generator=gen) * 2).to(dtype)
    logits = full[:, 1:4]                                   # non-contiguous over rows
    sp = SamplingParams(temperature=[0.7, 0.0, 1.3], top_k=[40, 0, 3], top_p=[0.9, 0.6, 1.0])
    resolved = resolve_sampling(sp, 3, "cpu")
    got = filter_thresholds(logits, resolved.temperature, resolved.top_k, resolved.top_p, True, True, bits=bits)
    assert torch.equal(got, keep_threshold(logits, resolved, method="search"))


def test_ties_at_the_top_p_boundary_are_kept_together():
    # p ~ [0.47, 0.17, 0.17, 0.17, 0.02]: mass strictly above the tied 1.0s is 0.47 < 0.5, so all three are kept
    # (sort + cumsum used to keep whichever tied token the sort put first and drop the others).
    logits = torch.tensor([[[2.0, 1.0, 1.0, 1.0, -2.0]]])
    resolved = resolve_sampling(SamplingParams(top_p=0.5), 1, "cpu")
    for method in METHODS:
        kept = torch.isfinite(filtered_logits(logits, resolved, method=method))[0, 0]
        assert kept.tolist() == [True, True, True, True, False], method
    # top_p below the top token's own mass keeps it alone; ties at the top are all kept
    for method in METHODS:
        z = filtered_logits(logits, resolve_sampling(SamplingParams(top_p=0.3), 1, "cpu"), method=method)
        assert torch.isfinite(z)[0, 0].tolist() == [True, False, False, False, False], method
        z = filtered_logits(torch.tensor([[[1.0, 3.0, 3.0, 0.0]]]), resolve_sampling(SamplingParams(top_p=0.01), 1,
                            "cpu"), method=method)
        assert torch.isfinite(z)[0, 0].tolist() == [False, True, True, False], method


def test_ties_at_the_top_k_boundary_are_kept_together():
    logits = torch.tensor([[[3.0, 2.0, 2.0, 2.0, 1.0]]])
    for method in METHODS:
        for sp in (SamplingParams(top_k=2), SamplingParams(top_k=torch.tensor([2]))):
            z = filtered_logits(logits, resolve_sampling(sp, 1, "cpu"), method=method)
            assert torch.isfinite(z)[0, 0].tolist() == [True, True, True, True, False], method


@pytest.mark.parametrize("method", METHODS)
def test_each_request_is_filtered_as_if_alone(method):
    logits, sp, (temp, top_k, top_p, min_p) = _random_case(11, 300, False)
    batch = filtered_logits(logits, resolve_sampling(sp, logits.shape[0], "cpu"), method=method)
    for i in range(logits.shape[0]):
        one = SamplingParams(temperature=temp[i], top_k=top_k[i], top_p=top_p[i], min_p=min_p[i])
        alone = filtered_logits(logits[i:i + 1].clone(), resolve_sampling(one, 1, "cpu"), method=method)
        assert torch.equal(batch[i:i + 1], alone)


def test_masked_rows_and_disabled_filters():
    logits = torch.full((2, 1, 50), -math.inf)
    logits[1, 0, 3] = 0.5
    sp = SamplingParams(top_k=[5, 5], top_p=[0.5, 0.5], min_p=[0.1, 0.1])
    for method in METHODS:
        z = filtered_logits(logits, resolve_sampling(sp, 2, "cpu"), method=method)
        assert torch.isfinite(z).sum().item() == 1 and z[1, 0, 3].item() == 0.5
    x = torch.randn(2, 2, 64)
    off = resolve_sampling(SamplingParams(top_k=torch.tensor([0, 64]), top_p=torch.tensor([1.0, 1.0])), 2, "cpu")
    for method in METHODS:
        assert torch.equal(filtered_logits(x, off, method=method), x)


def test_order_keys_are_monotone_and_invertible():
    x = torch.tensor([-math.inf, -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, math.inf])
    keys = order_key(x)
    assert keys[0].item() == KEY_NEG_INF
    assert bool((keys[1:] > keys[:-1]).all())
    assert torch.equal(key_float(keys).view(torch.int32), x.view(torch.int32))
    assert torch.isnan(key_float(keys[-1:] + 1)).all() and torch.isnan(key_float(keys[-1:] + (1 << 31))).all()
