"""Bad input to tilespec.verify() raises a clear ValueError / TypeError naming the problem."""
import pytest
import torch

import tilespec
from tilespec import SamplingParams

B, K, V = 2, 3, 7


def make(b=B, k=K, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, k + 1, v, generator=g)
    draft = torch.randn(b, k, v, generator=g)
    tokens = torch.randint(0, v, (b, k), generator=g)
    return target, draft, tokens


def call(target=None, tokens=None, **kw):
    t, _, d = make()
    return tilespec.verify(t if target is None else target, d if tokens is None else tokens, seed=0, **kw)


# -------------------------------------------------------------------------------------------------- shapes / types

@pytest.mark.parametrize("shape", [(B, V), (B, K + 1, V, 1), (V,)])
def test_target_wrong_ndim(shape):
    _, _, tokens = make()
    with pytest.raises(ValueError, match=r"target_logits must have 3 dimensions"):
        tilespec.verify(torch.randn(*shape), tokens)


def test_draft_tokens_wrong_ndim():
    target, _, tokens = make()
    with pytest.raises(ValueError, match=r"draft_tokens must have 2 dimensions"):
        tilespec.verify(target, tokens.flatten())


def test_not_a_tensor():
    target, _, tokens = make()
    with pytest.raises(TypeError, match="target_logits must be a torch.Tensor"):
        tilespec.verify(target.tolist(), tokens)
    with pytest.raises(TypeError, match="draft_tokens must be a torch.Tensor"):
        tilespec.verify(target, tokens.tolist())


@pytest.mark.parametrize("tok_shape", [(B, K + 1), (B, K - 1), (B + 1, K)])
def test_target_vs_draft_tokens_shape_mismatch(tok_shape):
    target, _, _ = make()
    with pytest.raises(ValueError, match=r"draft_tokens must have shape \[B, K\]"):
        tilespec.verify(target, torch.zeros(tok_shape, dtype=torch.long))


@pytest.mark.parametrize("name", ["draft_logits", "draft_probs"])
def test_vocab_mismatch(name):
    target, _, tokens = make()
    draft = torch.softmax(torch.randn(B, K, V + 1), -1)
    with pytest.raises(ValueError, match=rf"vocabulary mismatch.*V = {V}.*{name} has V = {V + 1}"):
        tilespec.verify(target, tokens, **{name: draft})


@pytest.mark.parametrize("name", ["draft_logits", "draft_probs"])
def test_draft_batch_or_k_mismatch(name):
    target, _, tokens = make()
    with pytest.raises(ValueError, match=rf"{name} must have shape \[B, K, V\]"):
        tilespec.verify(target, tokens, **{name: torch.softmax(torch.randn(B, K + 1, V), -1)})
    with pytest.raises(ValueError, match=rf"{name} must have 3 dimensions"):
        tilespec.verify(target, tokens, **{name: torch.softmax(torch.randn(B, V), -1)})


def test_both_draft_logits_and_probs():
    target, draft, tokens = make()
    with pytest.raises(ValueError, match="draft_logits or draft_probs, not both"):
        tilespec.verify(target, tokens, draft_logits=draft, draft_probs=torch.softmax(draft, -1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_logits_dtype(dtype):
    target, draft, tokens = make()
    with pytest.raises(TypeError, match=r"target_logits must be float"):
        tilespec.verify(target.to(dtype), tokens)
    with pytest.raises(TypeError, match=r"draft_logits must be float"):
        tilespec.verify(target, tokens, draft_logits=draft.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool])
def test_non_integer_draft_tokens(dtype):
    target, _, tokens = make()
    with pytest.raises(TypeError, match="draft_tokens must be an integer tensor"):
        tilespec.verify(target, tokens.to(dtype))


def test_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        tilespec.verify(torch.randn(0, K + 1, V), torch.zeros(0, K, dtype=torch.long))


def test_zero_vocab():
    with pytest.raises(ValueError, match="V >= 1"):
        tilespec.verify(torch.randn(B, K + 1, 0), torch.zeros(B, K, dtype=torch.long))


# -------------------------------------------------------------------------------------------------------- values

@pytest.mark.parametrize("bad,msg", [(float("nan"), "target_logits contains NaN"),
                                     (float("inf"), r"target_logits contains \+inf")])
def test_nan_inf_in_target_logits(bad, msg):
    target, _, tokens = make()
    target[1, 2, 3] = bad
    with pytest.raises(ValueError, match=msg):
        tilespec.verify(target, tokens)


@pytest.mark.parametrize("bad,msg", [(float("nan"), "draft_logits contains NaN"),
                                     (float("inf"), r"draft_logits contains \+inf")])
def test_nan_inf_in_draft_logits(bad, msg):
    target, draft, tokens = make()
    draft[0, 1, 0] = bad
    with pytest.raises(ValueError, match=msg):
        tilespec.verify(target, tokens, draft_logits=draft)


def test_bad_draft_probs():
    target, draft, tokens = make()
    probs = torch.softmax(draft, -1)
    for bad in (float("nan"), float("inf"), -0.1):
        p = probs.clone()
        p[0, 0, 0] = bad
        with pytest.raises(ValueError, match="draft_probs must be finite and non-negative"):
            tilespec.verify(target, tokens, draft_probs=p)
    p = probs.clone()
    p[1, 2] = 0
    with pytest.raises(ValueError, match="draft_probs has a used row with zero mass"):
        tilespec.verify(target, tokens, draft_probs=p)


def test_fully_masked_row():
    target, draft, tokens = make()
    target[1, 2] = float("-inf")
    with pytest.raises(ValueError, match=r"target_logits\[1, 2\] is -inf everywhere"):
        tilespec.verify(target, tokens)
    target, draft, tokens = make()
    draft[0, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"draft_logits\[0, 1\] is -inf everywhere"):
        tilespec.verify(target, tokens, draft_logits=draft)


def test_partly_masked_rows_and_masked_padding_rows_are_fine():
    target, draft, tokens = make()
    target[:, :, :3] = float("-inf")  # top-k style masking
    draft[:, :, 3:] = float("-inf")   # draft tokens outside the target's support: allowed, they get rejected
    tokens = tokens % 3
    target[0, 2:] = float("-inf")     # request 0 uses rows 0..1 only (K_0 = 1)
    draft[0, 1:] = float("-inf")
    res = tilespec.verify(target, tokens, draft_logits=draft, num_draft_tokens=[1, K], seed=1)
    assert int(res.num_emitted[0]) <= 2
    emitted = res.output_tokens[res.output_tokens >= 0]
    assert bool((emitted < V).all())


@pytest.mark.parametrize("bad_id", [-1, V, V + 100])
def test_token_ids_out_of_range(bad_id):
    target, _, tokens = make()
    tokens[1, 2] = bad_id
    with pytest.raises(ValueError, match=rf"draft_tokens\[1, 2\] = {bad_id} is out of range \[0, {V}\)"):
        tilespec.verify(target, tokens)


def test_padding_positions_may_hold_any_in_range_id():
    target, draft, tokens = make()
    for pad in range(V):
        tokens[0, 1:] = pad
        res = tilespec.verify(target, tokens, draft_logits=draft, num_draft_tokens=[1, K], seed=5)
        assert int(res.num_accepted[0]) <= 1
    # the padding does not change request 0's result
    base = tilespec.verify(target, tokens, draft_logits=draft, num_draft_tokens=[1, K], seed=5)
    tokens2 = tokens.clone()
    tokens2[0, 1:] = 0
    other = tilespec.verify(target, tokens2, draft_logits=draft, num_draft_tokens=[1, K], seed=5)
    assert torch.equal(base.output_tokens, other.output_tokens)


def test_padding_positions_are_not_range_checked():
    # ids outside [0, V) at padding positions are not read (the contract only promises in-range ids work, but an
    # engine's -1 padding should not be an error either)
    target, _, tokens = make()
    tokens[0, 1:] = -1
    res = tilespec.verify(target, tokens, num_draft_tokens=[1, K], seed=0)
    assert res.output_tokens.shape == (B, K + 1)


# ----------------------------------------------------------------------------------------------- num_draft_tokens

@pytest.mark.parametrize("nd", [[0, K + 1], [-1, 1], torch.tensor([K, K + 5])])
def test_num_draft_tokens_out_of_range(nd):
    with pytest.raises(ValueError, match=rf"num_draft_tokens must lie in \[0, K_max = {K}\]"):
        call(num_draft_tokens=nd)


@pytest.mark.parametrize("nd", [[1], [1, 2, 3], torch.tensor([[1, 2]]), 2])
def test_num_draft_tokens_wrong_shape(nd):
    with pytest.raises(ValueError, match=rf"num_draft_tokens must have shape \[{B}\]"):
        call(num_draft_tokens=nd)


@pytest.mark.parametrize("nd", [torch.tensor([1.0, 2.0]), [1.5, 2], [True, False], torch.tensor([True, True])])
def test_num_draft_tokens_not_integer(nd):
    with pytest.raises(TypeError, match="num_draft_tokens must"):
        call(num_draft_tokens=nd)


def test_num_draft_tokens_accepts_sequences():
    for nd in ([0, 2], (0, 2), torch.tensor([0, 2], dtype=torch.int32)):
        res = call(num_draft_tokens=nd)
        assert int(res.num_accepted[0]) == 0 and int(res.num_accepted[1]) <= 2


# -------------------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("params,msg", [
    (dict(temperature=-0.5), r"sampling.temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature=float("nan")), r"sampling.temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"sampling.top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), r"sampling.top_p must be in \(0, 1\], got 1.5"),
    (dict(top_p=-0.1), r"sampling.top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"sampling.min_p must be in \[0, 1\], got -0.1"),
    (dict(min_p=1.5), r"sampling.min_p must be in \[0, 1\], got 1.5"),
    (dict(lenience=0.0), r"sampling.lenience must be in \(0, 1\], got 0.0"),
    (dict(lenience=1.2), r"sampling.lenience must be in \(0, 1\], got 1.2"),
    (dict(top_k=-1), r"sampling.top_k must be an integer >= 0"),
    (dict(top_k=2.5), r"sampling.top_k must be an integer"),
    (dict(top_p=[0.9, 0.0]), r"sampling.top_p must be in \(0, 1\], got 0.0"),
])
def test_bad_sampling_scalars(params, msg):
    with pytest.raises(ValueError, match=msg):
        call(sampling=SamplingParams(**params))


EDGES = [0, 1, -1, 0.0, 0.5, 1.0, 1.5, -0.5, 2.5, True, False, float("nan"), float("inf"), -float("inf"), 2**53,
         2**63 - 1, 2**63, -2**63 - 1, 10**400, 1e20, 1e39, 3.4e38, 5e-46, [0.5], (1,), [1, 2], "a", None,
         torch.tensor(0.5), torch.tensor([-1.0])]


def _outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as err:        # noqa: BLE001 - the outcome compared, whatever it is
        return f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("field", range(4))
def test_the_torch_free_request_check_decides_as_resolve_sampling(field):
    """check_request's sampling check (the API processes', without torch) refuses and accepts the values
    resolve_sampling does, with its messages; it hands whatever is not a plain number to resolve_sampling."""
    from tilespec.engine.batch_request import BatchRequest, check_request
    from tilespec.verify.sampling_rules import check_plain
    from tilespec.verify.validation import resolve_sampling
    for value in EDGES:
        values = [1.0, 0, 1.0, 0.0]
        values[field] = value
        torch_says = _outcome(lambda: resolve_sampling(SamplingParams(*values), 1, "cpu"))
        try:
            checked = check_plain(*values)
        except ValueError as err:
            assert f"ValueError: {err}" == torch_says
        else:
            assert not checked or torch_says == "ok", value      # False: not plain numbers, torch decides
        request = BatchRequest([1], 1, *values)
        assert _outcome(lambda: check_request(request, 8, 16)) == torch_says, value


@pytest.mark.parametrize("params,msg", [
    (dict(temperature=torch.tensor([1.0, -1.0])), "sampling.temperature must be"),
    (dict(top_p=torch.tensor([0.5, 1.5])), "sampling.top_p must be"),
    (dict(min_p=torch.tensor([0.5, 2.0])), "sampling.min_p must be"),
    (dict(lenience=torch.tensor([0.0, 1.0])), "sampling.lenience must be"),
])
def test_bad_sampling_tensors(params, msg):
    with pytest.raises(ValueError, match=msg):
        call(sampling=SamplingParams(**params))


@pytest.mark.parametrize("field", ["temperature", "top_k", "top_p", "min_p", "lenience"])
def test_per_request_params_wrong_length(field):
    value = [1] * (B + 1) if field == "top_k" else [1.0] * (B + 1)
    with pytest.raises(ValueError, match=rf"sampling.{field} has {B + 1} entries for a batch of {B}"):
        call(sampling=SamplingParams(**{field: value}))
    with pytest.raises(ValueError, match=rf"sampling.{field} must be a scalar or have shape \[{B}\]"):
        call(sampling=SamplingParams(**{field: torch.ones(B + 1)}))


def test_sampling_wrong_type():
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        call(sampling={"temperature": 1.0})


# ------------------------------------------------------------------------------------------- seeds, misc arguments

@pytest.mark.parametrize("seed", [[1, 2, 3], torch.tensor([[1, 2]]), torch.tensor([5, 6, 7])])
def test_seed_wrong_shape(seed):
    with pytest.raises(ValueError, match=rf"seed must be an int or one seed per request \(shape \[{B}\]\)"):
        target, _, tokens = make()
        tilespec.verify(target, tokens, seed=seed)


def test_offsets_wrong_shape_and_generator_type():
    target, _, tokens = make()
    with pytest.raises(ValueError, match=rf"offsets must be an int or have shape \[{B}\]"):
        tilespec.verify(target, tokens, offsets=[1, 2, 3])
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        tilespec.verify(target, tokens, generator=1234)


def test_unknown_method():
    with pytest.raises((ValueError, KeyError), match="no-such-method"):
        call(method="no-such-method")


@pytest.mark.skip(reason="device mismatch needs a second device; the CPU test machines have only one")
def test_device_mismatch():
    target, _, tokens = make()
    with pytest.raises(ValueError, match="draft_tokens is on"):
        tilespec.verify(target.cuda(), tokens)


# -------------------------------------------------------------------------------------------------------- positives

def test_check_values_false_skips_value_checks():
    target, draft, tokens = make()
    with pytest.raises(ValueError, match="top_p"):  # Python-number sampling params are always checked (free)
        tilespec.verify(target, tokens, check_values=False, sampling=SamplingParams(top_p=0.0))
    # tensor-valued sampling params and tensor num_draft_tokens are not read back without check_values
    res = tilespec.verify(target, tokens, check_values=False, num_draft_tokens=torch.tensor([K, K]),
                          sampling=SamplingParams(top_p=torch.tensor([2.0, 2.0])), seed=0)
    assert res.output_tokens.shape == (B, K + 1)
    # NaN logits are not scanned for (the caller promised trusted inputs)
    bad = target.clone()
    bad[1, 3, 0] = float("nan")
    tilespec.verify(bad, tokens, check_values=False, seed=0)
    with pytest.raises(ValueError, match="NaN"):
        tilespec.verify(bad, tokens, seed=0)
    # out-of-range ids at padding positions are masked, not read
    tokens2 = tokens.clone()
    tokens2[0, 1:] = 10 * V
    tilespec.verify(target, tokens2, num_draft_tokens=[1, K], check_values=False, seed=0)


def test_shape_checks_still_run_without_check_values():
    target, _, tokens = make()
    with pytest.raises(ValueError, match="draft_tokens must have shape"):
        tilespec.verify(target, tokens[:, :1], check_values=False)
    with pytest.raises(TypeError, match="target_logits must be float"):
        tilespec.verify(target.long(), tokens, check_values=False)


def test_check_values_false_reads_no_tensor_back(monkeypatch):
    """With check_values=False and tensor-valued arguments prepare_inputs never reads a tensor back to the host
    (on CUDA each read is a sync); with check_values=True the same call does."""
    from tilespec.verify.validation import prepare_inputs
    target, _, tokens = make()
    probs = torch.softmax(torch.randn(B, K, V), -1)
    reads = []
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    kw = dict(draft_probs=probs, num_draft_tokens=torch.tensor([1, K]), seed=torch.tensor([3, 4]),
              offsets=torch.tensor([0, 5]), sampling=SamplingParams(top_p=torch.tensor([0.5, 1.0])))
    inputs = prepare_inputs(target, tokens, check_values=False, **kw)
    assert reads == []
    assert inputs.ragged and inputs.num_draft_tokens is kw["num_draft_tokens"]
    prepare_inputs(target, tokens, check_values=True, **kw)
    assert reads


def test_first_failing_check_names_the_error():
    """prepare_inputs' checks run in a fixed order: shapes, then num_draft_tokens, then values, then seeds /
    offsets, then sampling; with several bad arguments the earliest one is reported."""
    from tilespec.verify.validation import prepare_inputs
    target, _, tokens = make()
    nan = target.clone()
    nan[0, 0, 0] = float("nan")
    bad_sampling = SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="draft_tokens must have shape"):
        prepare_inputs(nan, tokens[:, :1], num_draft_tokens=[K + 1, 0], sampling=bad_sampling)
    with pytest.raises(ValueError, match="num_draft_tokens must lie in"):
        prepare_inputs(nan, tokens, num_draft_tokens=[K + 1, 0], seed=1.5, sampling=bad_sampling)
    with pytest.raises(ValueError, match="target_logits contains NaN"):
        prepare_inputs(nan, tokens, seed=1.5, offsets=[1], sampling=bad_sampling)
    with pytest.raises(ValueError, match="offsets must be an int or have shape"):
        prepare_inputs(target, tokens, seed=1.5, offsets=[1], sampling=bad_sampling)
    with pytest.raises(ValueError, match="seed = .* does not fit"):
        prepare_inputs(target, tokens, seed=2**63 - 1, offsets=[1], sampling=bad_sampling)
    with pytest.raises(TypeError, match="seed must be an int or integers"):
        prepare_inputs(target, tokens, seed=1.5, generator="g", sampling=bad_sampling)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        prepare_inputs(target, tokens, generator="g", sampling=bad_sampling)
    with pytest.raises(ValueError, match="sampling.top_p"):
        prepare_inputs(target, tokens, sampling=bad_sampling)


@pytest.mark.parametrize("method", ["reference", "hf"])
def test_k_zero(method):
    b = 1 if method == "hf" else 3
    target = torch.randn(b, 1, V)
    res = tilespec.verify(target, torch.zeros(b, 0, dtype=torch.long), seed=0, method=method)
    assert res.output_tokens.shape == (b, 1)
    assert res.num_accepted.tolist() == [0] * b and res.num_emitted.tolist() == [1] * b
    assert bool(((res.output_tokens >= 0) & (res.output_tokens < V)).all())
    assert res.accepted.shape == (b, 0)
    greedy = tilespec.verify(target, torch.zeros(b, 0, dtype=torch.long), sampling=SamplingParams.greedy(),
                             method=method)
    assert greedy.output_tokens[:, 0].tolist() == target[:, 0].argmax(-1).tolist()


def test_valid_inputs_all_dtypes():
    target, draft, tokens = make()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        res = tilespec.verify(target.to(dtype), tokens.int(), draft_logits=draft.to(dtype), seed=0)
        assert res.output_tokens.dtype == torch.int64


def test_method_options_are_validated_and_registry_records_describe_methods():
    from tilespec.verify.registry import all_methods, get_method
    names = [m.name for m in all_methods()]
    assert names[:5] == ["hf", "reference", "tiled", "fused", "sigmoid"]
    assert {m.name for m in all_methods() if m.graph_safe} == {"reference", "fused", "sigmoid", "tiled", "coupled"}
    assert not get_method("sigmoid").exact and get_method("sigmoid").needs_triton
    assert get_method("sigmoid").resolve_options({"beta": 5}) == (("alpha", -1e4), ("beta", 5.0))
    with pytest.raises(ValueError, match="no option"):
        get_method("reference").resolve_options({"alpha": 1.0})
    with pytest.raises(ValueError, match="alpha < 0 < beta"):
        get_method("sigmoid").resolve_options({"alpha": 1.0})
