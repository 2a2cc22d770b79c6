"""The verify() bad-input sweep: each input a new user might try either works or raises one clear error
naming the problem and the fix. Shape / dtype / NaN / range basics live in test_validation.py; this file holds the
cases the peers' test suites exposed and the edge values of every argument."""
import pytest
import torch

import tilespec
from tilespec import SamplingParams
from tilespec.verify.validation import draft_probs_tolerance

B, K, V = 2, 3, 7
CPU_METHODS = ["reference", "hf", "sigmoid"]


def make(b=B, k=K, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, k + 1, v, generator=g), torch.randn(b, k, v, generator=g), \
        torch.randint(0, v, (b, k), generator=g)


def valid_tokens(res, k=K, v=V):
    emitted = res.output_tokens[res.output_tokens >= 0]
    return bool(((emitted >= 0) & (emitted < v)).all()) and bool((res.num_accepted <= k).all())


# ---------------------------------------------------------------------------- 1. hf with an all-zero residual

def test_hf_issue_example_is_a_clear_error_then_a_fallback_without_checks():
    target, tokens, probs = torch.zeros(1, 2, 4), torch.tensor([[0]]), torch.full((1, 1, 4), 0.9)
    with pytest.raises(ValueError, match=r"draft_probs\[0, 0\] sums to 3.6, not 1.*probs.sum\(-1, keepdim=True\)"):
        tilespec.verify(target, tokens, draft_probs=probs, method="hf", seed=0)
    # trusted-input mode skips the check; the residual (p - q)+ is then all zero and hf falls back to p
    for seed in range(20):
        res = tilespec.verify(target, tokens, draft_probs=probs, method="hf", seed=seed, check_values=False)
        ref = tilespec.verify(target, tokens, draft_probs=probs, method="reference", seed=seed, check_values=False)
        assert valid_tokens(res, 1, 4) and valid_tokens(ref, 1, 4)


def test_hf_zero_residual_from_rounding_falls_back_to_p():
    """q = p except q(x) is a little larger (row sum within tolerance): a rejection leaves (p - q)+ all zero, which
    crashed torch.multinomial before the fix."""
    target = torch.zeros(1, 2, V)
    target[0, :, 0] = -6.0                                   # p(0) ~ 4e-4: q(0) = p(0) + 5e-4 rejects often
    p = torch.log_softmax(target[:, :1].float(), -1).exp()
    q = p.clone()
    q[0, 0, 0] += 5e-4
    tokens = torch.tensor([[0]])
    rejected = 0
    for seed in range(60):
        res = tilespec.verify(target, tokens, draft_probs=q, method="hf", seed=seed)
        assert valid_tokens(res, 1)
        rejected += int(res.num_accepted[0] == 0)
    assert rejected > 10                                     # the fallback path really ran


@pytest.mark.parametrize("method", CPU_METHODS)
def test_p_equals_q_probs_work_for_every_method(method):
    target, _, tokens = make()
    probs = torch.softmax(target[:, :K].float(), -1)
    res = tilespec.verify(target, tokens, draft_probs=probs, method=method, seed=[3, 3])
    assert valid_tokens(res)


# ------------------------------------------------------------------------------------ 2. the draft_probs contract

@pytest.mark.parametrize("method", CPU_METHODS + ["tiled", "fused"])
@pytest.mark.parametrize("scale", [0.99, 1.01, 2.0])
def test_unnormalised_draft_probs_rejected_by_every_method(method, scale):
    target, draft, tokens = make()
    probs = torch.softmax(draft, -1)
    probs[1, 2] *= scale
    with pytest.raises(ValueError, match=rf"draft_probs\[1, 2\] sums to {scale:g}, not 1 \(tolerance 0.001\)"):
        tilespec.verify(target, tokens, draft_probs=probs, method=method, seed=[1, 1])


def test_raw_rand_draft_probs_rejected_normalised_accepted():
    target, _, tokens = make()
    raw = torch.rand(B, K, V, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="pass normalised probabilities"):
        tilespec.verify(target, tokens, draft_probs=raw, seed=0)
    assert valid_tokens(tilespec.verify(target, tokens, draft_probs=raw / raw.sum(-1, keepdim=True), seed=0))


def test_draft_probs_within_tolerance_and_low_precision_rows_pass():
    target, draft, tokens = make()
    probs = torch.softmax(draft, -1)
    probs[0, 0] *= 1 + 5e-4
    assert valid_tokens(tilespec.verify(target, tokens, draft_probs=probs, seed=0))
    big = torch.randn(B, K, 4096, generator=torch.Generator().manual_seed(2)) * 5
    tokens_big = torch.randint(0, 4096, (B, K))
    for dtype in (torch.bfloat16, torch.float16):
        res = tilespec.verify(torch.randn(B, K + 1, 4096).to(dtype), tokens_big,
                              draft_probs=torch.softmax(big, -1).to(dtype), seed=0)
        assert valid_tokens(res, K, 4096)
    assert draft_probs_tolerance(torch.bfloat16) > draft_probs_tolerance(torch.float32) == 1e-3


def test_draft_probs_padding_rows_are_not_checked():
    target, draft, tokens = make()
    probs = torch.softmax(draft, -1)
    probs[0, 1:] = 0.5                                      # request 0 drafted one token: rows 1.. are padding
    assert valid_tokens(tilespec.verify(target, tokens, draft_probs=probs, num_draft_tokens=[1, K], seed=0))


# ------------------------------------------------------------------------------------ 3. hf and per-request seeds

@pytest.mark.parametrize("seed", [[1, 2], torch.tensor([5, 9])])
def test_hf_refuses_different_per_request_seeds(seed):
    target, draft, tokens = make()
    with pytest.raises(ValueError, match=r"method 'hf' draws every request from one generator.*2 different "
                                         r"per-request seeds.*pass one int seed"):
        tilespec.verify(target, tokens, draft_logits=draft, method="hf", seed=seed)


def test_hf_accepts_one_seed_and_equal_seed_lists():
    target, draft, tokens = make()
    a = tilespec.verify(target, tokens, draft_logits=draft, method="hf", seed=7)
    b = tilespec.verify(target, tokens, draft_logits=draft, method="hf", seed=[7, 7])
    assert torch.equal(a.output_tokens, b.output_tokens)
    # trusted mode (the engine's) does not read tensor seeds back; hf's batch dependence is documented there
    c = tilespec.verify(target, tokens, draft_logits=draft, method="hf", seed=torch.tensor([7, 8]),
                        check_values=False)
    assert valid_tokens(c)
    # batch-invariant methods take different per-request seeds as always
    assert valid_tokens(tilespec.verify(target, tokens, draft_logits=draft, seed=[1, 2]))


# --------------------------------------------------------------------------- 4. -1 padding at a used position

def test_minus_one_padding_error_says_how_to_draft_fewer_tokens():
    target, _, tokens = make()
    tokens[1, 2] = -1
    with pytest.raises(ValueError, match=r"draft_tokens\[1, 2\] = -1 is out of range \[0, 7\); for a shorter "
                                         r"draft pass num_draft_tokens.*num_draft_tokens\[1\] = K_b"):
        tilespec.verify(target, tokens)
    res = tilespec.verify(target, tokens, num_draft_tokens=[K, 2], seed=0)   # the fix the message names
    assert int(res.num_accepted[1]) <= 2
    tokens[1, 2] = V
    with pytest.raises(ValueError, match=r"ids must index the target's vocabulary"):
        tilespec.verify(target, tokens)


# --------------------------------------------------------------------------------------------- the sweep proper

def test_float64_and_int32_inputs_work():
    target, draft, tokens = make()
    res = tilespec.verify(target.double(), tokens.int(), draft_probs=torch.softmax(draft.double(), -1), seed=0)
    assert valid_tokens(res)


def test_non_contiguous_and_transposed_tensors_give_the_same_result():
    target, draft, tokens = make()
    base = tilespec.verify(target, tokens, draft_logits=draft, seed=4)
    t2 = target.transpose(0, 2).contiguous().transpose(0, 2)
    d2 = draft.transpose(1, 2).contiguous().transpose(1, 2)
    k2 = tokens.t().contiguous().t()
    assert not t2.is_contiguous() and not k2.is_contiguous()
    other = tilespec.verify(t2, k2, draft_logits=d2, seed=4)
    assert torch.equal(base.output_tokens, other.output_tokens)
    wide = torch.randn(B, K + 1, 2 * V)[..., ::2]                     # strided vocabulary
    assert valid_tokens(tilespec.verify(wide, tokens, seed=0))


@pytest.mark.parametrize("name", ["draft_tokens", "draft_logits", "draft_probs"])
def test_mixed_devices_are_named(name):
    target, draft, tokens = make()
    kw = {"draft_tokens": tokens}
    if name == "draft_tokens":
        kw["draft_tokens"] = tokens.to("meta")
    else:
        kw[name] = (draft if name == "draft_logits" else torch.softmax(draft, -1)).to("meta")
    with pytest.raises(ValueError, match=rf"{name} is on the meta device"):   # the meta check comes first
        tilespec.verify(target, **kw)


@pytest.mark.parametrize("seed,msg", [(2**63, r"seed = 9223372036854775808 does not fit"),
                                      (2**63 - 1, r"request b uses seed \+ b, up to \+ 1"),
                                      ([2**64, 1], r"seed = 18446744073709551616 does not fit")])
def test_huge_seeds_are_a_clear_error(seed, msg):
    target, _, tokens = make()
    with pytest.raises(ValueError, match=msg):
        tilespec.verify(target, tokens, seed=seed)


def test_large_and_negative_seeds_in_range_work():
    target, _, tokens = make()
    for seed in (2**63 - 2, -2**63, -5, [2**62, -2**62]):
        assert valid_tokens(tilespec.verify(target, tokens, seed=seed))
    with pytest.raises(ValueError, match=r"offsets = 1180591620717411303424 does not fit"):
        tilespec.verify(target, tokens, seed=0, offsets=2**70)


@pytest.mark.parametrize("params", [dict(temperature=1e-9), dict(temperature=1e30), dict(top_k=0),
                                    dict(top_k=V + 100), dict(min_p=1.0), dict(top_p=1.0), dict(top_p=1e-9)])
def test_sampling_extremes_that_work(params):
    target, draft, tokens = make()
    res = tilespec.verify(target, tokens, draft_logits=draft, sampling=SamplingParams(**params), seed=0)
    assert valid_tokens(res)
    if params.get("temperature") == 1e-9 or params.get("min_p") == 1.0 or params.get("top_p") == 1e-9:
        # effectively greedy: the emitted non-draft token is the target's argmax at its row
        rows = torch.arange(B)
        last = res.output_tokens[rows, res.num_accepted]
        assert torch.equal(last, target[rows, res.num_accepted].argmax(-1))


@pytest.mark.parametrize("params,msg", [(dict(temperature=-1.0), "temperature must be a finite number >= 0"),
                                        (dict(temperature=float("inf")), "temperature must be a finite number"),
                                        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
                                        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
                                        (dict(lenience=0.0), r"lenience must be in \(0, 1\]"),
                                        (dict(lenience=2.0), r"lenience must be in \(0, 1\]"),
                                        (dict(top_k=[1, 2, 3]), "top_k has 3 entries for a batch of 2")])
def test_sampling_extremes_that_are_errors(params, msg):
    target, _, tokens = make()
    with pytest.raises(ValueError, match=msg):
        tilespec.verify(target, tokens, sampling=SamplingParams(**params), seed=0)


def test_ragged_lengths_out_of_range_and_empty_batch():
    target, _, tokens = make()
    for nd in ([K + 1, 0], [-1, 0]):
        with pytest.raises(ValueError, match=r"num_draft_tokens must lie in \[0, K_max = 3\]"):
            tilespec.verify(target, tokens, num_draft_tokens=nd)
    with pytest.raises(ValueError, match="empty batch"):
        tilespec.verify(torch.randn(0, K + 1, V), torch.zeros(0, K, dtype=torch.long))


def test_neg_inf_draft_probs_and_all_neg_inf_target_rows():
    target, draft, tokens = make()
    probs = torch.softmax(draft, -1)
    probs[0, 0, 0] = float("-inf")
    with pytest.raises(ValueError, match="draft_probs must be finite and non-negative"):
        tilespec.verify(target, tokens, draft_probs=probs)
    target[0, K] = float("-inf")
    with pytest.raises(ValueError, match=r"target_logits\[0, 3\] is -inf everywhere"):
        tilespec.verify(target, tokens)


def test_numpy_integer_seeds_work_float_seeds_are_a_type_error():
    import numpy as np
    target, _, tokens = make()
    base = tilespec.verify(target, tokens, seed=3)
    assert torch.equal(tilespec.verify(target, tokens, seed=np.int64(3)).output_tokens, base.output_tokens)
    assert torch.equal(tilespec.verify(target, tokens, seed=np.array([3, 4])).output_tokens, base.output_tokens)
    for bad in (1.5, torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match=r"seed must be an int or integers \(one per request\).*pass int\(seed\)"):
            tilespec.verify(target, tokens, seed=bad)
