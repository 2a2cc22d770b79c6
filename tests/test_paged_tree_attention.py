"""Token-tree attention in the paged attention (engine/paged/attention.py, ``tree_mask``): each tree node sees the
sequence's keys before the step and its own ancestors among the step's new tokens. The PyTorch reference, the
batch-invariant row path and the Triton kernel (CPU interpreter) against a dense float64 masked softmax, for trees
of several shapes packed with decode, chain-verify and prefill rows (more than 64 new tokens among them)."""
import math

import pytest
import torch

from tilespec.engine.paged import attention as pa
from tilespec.multidraft.tree import ancestors

from test_paged_attention import make_inputs, needs_kernel

# parents of each tree's nodes 1.. (node 0 is the root: the pending token); parents come before their children
TREES = {
    "chain": [0, 1, 2, 3],
    "star": [0, 0, 0, 0, 0],
    "binary": [0, 0, 1, 1, 2, 2, 3, 3, 4],
    "trie": [0, 1, 2, 0, 4, 1, 6, 6, 3, 0],
    "wide": [0] * 20 + list(range(1, 21)) + list(range(21, 41)) + [41, 42, 43],    # 63 draft nodes: 64 in all
}


def tree_bits(parents: list) -> list:
    """Node m's int64 bitmask over the tree's nodes: bit j set = j is m or one of its ancestors."""
    anc = ancestors(torch.tensor([[-1] + parents]))[0]
    out = []
    for row in anc.tolist():
        bits = sum(1 << j for j, a in enumerate(row) if a)
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)     # as a signed int64
    return out


def packed(shapes: list, seed: int, **kw):
    """Sequences [(tree name or None, new tokens n, length after the step)] -> paged_attention's arguments and the
    tree mask (-1 on chain rows)."""
    args = make_inputs([(n, length) for _, n, length in shapes], seed=seed, **kw)
    masks = []
    for name, n, _ in shapes:
        masks += tree_bits(TREES[name]) if name else [-1] * n
    return args, torch.tensor(masks, dtype=torch.int64)


def dense_tree_attention(q, k_cache, v_cache, tables, cu_q, lens, masks, scale=None):
    """Every row in float64 from explicit positions: keys before the step's new tokens, then the new tokens whose
    bit is set in the row's mask (any new token up to the row's own where the mask has no bit for it)."""
    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s in range(len(lens)):
        a, b, length = int(cu_q[s]), int(cu_q[s + 1]), int(lens[s])
        n, pos = b - a, torch.arange(length)
        blocks = tables[s].long()[pos // bs]
        k = k_cache[blocks, pos % bs].double().repeat_interleave(h // hkv, dim=1)
        v = v_cache[blocks, pos % bs].double().repeat_interleave(h // hkv, dim=1)
        for j in range(n):
            keep = pos <= length - n + j
            for m in range(min(n, 64)):
                if not (int(masks[a + j]) >> m) & 1:
                    keep[length - n + m] = False
            scores = torch.einsum("hd,lhd->hl", q[a + j].double(), k) * scale
            scores = scores.masked_fill(~keep[None, :], float("-inf"))
            out[a + j] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), v)
    return out


CASES = [
    [("binary", 10, 40), (None, 1, 21), ("star", 6, 6), (None, 37, 70), ("chain", 5, 17)],
    [(None, 0, 9), ("trie", 11, 30), (None, 70, 90), ("wide", 64, 100), (None, 3, 3)],
    [("wide", 64, 64), ("binary", 10, 33)],
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_and_row_path_match_dense_tree_attention(case):
    args, masks = packed(CASES[case], seed=case, h=4, hkv=2, d=16, bs=8)
    want = dense_tree_attention(*args, masks)
    got = pa.paged_attention(*args, kernel="torch", tree_mask=masks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    rows = pa.paged_attention(*args, kernel="torch", tree_mask=masks, invariant=True)
    torch.testing.assert_close(rows.double(), want, rtol=1e-5, atol=1e-5)
    # a chain row's mask (-1) is the causal rule: the masked call equals the plain one on chain sequences
    plain = pa.paged_attention(*args, kernel="torch")
    cu = args[4].tolist()
    for s, (name, _, _) in enumerate(CASES[case]):
        if name is None or name == "chain":
            torch.testing.assert_close(got[cu[s]:cu[s + 1]], plain[cu[s]:cu[s + 1]], rtol=1e-6, atol=1e-6)
        else:       # and a tree's rows differ from the causal ones (the mask is not ignored)
            assert not torch.allclose(got[cu[s]:cu[s + 1]], plain[cu[s]:cu[s + 1]], atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("case,g,splits", [(0, 2, 1), (1, 1, 3), (2, 4, 2), (0, 3, None)])
def test_kernel_matches_reference_and_dense(monkeypatch, case, g, splits):
    monkeypatch.setattr(pa, "SPLITS", splits)
    args, masks = packed(CASES[case], seed=10 + case, h=2 * g, hkv=2, d=32)
    max_q = max(n for _, n, _ in CASES[case])
    got = pa.paged_attention(*args, max_q=max_q, kernel="triton", tree_mask=masks)
    assert not pa._KERNEL_FAILED, pa._KERNEL_FAILED
    ref = pa.paged_attention_reference(*args, tree_mask=masks)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), dense_tree_attention(*args, masks), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_invariant_tree_rows_match_reference():
    args, masks = packed(CASES[0], seed=3, h=4, hkv=2, d=16)
    got = pa.paged_attention(*args, kernel="triton", tree_mask=masks, invariant=True)
    torch.testing.assert_close(got, pa.paged_attention_reference(*args, tree_mask=masks), rtol=1e-5, atol=1e-5)


def test_a_bad_tree_mask_is_refused():
    args, masks = packed(CASES[2], seed=0, h=4, hkv=2, d=16)
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        pa.paged_attention(*args, kernel="torch", tree_mask=masks.int())
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        pa.paged_attention(*args, kernel="torch", tree_mask=masks[:-1])


def test_warm_up_compiles_the_tree_variants_for_a_tree_engine(monkeypatch):
    """warm_variants(trees=True) launches every listed variant with a tree mask too (a tree engine's warm-up:
    engine/paged/warmup.py), so a served tree step compiles nothing; chain engines launch the chain variants only."""
    launched = []
    monkeypatch.setattr(pa, "_launch", lambda *args, tree_mask=None, **kw: launched.append(tree_mask is not None))
    monkeypatch.setattr(pa, "kernel_takes", lambda *args: True)
    k = torch.zeros(4, 16, 2, 32)
    chains = pa.warm_variants(torch.float32, k, k, 4, 16, 64)
    assert chains == len(pa.variants(4, 2, 32, 16, 64)) and launched == [False] * chains
    launched.clear()
    assert pa.warm_variants(torch.float32, k, k, 4, 16, 64, trees=True) == 2 * chains
    assert launched == [False, True] * chains
