"""Host overhead of one verify() call: the PyTorch ops it issues (each is ~5-10 us of host time eagerly and a kernel
in a CUDA graph when it launches one), and the constant caches that keep that number low without changing results.

The Triton launches are replaced by recording stubs, so only the wrapper's own ops are counted (with a
TorchDispatchMode, which sees every ATen op incl. factories such as torch.empty / torch.full).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import prepare_inputs, resolve_sampling

launch = pytest.importorskip("tilespec.verify.kernels.launch")

# Budgets of ATen ops per call (measured: 4 = the four output tensors; before the caches it was 21 for fused).
FUSED_OPS = 4
RAGGED_EXTRA_OPS = 3      # zeroing the padding ids: unsqueeze, ge, masked_fill


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _StubKernel:
    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
        return run


@pytest.fixture
def stubs(monkeypatch):
    pass1, pass2 = _StubKernel(), _StubKernel()
    for name in ("row_stats_rows_kernel", "row_stats_stream_kernel"):
        monkeypatch.setattr(launch, name, pass1)
    for name in ("accept_sample_kernel", "accept_sample_rows_kernel", "sample_wide_kernel"):
        monkeypatch.setattr(launch, name, pass2)
    return pass1, pass2


def _engine_like_inputs(batch=2, k=5, vocab=1000):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(batch, k + 1, vocab, generator=gen).bfloat16()
    draft = torch.randn(batch, k, vocab, generator=gen).bfloat16()
    tokens = torch.randint(0, vocab, (batch, k), generator=gen)
    return target, draft, tokens, torch.arange(batch) + 100, torch.full((batch,), 37)


def _ops(fn) -> list[str]:
    fn()   # warm-up: plans and constants are made on the first call
    with _CountOps() as counter:
        fn()
    return counter.ops


@pytest.mark.parametrize("method", ["fused", "sigmoid"])
def test_hot_loop_call_issues_only_the_output_allocations(method, stubs):
    target, draft, tokens, seeds, offsets = _engine_like_inputs()
    ops = _ops(lambda: verify(target, tokens, draft_logits=draft, method=method, seed=seeds, offsets=offsets,
                              sampling=SamplingParams(temperature=0.8), check_values=False))
    assert len(ops) <= FUSED_OPS, ops
    assert set(ops) <= {"empty"}, ops          # no fills / copies / casts: nothing that launches a kernel
    pass1, pass2 = stubs
    assert (pass1.launches, pass2.launches) == ((2, 2) if method == "fused" else (0, 2))


def test_ragged_and_python_valued_arguments_stay_cheap(stubs):
    target, draft, tokens, _, _ = _engine_like_inputs()
    lengths = torch.tensor([5, 2])
    ops = _ops(lambda: verify(target, tokens, draft_logits=draft, method="fused", seed=5, offsets=None,
                              num_draft_tokens=lengths, sampling=SamplingParams(temperature=[0.0, 1.0]),
                              check_values=False))
    assert len(ops) <= FUSED_OPS + RAGGED_EXTRA_OPS, ops


def test_cached_constants_follow_the_python_values():
    target, draft, tokens, seeds, offsets = _engine_like_inputs()
    a = prepare_inputs(target, tokens, sampling=SamplingParams(temperature=0.7, top_k=3), seed=11, check_values=False)
    b = prepare_inputs(target, tokens, sampling=SamplingParams(temperature=0.9, top_k=3), seed=12, check_values=False)
    again = prepare_inputs(target, tokens, sampling=SamplingParams(temperature=0.7, top_k=3), seed=11,
                           check_values=False)
    assert a.sampling.temperature.tolist() == pytest.approx([0.7, 0.7])
    assert b.sampling.temperature.tolist() == pytest.approx([0.9, 0.9])
    assert a.seeds.tolist() == [11, 12] and b.seeds.tolist() == [12, 13]
    assert again.sampling is a.sampling and again.seeds is a.seeds      # reused, not rebuilt
    assert a.num_draft_tokens.tolist() == [5, 5] and a.offsets.tolist() == [0, 0]
    # 1 and 1.0 and True are different Python values of the same number: all give the same tensors' contents
    ints = resolve_sampling(SamplingParams(temperature=1), 2, "cpu")
    floats = resolve_sampling(SamplingParams(temperature=1.0), 2, "cpu")
    assert torch.equal(ints.temperature, floats.temperature) and ints.temperature.dtype == torch.float32
    # per-request lists are keyed by their values
    lst = resolve_sampling(SamplingParams(temperature=[0.0, 0.5]), 2, "cpu")
    assert lst.temperature.tolist() == [0.0, 0.5] and lst.any_greedy and not lst.all_greedy
    assert resolve_sampling(SamplingParams(temperature=[0.5, 0.0]), 2, "cpu").temperature.tolist() == [0.5, 0.0]


def test_user_tensors_are_used_as_given():
    target, draft, tokens, seeds, offsets = _engine_like_inputs()
    temp = torch.tensor([0.5, 1.5])
    inputs = prepare_inputs(target, tokens, draft_logits=draft, seed=seeds, offsets=offsets,
                            sampling=SamplingParams(temperature=temp), check_values=False)
    assert inputs.seeds is seeds and inputs.offsets is offsets and inputs.draft_tokens is tokens
    assert inputs.sampling.temperature is temp
    temp.fill_(0.25)  # a tensor parameter is never cached: the next call sees its new values
    again = prepare_inputs(target, tokens, seed=seeds, sampling=SamplingParams(temperature=temp), check_values=False)
    assert again.sampling.temperature.tolist() == [0.25, 0.25]
    # ragged batches get a fresh, masked copy of the tokens (padding ids set to 0)
    ragged = prepare_inputs(target, tokens, num_draft_tokens=torch.tensor([5, 1]), seed=0, check_values=False)
    assert ragged.draft_tokens is not tokens and ragged.draft_tokens[1, 1:].tolist() == [0, 0, 0, 0]
    assert torch.equal(ragged.draft_tokens[0], tokens[0])


def test_bad_python_values_are_still_rejected_after_good_ones_were_cached():
    target, _, tokens, _, _ = _engine_like_inputs()
    prepare_inputs(target, tokens, sampling=SamplingParams(top_p=0.5), seed=0)
    with pytest.raises(ValueError, match="top_p"):
        prepare_inputs(target, tokens, sampling=SamplingParams(top_p=1.5), seed=0)
    with pytest.raises(ValueError, match="top_k must be an integer"):
        prepare_inputs(target, tokens, sampling=SamplingParams(top_k=2.5), seed=0)


@pytest.mark.parametrize("sampling", [SamplingParams(top_p=0.9), SamplingParams(min_p=0.05),
                                      SamplingParams(temperature=0.7, top_k=20, top_p=0.8)],
                         ids=["top-p", "min-p", "top-k-top-p"])
def test_16_bit_filters_add_one_launch_set_and_few_ops(sampling, stubs, monkeypatch):
    # the threshold kernels of target and draft rows: one launch set (3 for topp16, 4 for topk16), their work areas
    # cached, so the ops added per call are the two threshold allocations
    from tilespec.verify.kernels import keep, pivot16, topk16, topp16
    monkeypatch.setattr(keep, "TOPK16_ON_CPU", True)
    kernels = {(topp16, "_max_kernel"), (topp16, "_window_kernel"), (topp16, "_finish_kernel"),
               (pivot16, "segment_max_kernel"), (pivot16, "pivot_kernel"), (pivot16, "collect_pivot_kernel"),
               (topk16, "_finish_kernel")}
    stub = _StubKernel()
    for module, name in kernels:
        monkeypatch.setattr(module, name, stub)
    target, draft, tokens, seeds, offsets = _engine_like_inputs()
    ops = _ops(lambda: verify(target, tokens, draft_logits=draft, method="fused", seed=seeds, offsets=offsets,
                              sampling=sampling, check_values=False))
    assert stub.launches == 2 * (4 if sampling.top_k else 3)      # warm-up and counted call
    assert len(ops) <= FUSED_OPS + 2, " ".join(ops)
    assert set(ops) <= {"empty"}, ops                             # nothing that launches a kernel
