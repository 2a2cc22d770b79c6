"""CPU tests of the Triton verification kernels (``tiled``, ``fused``, ``sigmoid``) under TRITON_INTERPRET=1.

The kernels package switches Triton to its interpreter when no CUDA device exists, so importing it here is enough.
Every exact method uses the same counter-based random numbers as ``reference``, so for the same seeds it must emit
the same tokens up to float rounding: >= 99 % identical rows on random cases, 100 % on well-separated ones.
Block sizes are shrunk so that tiny vocabularies still span several chunks / tiles / programs.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tilespec.verify.api import verify
from tilespec.verify.types import SamplingParams

launch = pytest.importorskip("tilespec.verify.kernels.launch")


@pytest.fixture(autouse=True, params=["rows", "batched"])
def small_blocks(request, monkeypatch):
    """Two layouts of the same kernels: "rows" (one request per program, several chunks / tiles / programs per row:
    the large-vocabulary GPU layout) and "batched" (whole rows in one block, many requests per program)."""
    if request.param == "rows":
        monkeypatch.setattr(launch, "CHUNK1", 64)
        monkeypatch.setattr(launch, "SUB1_STREAM", 16)       # pass 1 loops over 4 slices per chunk
        monkeypatch.setattr(launch, "BLOCK2", 32)
        monkeypatch.setattr(launch, "TILE", 32)
    else:
        monkeypatch.setattr(launch, "CHUNK1", 128)
        monkeypatch.setattr(launch, "BLOCK2", 128)
        monkeypatch.setattr(launch, "TILE", 128)
        monkeypatch.setattr(launch, "ROW_ELEMS", 128 * 8)   # 8 requests per program: several programs per batch
    return request.param


def _case(batch, k, vocab, draft, scale=2.0, dtype=torch.float32, seed=0, similar=0.0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(batch, k + 1, vocab, generator=gen) * scale
    dlog = similar * target[:, :k] + (1 - similar) * torch.randn(batch, k, vocab, generator=gen) * scale
    # draft tokens sampled from the draft so acceptances and rejections both occur
    tokens = torch.distributions.Categorical(logits=dlog).sample() if k else torch.zeros(batch, 0, dtype=torch.long)
    kwargs = {}
    if draft == "logits":
        kwargs["draft_logits"] = dlog.to(dtype)
    elif draft == "probs":
        kwargs["draft_probs"] = torch.softmax(dlog, -1)
    return target.to(dtype), tokens, kwargs


def _rows_first(n: int, target, tokens, kwargs, sampling=None):
    """The first ``n`` requests of a case (and of its per-request sampling lists): the "rows" layout runs one
    program per request, so its interpreter time grows with the batch while its code paths do not."""
    kwargs = {k: v[:n] for k, v in kwargs.items()}
    if sampling is not None:
        sampling = dataclasses.replace(sampling, **{f.name: getattr(sampling, f.name)[:n]
                                                    for f in dataclasses.fields(sampling)
                                                    if isinstance(getattr(sampling, f.name), list)})
    return target[:n], tokens[:n], kwargs, sampling


def _agree(method, target, tokens, kwargs, sampling=SamplingParams(), num_draft=None, seed=11, offsets=3):
    ref = verify(target, tokens, method="reference", sampling=sampling, num_draft_tokens=num_draft, seed=seed,
                 offsets=offsets, **kwargs)
    got = verify(target, tokens, method=method, sampling=sampling, num_draft_tokens=num_draft, seed=seed,
                 offsets=offsets, **kwargs)
    assert got.output_tokens.shape == ref.output_tokens.shape and got.output_tokens.dtype == torch.int64
    # structural invariants hold for every row, whatever the sampled values
    n = got.num_accepted
    assert torch.equal(got.num_emitted, n + 1)
    k_b = torch.as_tensor(num_draft) if num_draft is not None else torch.full_like(n, tokens.shape[1])
    assert bool((n <= k_b).all())
    cols = torch.arange(tokens.shape[1] + 1)[None, :]
    assert bool((got.output_tokens[cols > n[:, None]] == -1).all())
    assert bool((got.output_tokens.gather(1, n[:, None]) >= 0).all())
    assert torch.equal(got.accepted, torch.arange(tokens.shape[1])[None, :] < n[:, None])
    same = (got.output_tokens == ref.output_tokens).all(dim=1) & (got.num_accepted == ref.num_accepted)
    return same.float().mean().item()


def _layouts(values: list, ids: list, methods: tuple, fast_rows: set) -> list:
    """Parameters (small_blocks, method, value) over both layouts, the full grid with ``-m slow``; by default
    "batched" runs each value once, the methods taking turns, and "rows" (many programs per request: several times
    the interpreter time) only the (value id, method) pairs in ``fast_rows``."""
    out = []
    for layout in ("rows", "batched"):
        for i, (value, vid) in enumerate(zip(values, ids)):
            for j, method in enumerate(methods):
                slow = (vid, method) not in fast_rows if layout == "rows" else (i + j) % len(methods) != 0
                out.append(pytest.param(layout, method, value, id=f"{layout}-{vid}-{method}",
                                        marks=[pytest.mark.slow] if slow else []))
    return out


# rows layout by default: fused with draft logits, tiled with probs and none (fused's per-request layout with probs
# and no draft: test_kernels_wide.py, test_kernels_pass1_loop.py)
@pytest.mark.parametrize("small_blocks, method, draft", _layouts(
    ["logits", "probs", "none"], ["logits", "probs", "none"], ("fused", "tiled"),
    {("logits", "fused"), ("probs", "tiled"), ("none", "tiled")}), indirect=["small_blocks"])
def test_matches_reference_random(small_blocks, method, draft):
    target, tokens, kwargs = _case(32, 4, 100, draft, seed=1, similar=0.7)
    num_draft = torch.tensor([4, 0, 1, 3] * 8)
    if small_blocks == "rows":      # 8 of the 32 requests (every draft length twice)
        target, tokens, kwargs, _ = _rows_first(8, target, tokens, kwargs)
        num_draft = num_draft[:8]
    assert _agree(method, target, tokens, kwargs, num_draft=num_draft) >= 0.99


SAMPLINGS = [SamplingParams(temperature=0.6), SamplingParams(temperature=0.0),
             SamplingParams(temperature=[0.0, 1.0, 0.7, 0.0] * 4), SamplingParams(lenience=0.5),
             SamplingParams(temperature=0.0, lenience=0.3), SamplingParams(top_k=5),
             SamplingParams(top_p=0.8, temperature=0.8), SamplingParams(min_p=0.1),
             SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=1.3)]
SAMPLING_IDS = ["t0.6", "greedy", "mixed-t", "lenience", "greedy-lenient", "topk", "topp", "minp", "all-filters"]


# by default the batched layout runs every sampling setting (one method each), the rows layout greedy / sampled rows
# mixed, lenience and all filters at once (each single setting there: -m slow)
@pytest.mark.parametrize("small_blocks, method, sampling", _layouts(
    SAMPLINGS, SAMPLING_IDS, ("fused", "tiled"),
    {("mixed-t", "fused"), ("greedy-lenient", "fused"), ("all-filters", "fused"), ("mixed-t", "tiled"),
     ("lenience", "tiled"), ("greedy-lenient", "tiled"), ("all-filters", "tiled")}), indirect=["small_blocks"])
def test_matches_reference_sampling(small_blocks, method, sampling):
    target, tokens, kwargs = _case(16, 3, 80, "logits", seed=2, similar=0.8)
    if small_blocks == "rows":      # 8 of the 16 requests (mixed-t: each temperature twice)
        target, tokens, kwargs, sampling = _rows_first(8, target, tokens, kwargs, sampling)
    assert _agree(method, target, tokens, kwargs, sampling=sampling) >= 0.99


# rows layout by default in fp16 (bf16 in the per-request layout: test_kernels_pass1_loop.py, test_kernels_stream.py)
@pytest.mark.parametrize("small_blocks, dtype", [
    pytest.param("rows", torch.bfloat16, marks=pytest.mark.slow), ("rows", torch.float16),
    ("batched", torch.bfloat16), ("batched", torch.float16)], ids=["rows-bf16", "rows-fp16", "batched-bf16",
                                                                   "batched-fp16"], indirect=["small_blocks"])
def test_fused_low_precision_inputs(small_blocks, dtype):
    target, tokens, kwargs = _case(12, 3, 100, "logits", dtype=dtype, seed=3, similar=0.6)
    if small_blocks == "rows":
        target, tokens, kwargs, _ = _rows_first(6, target, tokens, kwargs)
    assert _agree("fused", target, tokens, kwargs) >= 0.99


# rows-fused: -m slow (fused's well-separated tokens in the per-request layout by default: test_kernels_wide.py,
# test_kernels_stream.py)
@pytest.mark.parametrize("small_blocks, method", [pytest.param("rows", "fused", marks=pytest.mark.slow),
                                                  ("rows", "tiled"), ("batched", "fused"), ("batched", "tiled")],
                         ids=["rows-fused", "rows-tiled", "batched-fused", "batched-tiled"], indirect=["small_blocks"])
def test_well_separated_cases_match_exactly(small_blocks, method):
    # one dominant token per row: p ~ one-hot, so no decision sits near a rounding boundary
    batch, k, vocab = 6 if small_blocks == "rows" else 12, 3, 90
    gen = torch.Generator().manual_seed(4)
    top = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    target = torch.randn(batch, k + 1, vocab, generator=gen)
    target.scatter_(2, top[..., None], 30.0)
    dlog = torch.randn(batch, k, vocab, generator=gen)
    tokens = torch.where(torch.rand(batch, k, generator=gen) < 0.7, top[:, :k], torch.randint(0, vocab, (batch, k)))
    assert _agree(method, target, tokens, {"draft_logits": dlog}) == 1.0
    assert _agree(method, target, tokens, {}) == 1.0


def test_fused_extremes_and_masks(small_blocks):
    # p = q (acceptance ~1), disjoint supports, -inf masked rows, huge logits (rows: the second chunk all -inf)
    batch, k, vocab = 4 if small_blocks == "rows" else 8, 2, 70
    target = torch.randn(batch, k + 1, vocab) * 3
    target[:, :, 40:] = float("-inf")
    tokens = torch.randint(0, 40, (batch, k))
    same = _agree("fused", target, tokens, {"draft_logits": target[:, :k].clone()})
    disjoint = torch.full((batch, k, vocab), float("-inf"))
    disjoint[:, :, 40:] = 0.0
    tokens2 = torch.randint(40, vocab, (batch, k))
    other = _agree("fused", target, tokens2, {"draft_logits": disjoint})
    huge = _agree("fused", target * 3000, tokens, {"draft_logits": target[:, :k] * 2000})
    assert same == 1.0 and other == 1.0 and huge >= 0.99


def test_fused_is_batch_invariant_and_deterministic(small_blocks):
    batch = 3 if small_blocks == "rows" else 12     # batched: 8 requests per program, so requests change programs
    target, tokens, kwargs = _case(batch, 3, 120, "logits", seed=5, similar=0.5)
    seeds = torch.arange(100, 100 + batch)
    full = verify(target, tokens, method="fused", seed=seeds, **kwargs)
    again = verify(target, tokens, method="fused", seed=seeds, **kwargs)
    perm = torch.randperm(batch)
    sub = verify(target[perm], tokens[perm], method="fused", seed=seeds[perm],
                 draft_logits=kwargs["draft_logits"][perm])
    assert torch.equal(full.output_tokens, again.output_tokens)
    assert torch.equal(full.output_tokens[perm], sub.output_tokens)


def test_k_zero_and_default_blocks(monkeypatch):
    monkeypatch.setattr(launch, "CHUNK1", 8192)
    monkeypatch.setattr(launch, "BLOCK2", 1024)
    target = torch.randn(3, 1, 500)
    tokens = torch.zeros(3, 0, dtype=torch.long)
    for method in ("fused", "tiled", "sigmoid"):
        got = verify(target, tokens, method=method, seed=7)
        assert got.output_tokens.shape == (3, 1) and got.accepted.shape == (3, 0)
        if method != "sigmoid":
            ref = verify(target, tokens, method="reference", seed=7)
            assert torch.equal(got.output_tokens, ref.output_tokens)


def test_sigmoid_is_labelled_and_runs(small_blocks):
    target, tokens, kwargs = _case(4 if small_blocks == "rows" else 16, 3, 100, "logits", seed=6)
    got = verify(target, tokens, method="sigmoid", seed=1, **kwargs)
    assert got.exact is False and got.extras["exact"] is False
    assert "NOT EXACT" in __import__("tilespec.verify.registry", fromlist=["x"]).get_method("sigmoid").description
    assert bool((got.output_tokens.gather(1, got.num_accepted[:, None]) >= 0).all())
    with pytest.raises(NotImplementedError, match="greedy"):
        verify(target, tokens, method="sigmoid", sampling=SamplingParams(temperature=0.0), **kwargs)
    assert (got.extras["alpha"], got.extras["beta"]) == (-1e4, 1e4)
    scaled = verify(target, tokens, method="sigmoid", options={"alpha": -2.0, "beta": 2.0}, seed=1, **kwargs)
    assert (scaled.extras["alpha"], scaled.extras["beta"]) == (-2.0, 2.0)
    with pytest.raises(ValueError, match="no option"):
        verify(target, tokens, method="fused", options={"alpha": -2.0}, seed=1, **kwargs)


@pytest.mark.parametrize("method", ["fused", "tiled", "sigmoid"])
def test_batched_programs_match_one_request_per_program(method, small_blocks, monkeypatch):
    # same chunking, only the number of requests per program differs: results must be identical bit for bit
    if small_blocks == "rows":
        pytest.skip("layout comparison runs once")
    target, tokens, kwargs = _case(16, 3, 100, "logits", seed=8, similar=0.6)      # 2 programs of 8 requests
    num_draft = torch.tensor([3, 0, 1, 2] * 4)
    sampling = SamplingParams(temperature=[0.0, 0.8, 1.0, 1.3] * 4, lenience=[1.0, 1.0, 0.5, 1.0] * 4)
    if method == "sigmoid":
        sampling = SamplingParams(temperature=0.9)

    def run():
        return verify(target, tokens, method=method, num_draft_tokens=num_draft, sampling=sampling, seed=3,
                      offsets=torch.arange(16), **kwargs)

    batched = run()
    monkeypatch.setattr(launch, "ROW_ELEMS", 1)
    single = run()
    assert torch.equal(batched.output_tokens, single.output_tokens)
    assert torch.equal(batched.accepted, single.accepted)


def test_gpu_layout_depends_on_the_vocabulary_only(monkeypatch):
    # batch invariance on GPUs: the block shape (hence the compiled reduction order) must not depend on B
    monkeypatch.setattr(launch, "_INTERPRET", False)
    monkeypatch.setattr(launch, "ROW_ELEMS", 8192)
    monkeypatch.setattr(launch, "MAX_BLOCK_B", 1024)
    for vocab in (16, 61, 1000, 8192, 151936):
        layouts = {launch._block(limit, vocab, batch) for batch in (1, 3, 64, 5000) for limit in (1024,)}
        assert len(layouts) == 1, (vocab, layouts)
    assert launch._block(1024, 151936, 1) == (1024, 149, 1)      # large vocabularies: one request per program
    assert launch._block(8192, 151936, 1) == (8192, 19, 1)
    assert launch._block(1024, 16, 1) == (16, 1, 512)           # small ones: many requests per program
