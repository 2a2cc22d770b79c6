"""The top-k / top-p threshold kernels for 16-bit logits (kernels/topk16.py: the pivot path and the digit-counting
fallback) give torch.topk's thresholds and the sort's top-p thresholds bit for bit."""
import pytest
import torch

from tilespec.verify import verify
from tilespec.verify.kernels import keep, topk16
from tilespec.verify.kernels.keep import _top_k_thresholds
from tilespec.verify.types import SamplingParams


def _logits(batch, rows, vocab, dtype, seed, coarse=False):
    gen = torch.Generator().manual_seed(seed)
    if coarse:   # few distinct values: ties at the k-th position in most rows
        x = torch.randint(-6, 6, (batch, rows, vocab), generator=gen).float() / 2
    else:        # the spread of real logits, both signs, values near 0
        x = torch.randn(batch, rows, vocab, generator=gen) * 4
    return x.to(dtype)


# every vocabulary with both paths, each path with both dtypes (pairwise, not the full product: interpreter time);
# by default each vocabulary once, both paths and both dtypes among them (the multi-chunk fallback by default:
# test_any_digit_split_gives_the_same_thresholds, test_top_k_then_top_p_equal_the_sort[coarse-bf16-fallback])
@pytest.mark.parametrize("vocab, coarse, dtype, pivot", [
    (9001, False, torch.bfloat16, True), pytest.param(9001, False, torch.float16, False, marks=pytest.mark.slow),
    pytest.param(8200, True, torch.bfloat16, False, marks=pytest.mark.slow), (8200, True, torch.float16, True),
    (37, False, torch.bfloat16, True), (37, False, torch.float16, False)],
    ids=["9001-bf16-pivot", "9001-fp16-fallback", "8200-coarse-bf16-fallback", "8200-coarse-fp16-pivot",
         "37-bf16-pivot", "37-fp16-fallback"])
def test_thresholds_equal_torch_topk(dtype, vocab, coarse, pivot):
    # 9001 and 8200 ids span 3 chunks of topk16.CHUNK; 9001 and 37 are not multiples of 8 (no 16-byte loads)
    logits = _logits(4, 2, vocab, dtype, seed=vocab, coarse=coarse)
    logits[0, 1, : vocab // 2] = float("-inf")          # -inf at and below the k-th position in some rows
    logits[2, 0, :] = 0.0
    logits[2, 0, ::2] = -0.0                             # -0.0 and +0.0 tied: different keys, one value
    top_k = torch.tensor([1, min(37, vocab - 1), vocab - 1, vocab // 2 + 1])
    temperature = torch.tensor([1.0, 0.0, 1.3, 0.37])
    got = topk16.top_k_thresholds16(logits, top_k, temperature, pivot=pivot)
    want = _top_k_thresholds(logits, top_k, temperature, int(top_k.max()))
    assert got.dtype == torch.float32 and got.shape == (4, 2)
    assert torch.equal(got, want)


def test_rows_without_top_k_and_strided_rows():
    base = _logits(3, 5, 4096 + 16, torch.bfloat16, seed=5)
    logits = base[:, 1:4, 8:4096 + 8]                      # batch and row strides of the parent, offset start
    top_k = torch.tensor([0, 4096, 20])                    # off, k = V (keeps all), on
    temperature = torch.tensor([1.0, 1.0, 0.8])
    got = topk16.top_k_thresholds16(logits, top_k, temperature)
    assert torch.isneginf(got[:2]).all()
    want = _top_k_thresholds(logits[2:], top_k[2:], temperature[2:], 20)
    assert torch.equal(got[2:], want)


def test_rejects_other_dtypes_and_layouts():
    assert not topk16.supports(torch.zeros(1, 1, 8))
    assert not topk16.supports(torch.zeros(1, 2, 16, dtype=torch.bfloat16)[..., ::2])
    with pytest.raises(ValueError, match="bf16 / fp16"):
        topk16.top_k_thresholds16(torch.zeros(1, 1, 8), torch.tensor([1]), torch.tensor([1.0]))
    logits = torch.zeros(2, 1, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="top_k must have shape"):
        topk16.top_k_thresholds16(logits, torch.tensor([1]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="temperature must have shape"):
        topk16.top_k_thresholds16(logits, torch.tensor([1, 2]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="chunk"):
        topk16.top_k_thresholds16(logits, torch.tensor([1, 2]), torch.tensor([1.0, 1.0]), chunk=1000)


def assert_routed_in_one_launch_set(monkeypatch, name: str, logits, draft, tokens, sampling):
    """``fused`` with 16-bit logits and ``sampling`` calls ``keep.<name>`` once (target and draft rows in one
    launch set) and emits ``reference``'s tokens."""
    monkeypatch.setattr(keep, "TOPK16_ON_CPU", True)    # on a GPU this is the default route
    calls = []
    real = getattr(keep, name)
    monkeypatch.setattr(keep, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ref = verify(logits, tokens, draft_logits=draft, method="reference", sampling=sampling, seed=3)
    got = verify(logits, tokens, draft_logits=draft, method="fused", sampling=sampling, seed=3)
    assert len(calls) == 1
    assert torch.equal(got.output_tokens, ref.output_tokens)


def test_keep_thresholds_routes_16_bit_top_k_here(monkeypatch):
    tokens = torch.randint(0, 300, (2, 2), generator=torch.Generator().manual_seed(0))
    assert_routed_in_one_launch_set(monkeypatch, "top_k_thresholds16", _logits(2, 3, 300, torch.bfloat16, seed=2),
                                    _logits(2, 2, 300, torch.bfloat16, seed=3), tokens,
                                    SamplingParams(top_k=[5, 40], temperature=[0.9, 1.2]))


def test_target_and_draft_rows_in_one_call():
    gen = torch.Generator().manual_seed(11)
    target = (torch.randn(2, 2, 2100, generator=gen) * 3).bfloat16()
    draft = (torch.randn(2, 1, 2100, generator=gen) * 3).bfloat16()
    draft[1, 0] = 0.5                                      # a flat draft row: the fallback, next to pivot rows
    top_k, temperature, top_p = torch.tensor([7, 40]), torch.tensor([0.7, 1.2]), torch.tensor([0.9, 0.8])
    got_t, got_d = topk16.top_k_thresholds16(target, top_k, temperature, k_max=40, draft=draft)
    assert torch.equal(got_t, _top_k_thresholds(target, top_k, temperature, 40))
    assert torch.equal(got_d, _top_k_thresholds(draft, top_k, temperature, 40))
    got_t, got_d = topk16.top_k_thresholds16(target, top_k, temperature, top_p, 40, draft=draft)
    assert torch.equal(got_t, topk16.top_k_thresholds16(target, top_k, temperature, top_p, 40))
    assert torch.equal(got_d, topk16.top_k_thresholds16(draft, top_k, temperature, top_p, 40))


# pairwise: each path with both dtypes and both value spreads; by default the pivot path on coarse (tied) fp16
# values (top-p after top-k by default on both paths, bf16: test_min_p_after_top_k_and_top_p,
# test_rows_that_overflow_the_pivot_pass_take_the_fallback, test_fused_with_top_k_and_top_p_matches_reference)
@pytest.mark.parametrize("coarse, dtype, pivot", [
    pytest.param(False, torch.bfloat16, True, marks=pytest.mark.slow), (True, torch.float16, True),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in ((True, torch.bfloat16, False),
                                                               (False, torch.float16, False)))],
    ids=["bf16-pivot", "coarse-fp16-pivot", "coarse-bf16-fallback", "fp16-fallback"])
def test_top_k_then_top_p_equal_the_sort(dtype, coarse, pivot):
    # top-p over the top-k-kept set: the collected values, sorted, give filters' sort-based thresholds (coarse
    # values: ties at t_k and among the kept values; k = 1; top_p = 1 leaves t_k)
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.validation import resolve_sampling
    logits = _logits(4, 2, 3001, dtype, seed=7, coarse=coarse)
    logits[0, 1, :50] = float("-inf")
    s = resolve_sampling(SamplingParams(top_k=[1, 20, 50, 300], top_p=[0.9, 0.8, 0.5, 1.0],
                                        temperature=[1.0, 0.7, 0.0, 1.3]), 4, logits.device)
    got = topk16.top_k_thresholds16(logits, s.top_k, s.temperature, s.top_p, k_max=300, pivot=pivot)
    assert torch.equal(got, keep_threshold(logits, s, method="sort"))


def test_top_p_needs_a_small_k_max():
    logits = _logits(1, 1, 64, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="k_max"):
        topk16.top_k_thresholds16(logits, torch.tensor([5]), torch.tensor([1.0]), torch.tensor([0.9]), k_max=0)


@pytest.mark.parametrize("sampling", [SamplingParams(top_k=20, top_p=0.8, temperature=0.7),
                                      SamplingParams(top_k=[3, 0], top_p=0.9)], ids=["qwen", "k0-row"])
def test_fused_with_top_k_and_top_p_matches_reference(sampling, monkeypatch):
    monkeypatch.setattr(keep, "TOPK16_ON_CPU", True)
    # the first goes through topk16's top-p step, the second (a row without top-k) through the radix search
    logits = _logits(2, 3, 500, torch.bfloat16, seed=8)
    draft = _logits(2, 2, 500, torch.bfloat16, seed=9)
    tokens = torch.randint(0, 500, (2, 2), generator=torch.Generator().manual_seed(1))
    for seed in range(2):
        ref = verify(logits, tokens, draft_logits=draft, method="reference", sampling=sampling, seed=seed)
        got = verify(logits, tokens, draft_logits=draft, method="fused", sampling=sampling, seed=seed)
        assert torch.equal(got.output_tokens, ref.output_tokens)


@pytest.mark.parametrize("digits", [(8, 8), (4, 4, 4, 4), (1, 7, 8), (6, 5, 5)])
def test_any_digit_split_gives_the_same_thresholds(digits):
    logits = _logits(2, 3, 5000, torch.bfloat16, seed=11, coarse=True)
    top_k = torch.tensor([7, 300])
    temperature = torch.tensor([0.6, 1.0])
    want = _top_k_thresholds(logits, top_k, temperature, 300)
    got = topk16.top_k_thresholds16(logits, top_k, temperature, digits=digits, chunk=1024, pivot=False)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="digits"):
        topk16.top_k_thresholds16(logits, top_k, temperature, digits=(8, 7))


def test_rows_that_overflow_the_pivot_pass_take_the_fallback():
    # row 0: all ids tied (every key >= the pivot: V > CAP collected); row 1: k above the number of segments;
    # rows 2-3: the pivot path. One call, every row exact, with and without top-p.
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.validation import resolve_sampling
    vocab = 3000
    logits = _logits(4, 1, vocab, torch.bfloat16, seed=12)
    logits[0] = 1.5
    s = resolve_sampling(SamplingParams(top_k=[5, 120, 7, 1], top_p=[0.6, 0.9, 0.8, 0.5]), 4, logits.device)
    n_seg = -(-vocab // topk16.CHUNK) * (topk16.CHUNK // topk16.SEG)
    assert n_seg < 120 and vocab > topk16.CAP_INTERPRETER
    got = topk16.top_k_thresholds16(logits, s.top_k, s.temperature)
    assert torch.equal(got, _top_k_thresholds(logits, s.top_k, s.temperature, 120))
    got = topk16.top_k_thresholds16(logits, s.top_k, s.temperature, s.top_p, k_max=120)
    assert torch.equal(got, keep_threshold(logits, s, method="sort"))


def test_top_p_on_rows_with_fewer_than_k_finite_logits():
    # a row of -inf only keeps -inf (no NaN threshold); a row with 3 finite logits and k = 5 applies top-p to them
    from tilespec.verify.filters import keep_threshold
    from tilespec.verify.validation import resolve_sampling
    logits = _logits(2, 2, 700, torch.bfloat16, seed=14)
    logits[0, 0, :] = float("-inf")
    logits[0, 1, 3:] = float("-inf")
    s = resolve_sampling(SamplingParams(top_k=5, top_p=0.7), 2, logits.device)
    got = topk16.top_k_thresholds16(logits, s.top_k, s.temperature, s.top_p, k_max=5)
    assert torch.equal(got, keep_threshold(logits, s, method="sort"))


def test_cpu_calls_keep_torch_topk_by_default(monkeypatch):
    calls = []
    monkeypatch.setattr(keep, "top_k_thresholds16", lambda *a, **kw: calls.append(1))
    logits = _logits(1, 2, 64, torch.bfloat16, seed=15)
    verify(logits, torch.tensor([[3]]), method="fused", sampling=SamplingParams(top_k=5), seed=0)
    assert not calls


def test_min_p_after_top_k_and_top_p():
    from tilespec.verify.distributions import filtered_logits
    from tilespec.verify.filters import scaled_logits
    from tilespec.verify.validation import resolve_sampling
    logits = _logits(3, 2, 3000, torch.bfloat16, seed=12)
    logits[1, 1] = 0.5                                     # flat: the fallback, whose u* is the row max
    for top_p in (1.0, [1.0, 0.9, 0.8]):
        sp = SamplingParams(top_k=[30, 5, 200], top_p=top_p, min_p=[0.05, 0.2, 0.0], temperature=[1.0, 0.7, 1.2])
        s = resolve_sampling(sp, 3, "cpu")
        got = topk16.top_k_thresholds16(logits, s.top_k, s.temperature, s.top_p if s.has_top_p else None, 200,
                                        min_p=s.min_p)
        want = torch.isfinite(filtered_logits(logits, s, method="sort"))
        assert torch.equal(scaled_logits(logits, s.temperature) >= got[..., None], want)
