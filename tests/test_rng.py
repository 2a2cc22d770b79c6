"""The counter-based RNG: exact 64-bit products, Triton-identical Philox, uniforms strictly inside (0, 1)."""
import os
import random

import pytest
import torch

from tilespec.verify import rng


def test_mulhilo_is_exact_despite_int64_wraparound():
    b = torch.randint(0, 2**32, (5000,), dtype=torch.int64)
    for a in (0xD2511F53, 0xCD9E8D57):
        hi, lo = rng._mulhilo(a, b)
        for i in random.Random(0).sample(range(5000), 500):
            full = a * int(b[i])
            assert (int(hi[i]), int(lo[i])) == (full >> 32, full & 0xFFFFFFFF)


def test_philox_known_answer_and_independence_of_keys():
    x = rng.philox_uint32(torch.tensor([12345, 2**40 + 7]), torch.tensor([0, 5]), torch.tensor([3, 9]), 2)
    assert x.tolist() == [4036030807, 369480125]
    a = rng.philox_uint32(torch.tensor(1), torch.arange(1000), 0, 1)
    b = rng.philox_uint32(torch.tensor(2), torch.arange(1000), 0, 1)
    assert (a != b).float().mean() > 0.99


def test_uniforms_are_open_interval_and_uniform():
    u = rng.uniform(torch.tensor(7), torch.arange(200_000), rng.PURPOSE_ACCEPT)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert rng.uniform_from_uint32(torch.tensor([0, 2**32 - 1])).tolist()[1] < 1.0


def test_seeds_from_forms():
    assert rng.seeds_from(5, 3, torch.device("cpu")).tolist() == [5, 6, 7]
    assert rng.seeds_from([9, 1], 2, torch.device("cpu")).tolist() == [9, 1]
    g = torch.Generator().manual_seed(0)
    first = rng.seeds_from(None, 4, torch.device("cpu"), g)
    assert first.shape == (4,) and first.dtype == torch.int64


def test_matches_triton_philox_bit_for_bit():
    pytest.importorskip("triton")
    import subprocess
    import sys
    code = r'''
import torch, triton, triton.language as tl
from tilespec.verify.rng import philox_uint32
@triton.jit
def k(seed_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    seed = tl.load(seed_ptr + i)
    a, b, c, d = tl.philox(seed, (i * 7).to(tl.uint32), (i * 3 + 1).to(tl.uint32), (i * 0 + 2).to(tl.uint32),
                           (i * 0).to(tl.uint32))
    tl.store(out_ptr + i, a.to(tl.int64))
seeds = torch.tensor([12345, 2**40 + 7, 99, 2**62 + 5], dtype=torch.int64)
out = torch.zeros(4, dtype=torch.int64)
k[(1,)](seeds, out, N=4)
i = torch.arange(4)
assert torch.equal(out & 0xFFFFFFFF, philox_uint32(seeds, i * 7, i * 3 + 1, 2)), (out, philox_uint32(seeds, i*7, i*3+1, 2))
print("ok")
'''
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_inverse_cdf_is_the_inverse_cdf_in_vocabulary_order():
    # boundaries: u * total exactly at a cumulative sum moves to the next id (strict >), zero weights never drawn
    w = torch.tensor([[1.0, 0.0, 1.0, 2.0, 0.0, 4.0, 0.0]]).repeat(7, 1)
    u = torch.tensor([0.01, 0.124, 0.125, 0.3, 0.49, 0.51, 0.99])
    for tile in (1, 2, 3, 1024):
        got = rng.inverse_cdf(w, u, tile=tile)
        assert got.tolist() == [0, 0, 2, 3, 3, 5, 5], tile
    assert rng.inverse_cdf(torch.zeros(2, 5), torch.tensor([0.3, 0.9])).tolist() == [0, 0]
    # u at the top of (0, 1) with a total that rounding leaves short: the last positive id, never a zero one
    assert rng.inverse_cdf(torch.tensor([[0.0, 3.0, 0.0]]), torch.tensor([1.0]), tile=2).tolist() == [1]


def test_inverse_cdf_tiles_only_change_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(4000, 300, generator=gen) ** 4
    u = rng.uniform(torch.arange(4000), torch.zeros(4000, dtype=torch.long), rng.PURPOSE_SAMPLE)
    exact = torch.searchsorted(torch.cumsum(w.double(), -1), (u.double() * w.double().sum(-1))[:, None],
                               right=True)[:, 0]
    for tile in (7, 64, 1024):
        assert (rng.inverse_cdf(w, u, tile=tile) == exact).float().mean() > 0.999
