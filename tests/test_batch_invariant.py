"""The paged engine's deterministic mode (engine/paged/invariant.py, attention ``invariant=True``) on CPU: the
invariant linear and RMSNorm match PyTorch and give a row bitwise the same whatever the row count and the other rows;
the invariant attention gives a sequence's rows bitwise the same alone, packed with others, under another max_q or
chunking; and a request's greedy tokens and logprobs on PagedEngine(deterministic=True) are bitwise the same served
alone or among others. Everything runs through Triton's interpreter (conftest sets it), the kernels' CPU path; the
PyTorch fallbacks are checked for the same properties with the interpreter off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tilespec.engine.batching import BatchRequest
from tilespec.engine.native.llama import rms_norm
from tilespec.engine.paged import attention as pa
from tilespec.engine.paged import invariant as inv
from tilespec.engine.paged.engine import PagedEngine

from engine_models import no_eos_lm
from tiers import fast_first

ROWS = (1, 3, 17, 64, 70)       # 70: a second row block of the matmul


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setenv("TRITON_INTERPRET", "0")    # the ops read it per call: the PyTorch path
    return request.param


def _placed(x_row: torch.Tensor, m: int, seed: int) -> tuple:
    """A random [m, K] batch holding ``x_row`` at some row -> (batch, that row)."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randn((m, x_row.shape[-1]), generator=g, dtype=x_row.dtype)
    at = (7 * seed) % m
    batch[at] = x_row
    return batch, at


@pytest.mark.parametrize("dtype, bias", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)])
def test_linear_matches_f_linear_and_a_row_does_not_depend_on_the_batch(path, dtype, bias):
    torch.manual_seed(0)
    k, n = 80, 72                                           # not multiples of the blocks: masked tails
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x = torch.randn(5, k).to(dtype)
    got = inv.linear(x, w, b)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), None if b is None else b.float()),
                               atol=tol, rtol=tol)
    row = x[2]
    outs = []
    for i, m in enumerate(ROWS):
        batch, at = _placed(row, m, i + 1)
        outs.append(inv.linear(batch, w, b)[at])
    assert all(torch.equal(o, outs[0]) for o in outs), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_native_one_and_a_row_does_not_depend_on_the_batch(path, dtype):
    torch.manual_seed(1)
    d = 96
    weight = (1 + 0.1 * torch.randn(d)).to(dtype)
    x = torch.randn(4, d).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(inv.rms_norm(x, weight, 1e-6).float(), rms_norm(x, weight, 1e-6).float(), atol=tol,
                               rtol=tol)
    outs = []
    for i, m in enumerate(ROWS):
        batch, at = _placed(x[1], m, i + 1)
        outs.append(inv.rms_norm(batch, weight, 1e-6)[at])
    assert all(torch.equal(o, outs[0]) for o in outs), path


def test_the_ops_compile_as_opaque_calls():
    """Under torch.compile (eager backend: no Inductor on this CPU tier) the custom ops keep their results."""
    torch.manual_seed(2)
    w, g, x = torch.randn(40, 48), torch.randn(48), torch.randn(9, 48)
    fn = torch.compile(lambda x: inv.linear(inv.rms_norm(x, g, 1e-6), w), backend="eager", fullgraph=True)
    assert torch.equal(fn(x), inv.linear(inv.rms_norm(x, g, 1e-6), w))
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.tilespec.invariant_linear.default, (x, w, torch.randn(40)), test_utils=checks)
    torch.library.opcheck(torch.ops.tilespec.invariant_rms_norm.default, (x, g, 1e-6), test_utils=checks)


def _paged(lens: list, news: list, heads=4, kv_heads=2, d=16, bs=4, seed=0):
    """Caches holding sequences of ``lens`` keys (their blocks shuffled), the step's last ``news`` tokens of each."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in lens]
    blocks = torch.randperm(sum(per), generator=g) + 1        # block 0: scratch
    k = torch.randn((sum(per) + 1, bs, kv_heads, d), generator=g)
    v = torch.randn_like(k)
    width = max(per)
    tables = torch.zeros((len(lens), width), dtype=torch.int32)
    at = 0
    for s, p in enumerate(per):
        tables[s, :p] = blocks[at:at + p]
        at += p
    q = torch.randn((sum(news), heads, d), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(news).cumsum(0)), dtype=torch.int32)
    return q, k, v, tables, cu, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_invariant_attention_of_a_sequence_alone_packed_or_chunked_otherwise(kernel, monkeypatch):
    """Sequence 0 (40 keys, its last 6 tokens new) alone, then beside others with other max_q and table widths,
    then its last 2 tokens only (another chunking): its rows bitwise equal; close to the reference."""
    monkeypatch.setattr(pa, "SPLITS", 8)          # a forced split count must not reach the invariant launch
    q, k, v, tables, cu, lens = _paged([40], [6])
    alone = pa.paged_attention(q, k, v, tables, cu, lens, max_q=6, kernel=kernel, invariant=True)
    ref = pa.paged_attention_reference(q, k, v, tables, cu, lens)
    torch.testing.assert_close(alone, ref, atol=1e-5, rtol=1e-5)
    # the same K/V and queries as sequence 1 of a packed step of three, whose others are longer and wider
    q2, k2, v2, tables2, cu2, lens2 = _paged([90, 40, 7], [33, 6, 1], seed=3)
    k2, v2 = k2.clone(), v2.clone()
    k2[tables2[1, :10].long()], v2[tables2[1, :10].long()] = k[tables[0].long()], v[tables[0].long()]
    q2[33:39] = q
    packed = pa.paged_attention(q2, k2, v2, tables2, cu2, lens2, max_q=33, kernel=kernel, invariant=True)
    assert torch.equal(packed[33:39], alone)
    # a chunk of its last two tokens only
    cu3 = torch.tensor([0, 2], dtype=torch.int32)
    late = pa.paged_attention(q[4:].contiguous(), k, v, tables, cu3, lens, max_q=2, kernel=kernel, invariant=True)
    assert torch.equal(late, alone[4:])


def test_invariant_launch_is_one_split_and_the_decode_tile():
    q, k, _, tables, _, _ = _paged([300] * 2, [64, 64])
    decode = pa.launch_plan(q[:1], k, tables[:1], 1, invariant=True)
    for max_q in (1, 16, 64):
        bm, gp, _, ns = pa.launch_plan(q, k, tables, max_q, invariant=True)
        assert (bm, gp, ns) == decode[:2] + (1,)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(20, 47)), [9, 10, 11], [40, 41, 40, 41, 40] * 3,
           list(range(20, 40)) + [7, 7], [3]]


@pytest.fixture(scope="module")
def target():
    return no_eos_lm()


def _serve(engine, reqs, stagger: bool) -> list:
    """Each request's (token, chosen logprob, top logprobs) per emitted token; ``stagger``: half join later."""
    got, late = {}, reqs[len(reqs) // 2:] if stagger else []
    for r in reqs:
        if r not in late:
            got[engine.submit(r)] = []
    while engine.has_work or late:
        if late and engine.counters["steps"] >= 2:
            for r in late:
                got[engine.submit(r)] = []
            late = []
        for e in engine.step():
            got[e.rid] += list(zip(e.tokens, e.logprobs or [None] * len(e.tokens)))
    return [got[r.rid] for r in reqs]


@pytest.mark.parametrize("draft", fast_first(["ngram", None], 0))     # on CUDA: test_batch_invariant_gpu.py
def test_a_request_alone_and_among_others_gets_bitwise_equal_tokens_and_logprobs(target, draft):
    def ask(i, p):
        return BatchRequest(prompt=p, max_tokens=8, temperature=1.0 if i == 1 else 0.0, seed=i, logprobs=3)

    def engine(**kw):
        return PagedEngine(target, draft, max_batch=4, gamma=3, block_size=4, deterministic=True, pricing=False, **kw)

    alone = [_serve(engine(token_budget=64), [ask(i, p)], False)[0] for i, p in enumerate(PROMPTS[:2])]
    # among others, with a small token budget (prompts chunked otherwise), the prefix cache holding prompt 0's blocks
    warm = engine(token_budget=16)
    _serve(warm, [ask(9, PROMPTS[0] + [1, 2, 3, 4])], False)
    crowd = _serve(warm, [ask(i, p) for i, p in enumerate(PROMPTS)], True)
    assert warm.counters["prefill_tokens"] < sum(map(len, PROMPTS)) + 14      # prompt 0 came from the prefix cache
    assert draft is None or warm.counters["accepted"] > 0
    for i in range(2):
        assert [t for t, _ in crowd[i]] == [t for t, _ in alone[i]]
        for (_, (chosen, top)), (_, (chosen0, top0)) in zip(crowd[i], alone[i]):
            assert chosen == chosen0 and top == top0          # floats compared exactly
