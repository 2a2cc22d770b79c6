"""GPU checks of the Triton verification kernels (``pytest -m gpu tests/test_kernels_gpu.py`` on a CUDA machine).

What CPU runs cannot show: the compiled large-vocabulary layout (one request per program) agrees with ``reference``
at V = 151,936 in bf16 / fp32; the direct CompiledKernel launch gives the same tokens as Triton's JIT dispatcher
and falls back to it for misaligned inputs; CUDA-graph replay equals eager; the batched small-vocabulary layout and
the large one are batch invariant.
"""
from __future__ import annotations

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

launch = pytest.importorskip("tilespec.verify.kernels.launch")


def _case(batch, k, vocab, dtype=torch.bfloat16, seed=0, similar=0.8):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, device="cuda", generator=gen) * 3
    draft = similar * target[:, :k] + (1 - similar) * torch.randn(batch, k, vocab, device="cuda", generator=gen) * 3
    tokens = torch.multinomial(torch.softmax(draft.reshape(-1, vocab), -1), 1, generator=gen).view(batch, k)
    return target.to(dtype), draft.to(dtype), tokens


def _same_rows(a, b) -> float:
    return ((a.output_tokens == b.output_tokens).all(1) & (a.num_accepted == b.num_accepted)).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.6, top_k=50),
                                      SamplingParams(temperature=0.0)], ids=["t1", "t0.6-top50", "greedy"])
@pytest.mark.parametrize("method", ["fused", "tiled"])
def test_large_vocabulary_matches_reference(method, sampling, dtype):
    target, draft, tokens = _case(64, 5, 151936, dtype)
    kw = dict(draft_logits=draft, sampling=sampling, seed=torch.arange(64, device="cuda"), offsets=7)
    ref = verify(target, tokens, method="reference", **kw)
    got = verify(target, tokens, method=method, **kw)
    assert _same_rows(got, ref) >= 0.99


def test_direct_launch_matches_jit_dispatch(monkeypatch):
    target, draft, tokens = _case(8, 5, 151936)
    kw = dict(draft_logits=draft, seed=torch.arange(8, device="cuda"), offsets=torch.arange(8, device="cuda"),
              check_values=False)
    jit = verify(target, tokens, method="fused", **kw)
    from tilespec.verify.kernels import direct as direct_launch
    monkeypatch.setattr(direct_launch, "_DIRECT", True)   # the direct path lives in kernels/direct.py
    for _ in range(3):
        direct = verify(target, tokens, method="fused", **kw)
    modes = {k.__name__: launch._launcher(k).mode for k in (launch.row_stats_stream_kernel, launch.sample_wide_kernel)}
    assert set(modes.values()) <= {"full", "plain"}, modes
    assert any(p.direct for p in launch._PLANS.values()), "no compiled kernel was cached for a direct launch"
    assert torch.equal(direct.output_tokens, jit.output_tokens) and torch.equal(direct.accepted, jit.accepted)
    small = _case(64, 3, 16)
    ref = verify(small[0], small[2], draft_logits=small[1], method="fused", seed=1)
    for _ in range(2):
        again = verify(small[0], small[2], draft_logits=small[1], method="fused", seed=1)
    assert torch.equal(ref.output_tokens, again.output_tokens)


def test_misaligned_and_strided_inputs_use_the_jit_path_and_stay_correct():
    vocab = 1001   # odd V: a row offset of one element is not 16-byte aligned
    big, draft, tokens = _case(4, 3, vocab, torch.float32)
    padded = torch.cat([torch.zeros(4, 1, vocab, device="cuda"), big], dim=1)
    target = padded[:, 1:]                                   # storage offset of 1001 floats: misaligned
    assert target.data_ptr() % 16 != 0
    kw = dict(draft_logits=draft, seed=torch.arange(4, device="cuda"), offsets=3)
    for method in ("fused", "tiled"):
        ref = verify(target.contiguous(), tokens, method="reference", **kw)
        for _ in range(2):
            got = verify(target, tokens, method=method, **kw)
        assert _same_rows(got, ref) == 1.0


@pytest.mark.parametrize("vocab", [16, 151936])
def test_cuda_graph_replay_matches_eager(vocab):
    target, draft, tokens = _case(4, 5, vocab)
    seeds = torch.arange(4, device="cuda")
    offsets = torch.full((4,), 11, device="cuda")

    def call():
        return verify(target, tokens, draft_logits=draft, method="fused", seed=seeds, offsets=offsets,
                      check_values=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for step in range(3):
        new_t, new_d, new_tok = _case(4, 5, vocab, seed=step + 1)
        target.copy_(new_t), draft.copy_(new_d), tokens.copy_(new_tok), offsets.add_(6)
        graph.replay()
        eager = call()
        assert torch.equal(captured.output_tokens, eager.output_tokens)
        assert torch.equal(captured.num_accepted, eager.num_accepted)


@pytest.mark.parametrize("vocab", [16, 61, 151936])
def test_batch_invariance_on_gpu(vocab):
    batch = 64 if vocab > 1000 else 3000
    target, draft, tokens = _case(batch, 5, vocab, seed=5)
    seeds = torch.arange(batch, device="cuda") * 7 + 1
    full = verify(target, tokens, draft_logits=draft, method="fused", seed=seeds, offsets=5)
    sub = torch.arange(1, batch, 3, device="cuda")
    part = verify(target[sub], tokens[sub], draft_logits=draft[sub], method="fused", seed=seeds[sub], offsets=5)
    assert torch.equal(full.output_tokens[sub], part.output_tokens)
    ref = verify(target, tokens, draft_logits=draft, method="reference", seed=seeds, offsets=5)
    assert _same_rows(full, ref) >= 0.99


def _compiled(*kernels) -> int:
    """How many compiled variants Triton holds for these kernels (all devices)."""
    return sum(len(cache[0]) for fn in kernels for cache in fn.device_caches.values())


@pytest.mark.parametrize("method", ["fused", "tiled", "sigmoid"])
def test_changing_k_does_not_recompile(method):
    # a decoding run changes K from step to step (gamma schedules, ragged finishes): K must stay a runtime argument
    from tilespec.verify.kernels.residual import sample_wide_kernel
    from tilespec.verify.kernels.sample import accept_sample_kernel
    from tilespec.verify.kernels.stream import row_stats_stream_kernel
    from tilespec.verify.kernels.tiled import tiled_partials_kernel
    kernels = (accept_sample_kernel, row_stats_stream_kernel, tiled_partials_kernel, sample_wide_kernel)
    target, draft, tokens = _case(4, 3, 151936, seed=11)
    verify(target, tokens, draft_logits=draft, method=method, seed=1)
    before = _compiled(*kernels)
    for k in (1, 2, 5, 7, 0):
        target, draft, tokens = _case(4, max(k, 1), 151936, seed=12 + k)
        verify(target[:, :k + 1], tokens[:, :k], draft_logits=draft[:, :k], method=method, seed=1)
    assert _compiled(*kernels) == before


def _pass1_stats(monkeypatch, target, draft, tokens, sampling, **globals_):
    """(result, m, s, a) of one fused call at B = target.shape[0], K = 5 with the launch globals ``globals_``."""
    for name, value in globals_.items():
        monkeypatch.setattr(launch, name, value)
    batch, rows, vocab = target.shape
    plan = launch._plan(target.device, batch, rows - 1, vocab, launch.MODE_LOGITS, launch.DRAFT_LOGITS, False, True)
    got = verify(target, tokens, draft_logits=draft, sampling=sampling, method="fused",
                 seed=torch.arange(batch, device="cuda"), offsets=11)
    return got, plan.m.clone(), plan.s.clone(), plan.a.clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pass1_same_bits_for_every_chunks_per_program_and_register_cap(dtype, monkeypatch):
    # the stream pass 1: the same statistics bits (hence tokens) for every chunks-per-program / register-cap value;
    # a misaligned copy of the same rows (2-byte loads, another reduction order): the same maxima and argmaxes,
    # sums within a few ulps (~5,000 of the sums differed on the H100, by at most 5 ulps), nearly the same tokens
    target, draft, tokens = _case(64, 5, 151936, dtype, seed=3)
    sampling = SamplingParams(temperature=[0.0, 1.0, 0.7, 1.0] * 16)
    new = _pass1_stats(monkeypatch, target, draft, tokens, sampling)
    used = torch.zeros(new[1].shape, dtype=torch.bool, device="cuda")   # slots pass 1 writes (the rest: stale)
    used[:, :6] = True
    used[torch.arange(64, device="cuda") % 4 != 0, 6:] = True           # draft rows of sampling requests
    greedy = torch.zeros_like(used)
    greedy[0::4, :6] = True
    # a is written for greedy target rows only: its other slots hold whatever the plan's torch.empty scratch held
    written = (used, used, greedy & used)
    for cpp, maxnreg in ((1, 0), (2, 32), (4, 0), (3, 32), (2, 40)):
        again = _pass1_stats(monkeypatch, target, draft, tokens, sampling, CHUNKS_PER_PROGRAM=cpp, MAXNREG1=maxnreg)
        for name, x, y, w in zip("msa", new[1:], again[1:], written):
            assert torch.equal(x[w], y[w]), (name, cpp, maxnreg, _ulps(x[w], y[w]))
        assert torch.equal(new[0].output_tokens, again[0].output_tokens)
    monkeypatch.setattr(launch, "CHUNKS_PER_PROGRAM", 0)
    monkeypatch.setattr(launch, "MAXNREG1", 40)
    shifted = torch.empty(*target.shape[:2], target.shape[2] + 1, dtype=dtype, device="cuda")[..., 1:]
    shifted.copy_(target)   # row stride V + 1: no 16-byte loads
    unaligned = _pass1_stats(monkeypatch, shifted, draft, tokens, sampling)
    assert torch.equal(new[1][used], unaligned[1][used]) and torch.equal(new[3][greedy & used],
                                                                         unaligned[3][greedy & used])
    assert _max_ulps(new[2][used], unaligned[2][used]) <= 16, _ulps(new[2][used], unaligned[2][used])
    assert _same_rows(new[0], unaligned[0]) >= 0.99


def _max_ulps(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest gap between two same-signed fp32 tensors in units in the last place."""
    gaps = (x.view(torch.int32).long() - y.view(torch.int32).long()).abs()
    return int(gaps.max()) if gaps.numel() else 0


def _ulps(x: torch.Tensor, y: torch.Tensor) -> str:
    """Where two equal-shaped tensors differ: count, and for fp32 the largest gap in units in the last place."""
    diff = x != y
    if x.dtype != torch.float32 or not bool(diff.any()):
        return f"{int(diff.sum())} differ"
    gaps = (x.view(torch.int32).long() - y.view(torch.int32).long())[diff & (x.sign() == y.sign())].abs()
    return f"{int(diff.sum())} differ, max {int(gaps.max()) if gaps.numel() else 'n/a (sign)'} ulp"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk16_thresholds_equal_torch_topk(dtype):
    # the two-histogram top-k kernel at the real vocabulary: torch.topk's thresholds bit for bit
    from tilespec.verify.kernels.keep import _top_k_thresholds
    from tilespec.verify.kernels.topk16 import top_k_thresholds16
    target, _, _ = _case(64, 5, 151936, dtype=dtype, seed=6)
    top_k = torch.tensor([1, 20, 50, 1000] * 16, device="cuda")
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3] * 16, device="cuda")
    got = top_k_thresholds16(target, top_k, temperature)
    assert torch.equal(got, _top_k_thresholds(target, top_k, temperature, 1000))


def _rounded_down_by_triton_division(temperature: float) -> float:
    """A bf16 logit x > 0 whose x / T through Triton's fp32 ``/`` (div.full) is below torch's quotient."""
    import triton
    import triton.language as tl

    @triton.jit
    def div(x_ptr, y_ptr, t, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) / t, mask=i < n)

    x = torch.arange(0x3F80, 0x4200, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16).float()
    y = torch.empty_like(x)
    div[(triton.cdiv(x.numel(), 256),)](x, y, temperature, x.numel(), BLOCK=256)
    below = (y < x / torch.tensor(temperature, device="cuda")).nonzero()
    return float(x[below[0, 0]]) if below.numel() else float("nan")


def test_filtered_kernels_keep_the_threshold_token():
    # the k-th token's z is the threshold itself: the kernels must compute it with the threshold's correctly
    # rounded division, or a 1-ulp-low quotient drops it from the support (it would never be accepted)
    probes = [(t, _rounded_down_by_triton_division(t)) for t in (0.7, 0.6, 0.9, 1.3, 0.3)]
    found = [(t, x) for t, x in probes if x == x]
    if not found:
        pytest.skip("Triton's division is correctly rounded on every probed value")
    temperature, x = found[0]
    batch, vocab = 256, 151936
    target = torch.full((batch, 2, vocab), -30.0, device="cuda")
    target[:, :, 0] = x + 0.5                  # the largest logit
    target[:, :, 1] = x                        # the 2nd largest: the top-2 threshold
    target = target.to(torch.bfloat16)
    assert float(target[0, 0, 1]) == x
    tokens = torch.ones(batch, 1, dtype=torch.int64, device="cuda")
    draft_probs = torch.zeros(batch, 1, vocab, device="cuda")
    draft_probs[..., 1] = 1.0                  # q(1) = 1: accepted with probability p(1) ~ 0.33, never if dropped
    sampling = SamplingParams(temperature=temperature, top_k=2)
    for method in ("fused", "reference"):
        got = verify(target, tokens, draft_probs=draft_probs, sampling=sampling, method=method,
                     seed=torch.arange(batch, device="cuda"))
        assert 0.08 < got.accepted.float().mean().item() < 0.6, method


def test_topk16_top_p_thresholds_keep_the_sorted_set():
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.kernels.topk16 import top_k_thresholds16
    from tilespec.verify.validation import resolve_sampling
    target, _, _ = _case(64, 5, 151936, seed=7)
    s = resolve_sampling(SamplingParams(top_k=[20, 50, 1000, 1] * 16, top_p=[0.8, 0.9, 0.95, 0.5] * 16,
                                        temperature=[0.7, 1.0, 1.3, 0.0] * 16), 64, target.device)
    got = top_k_thresholds16(target, s.top_k, s.temperature, s.top_p, k_max=1000)
    assert torch.equal(got, keep_threshold(target, s, method="sort"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topp16_thresholds_keep_the_sorted_set(dtype):
    # the key-count window at the real vocabulary, with flat rows that take the gated fallback
    from tilespec.verify.filters import scaled_logits, top_p_threshold_sorted
    from tilespec.verify.kernels.topp16 import top_p_thresholds16
    target, _, _ = _case(64, 5, 151936, dtype=dtype, seed=8)
    target[::8] = (target[::8].float() * 0.05).to(dtype)
    top_p = torch.tensor([0.8, 0.9, 0.95, 0.5] * 16, device="cuda")
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0] * 16, device="cuda")
    got = top_p_thresholds16(target, top_p, temperature)
    z = scaled_logits(target, temperature)
    want = top_p_threshold_sorted(z, top_p)
    assert torch.equal(z >= got[..., None], z >= want[..., None])


def test_topp16_min_p_keeps_the_reference_set():
    from tilespec.verify.distributions import filtered_logits
    from tilespec.verify.filters import scaled_logits
    from tilespec.verify.kernels.topp16 import top_p_thresholds16
    from tilespec.verify.validation import resolve_sampling
    target, _, _ = _case(64, 5, 151936, seed=9)
    s = resolve_sampling(SamplingParams(top_p=[1.0, 0.9, 0.8, 1.0] * 16, min_p=[0.05, 0.1, 0.0, 0.2] * 16,
                                        temperature=[0.7, 1.0, 1.3, 0.0] * 16), 64, target.device)
    got = top_p_thresholds16(target, s.top_p, s.temperature, min_p=s.min_p)
    z = scaled_logits(target, s.temperature)
    want = torch.isfinite(filtered_logits(target, s, method="sort"))
    assert torch.equal(z >= got[..., None], want)


@pytest.mark.parametrize("sampling", [SamplingParams(top_p=0.9), SamplingParams(temperature=0.7, top_p=0.8),
                                      SamplingParams(min_p=0.05), SamplingParams(top_p=0.95, min_p=0.1),
                                      SamplingParams(top_k=20), SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
                                      SamplingParams(top_k=50, min_p=0.05)],
                         ids=["p0.9", "t0.7-p0.8", "minp0.05", "p0.95-minp0.1", "k20", "qwen", "k50-minp0.05"])
def test_filtered_fused_matches_reference_and_graph_replay(sampling):
    # 16-bit keep thresholds of target and draft rows in one launch set (topp16 / topk16), eager and replayed
    target, draft, tokens = _case(64, 5, 151936, seed=10)
    kw = dict(draft_logits=draft, sampling=sampling, seed=torch.arange(64, device="cuda"),
              offsets=torch.full((64,), 7, device="cuda"), check_values=False)
    ref = verify(target, tokens, method="reference", **kw)
    got = verify(target, tokens, method="fused", **kw)
    assert _same_rows(got, ref) >= 0.99
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = verify(target, tokens, method="fused", **kw)
    graph.replay()
    again = verify(target, tokens, method="fused", **kw)
    assert torch.equal(captured.output_tokens, got.output_tokens)
    assert torch.equal(again.output_tokens, got.output_tokens)


def test_threshold_kernels_launch_directly_with_the_jit_results(monkeypatch):
    from tilespec.verify.kernels import direct as direct_launch
    from tilespec.verify.kernels import topk16, topp16
    target, draft, _ = _case(8, 5, 151936, seed=11)
    top_k, top_p = torch.full((8,), 50, device="cuda"), torch.full((8,), 0.9, device="cuda")
    temperature = torch.full((8,), 0.7, device="cuda")
    monkeypatch.setattr(direct_launch, "_DIRECT", False)
    jit_k = topk16.top_k_thresholds16(target, top_k, temperature, k_max=50, draft=draft)
    jit_p = topp16.top_p_thresholds16(target, top_p, temperature, draft)
    monkeypatch.setattr(direct_launch, "_DIRECT", True)
    for _ in range(3):
        got_k = topk16.top_k_thresholds16(target, top_k, temperature, k_max=50, draft=draft)
        got_p = topp16.top_p_thresholds16(target, top_p, temperature, draft)
    names = {name for name, _ in direct_launch._Shared.direct}
    assert {"_max_kernel", "_window_kernel", "segment_max_kernel", "collect_pivot_kernel"} <= names, names
    for kernel in (topp16._max_kernel, topp16._finish_kernel, topk16._finish_kernel):
        assert direct_launch._launcher(kernel).mode in ("full", "plain")
    assert all(torch.equal(a, b) for a, b in zip(jit_k + jit_p, got_k + got_p))
