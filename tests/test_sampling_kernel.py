"""Keyed Gumbel-max sampling (verify/sampling.py, verify/kernels/gumbel.py): the one-launch Triton kernel (here under
TRITON_INTERPRET) draws what the PyTorch reference draws -- same keyed uniforms, same scores up to float rounding --
with and without a reduced vocabulary, greedy rows, filters and 16-bit logits; the draft samplers use it; on a GPU
its law passes a G-test at 10^6 samples and a planted temperature bias fails."""
from __future__ import annotations

import pytest
import torch

from tilespec.verify import rng, sampling
from tilespec.verify.distributions import log_probs
from tilespec.verify.kernels.gumbel import gumbel_argmax
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling


def _noisy(logp, seeds, positions, ids):
    return logp + rng.gumbel(seeds[:, None], positions[:, None], rng.PURPOSE_EXTRA, ids[None, :])


def _agree(got, ref, logp, seeds, positions, ids):
    """Equal draws, except where the two ids' noisy scores tie within float rounding (kernel vs PyTorch log)."""
    score = _noisy(logp, seeds, positions, ids)
    col = {int(v): i for i, v in enumerate(ids.tolist())}
    for b in (got != ref).nonzero().flatten().tolist():
        a, r = score[b, col[int(got[b])]], score[b, col[int(ref[b])]]
        assert abs(float(a - r)) < 1e-4 * max(1.0, abs(float(r))), (b, float(a), float(r))
    assert int((got != ref).sum()) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduced", [False, True])
def test_kernel_draws_the_reference_tokens(dtype, reduced):
    g = torch.Generator().manual_seed(0)
    b, v = 16, 3000                                      # each temperature on 4 rows
    logits = (torch.randn(b, v, generator=g) * 3).to(dtype)
    ids = torch.randperm(20000, generator=g)[:v].sort().values if reduced else torch.arange(v)
    temps = [0.0, 0.5, 1.0, 1.7] * (b // 4)
    resolved = resolve_sampling(SamplingParams(temperature=temps), b, torch.device("cpu"))
    seeds, positions = torch.arange(b) * 11 + 5, torch.arange(b) % 9 + 100
    got = gumbel_argmax(logits, resolved.temperature, seeds, positions, rng.PURPOSE_EXTRA, ids if reduced else None)
    logp = log_probs(logits.float()[:, None, :], resolved)[:, 0]
    ref = sampling.gumbel_argmax_reference(logp, seeds, positions, rng.PURPOSE_EXTRA, ids if reduced else None)
    _agree(got, ref, logp, seeds, positions, ids)
    greedy = torch.tensor(temps) == 0
    assert torch.equal(got[greedy], ids[logits.float().argmax(-1)][greedy])


@pytest.mark.parametrize("reduced", [False, True])
def test_rows_cut_into_chunks_give_the_same_draws_and_the_first_index_on_ties(monkeypatch, reduced):
    from tilespec.verify.kernels import gumbel
    g = torch.Generator().manual_seed(3)
    b, v = 8, 3000
    logits = torch.randn(b, v, generator=g)
    logits[0, [100, 1700, 2900]] = 50.0                  # greedy row 0: the maximum in three chunks
    ids = torch.randperm(9000, generator=g)[:v].sort().values if reduced else None
    temps = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0, 1.3, 1.0, 2.0])
    seeds, positions = torch.arange(b) * 5 + 2, torch.arange(b) + 40
    whole = gumbel.gumbel_argmax(logits, temps, seeds, positions, rng.PURPOSE_EXTRA, ids)
    monkeypatch.setattr(gumbel, "CHUNK", 512)             # 6 chunks of 512 ids per row, then the pick launch
    monkeypatch.setattr(gumbel, "BLOCK", 256)
    cut = gumbel.gumbel_argmax(logits, temps, seeds, positions, rng.PURPOSE_EXTRA, ids)
    assert torch.equal(whole, cut)
    assert int(cut[0]) == (int(ids[100]) if reduced else 100)


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "top_p": 0.9}, {"min_p": 0.05}])
def test_sample_keyed_on_the_kernel_path_equals_the_cpu_path(monkeypatch, filters):
    g = torch.Generator().manual_seed(1)
    b, v = 32, 500
    logits = torch.randn(b, v, generator=g) * 2
    resolved = resolve_sampling(SamplingParams(temperature=[0.0, 0.8, 1.0, 1.3] * (b // 4), **filters), b,
                                torch.device("cpu"))
    seeds, positions = torch.arange(b) + 1, torch.full((b,), 7)
    cpu = sampling.sample_keyed(logits, resolved, seeds, positions)
    monkeypatch.setattr(sampling, "_kernel_on", lambda t: True)      # the GPU path, through the interpreter
    kernel = sampling.sample_keyed(logits, resolved, seeds, positions)
    _agree(kernel, cpu, log_probs(logits[:, None, :], resolved)[:, 0], seeds, positions, torch.arange(v))


def test_the_draft_samplers_go_through_sample_keyed(monkeypatch):
    from tilespec.engine import execution
    from tilespec.engine.drafters import head
    calls = []
    real = sampling.sample_keyed

    def spy(*args, **kwargs):
        calls.append(kwargs.get("ids") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(execution, "sample_keyed", spy)
    monkeypatch.setattr(head, "sample_keyed", spy)
    resolved = resolve_sampling(SamplingParams(temperature=1.0), 2, torch.device("cpu"))
    seeds, positions = torch.tensor([1, 2]), torch.tensor([3, 4])
    execution.sample_draft(torch.randn(2, 50), resolved, seeds, positions, greedy=False)
    head._sample_draft_vocab(torch.randn(2, 10), torch.arange(10) * 3, resolved, seeds, positions)
    assert calls == [False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_law_on_the_gpu_and_a_planted_bias_fails():
    from tilespec.exactness.stats import fit_test
    n, v = 1_000_000, 8
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0], device="cuda")
    rows = logits.expand(n, v).contiguous()
    seeds, positions = torch.arange(n, device="cuda") * 3 + 1, torch.full((n,), 5, device="cuda")
    for temp, planted in ((0.7, False), (1.0, False), (1.0, True)):
        law = torch.softmax(logits / temp, dim=-1).double().cpu().numpy()
        t = torch.full((n,), temp * (1.05 if planted else 1.0), device="cuda")
        draws = gumbel_argmax(rows, t, seeds, positions, rng.PURPOSE_EXTRA)
        result = fit_test(torch.bincount(draws, minlength=v).cpu().numpy(), law)
        assert (result.p_value > 1e-6) != planted, (temp, planted, result)


def test_head_chains_sample_with_the_kernel_as_with_pytorch():
    from tilespec.engine.tree_step import _gumbel_argmax, chains_kernel
    g = torch.Generator().manual_seed(2)
    b, k, v = 4, 3, 700
    logq = torch.log_softmax(torch.randn(b, k, v, generator=g) * 2, dim=-1)
    vocab = torch.randperm(5000, generator=g)[:v].sort().values
    seeds = torch.arange(b * k).view(b, k) * 7 + 3
    positions = torch.arange(b) + 20
    got, ref = chains_kernel(logq, vocab, seeds, positions), _gumbel_argmax(logq, vocab, seeds, positions)
    assert got.shape == (b, k) and int((got != ref).sum()) <= 1


def test_sample_keyed_refuses_bad_shapes_clearly():
    resolved = resolve_sampling(SamplingParams(temperature=1.0), 2, torch.device("cpu"))
    ok = dict(seeds=torch.tensor([1, 2]), positions=torch.tensor([3, 4]))
    for args, words in ((dict(logits=torch.randn(2, 3, 5)), "logits must be"),
                        (dict(logits=torch.zeros(2, 5, dtype=torch.long)), "logits must be"),
                        (dict(logits=torch.randn(2, 5), seeds=torch.tensor([1])), "seeds must be"),
                        (dict(logits=torch.randn(2, 5), positions=torch.tensor([1.0, 2.0])), "positions must be"),
                        (dict(logits=torch.randn(2, 5), ids=torch.arange(4)), "ids must be"),
                        (dict(logits=torch.randn(3, 5), seeds=torch.tensor([1, 2, 3]),
                              positions=torch.tensor([1, 2, 3])), "resolved for")):
        kw = {**ok, **args}
        with pytest.raises(ValueError, match=words):
            sampling.sample_keyed(kw.pop("logits"), resolved, kw.pop("seeds"), kw.pop("positions"), **kw)
