"""The paged attention's PyTorch paths (attention.py's module docstring gives the layout): the reference and test
oracle, per sequence, and :func:`attention_rows`, per query row, for the engine's deterministic mode where the kernel
cannot run; and the host-side checks both share with the kernel."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(q, k_cache, v_cache, block_tables, cu_q, kv_lens, max_q) -> None:
    """Shape / dtype / device checks on host metadata only (no tensor values are read: no sync)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, H, D] and k_cache [num_blocks, block_size, H_kv, D]; got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({k_cache.shape[3]}) differ")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of the cache's KV heads H_kv={hkv}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share one of float32/bfloat16/float16; got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2 or cu_q.dim() != 1 or kv_lens.dim() != 1:
        raise ValueError("block_tables must be [S, max_blocks], cu_q [S + 1] and kv_lens [S]")
    s = block_tables.shape[0]
    if cu_q.shape[0] != s + 1 or kv_lens.shape[0] != s:
        raise ValueError(f"{s} block-table rows need cu_q of {s + 1} and kv_lens of {s} entries; got "
                         f"{cu_q.shape[0]} and {kv_lens.shape[0]}")
    for name, x in (("block_tables", block_tables), ("cu_q", cu_q), ("kv_lens", kv_lens)):
        if x.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
    devs = {x.device for x in (q, k_cache, v_cache, block_tables, cu_q, kv_lens)}
    if len(devs) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devs))}")
    if max_q is not None and (isinstance(max_q, bool) or not isinstance(max_q, int) or max_q < 1):
        raise ValueError(f"max_q must be a positive int (an upper bound on tokens per sequence), got {max_q!r}")


def check_tree_mask(q, tree_mask) -> None:
    """A tree mask is None or int64 [T] on q's device (attention.py's module docstring: one bitmask per query row)."""
    if tree_mask is None:
        return
    if tree_mask.dtype != torch.int64 or tree_mask.shape != (q.shape[0],) or tree_mask.device != q.device:
        raise ValueError(f"tree_mask must be int64 [T] = [{q.shape[0]}] on {q.device}, got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)} on {tree_mask.device}")


def ancestor_bits(masks: torch.Tensor, n: int) -> torch.Tensor:
    """Rows' bitmasks [r] int64 -> [r, n] bool: whether the row sees its sequence's new token m. Bit m (m < 64)
    decides; a token past the 64th is left to the causal mask alone (a chain row's mask is -1: every bit)."""
    m = torch.arange(n, device=masks.device)
    return ((masks[:, None] >> m.clamp(max=63)[None, :]) & 1).bool() | (m >= 64)[None, :]


def paged_attention_reference(q, k_cache, v_cache, block_tables, cu_q, kv_lens, *, scale=None, max_q=None,
                              tree_mask=None) -> torch.Tensor:
    """The PyTorch path and test oracle (reads cu_q / kv_lens on the host): per sequence, its blocks gathered into
    contiguous [L, H_kv, D] K/V and SDPA in fp32 with the causal offset mask and GQA; ``tree_mask`` [T] int64:
    each row sees the new tokens of its ancestor bits only (attention.py's module docstring)."""
    check_inputs(q, k_cache, v_cache, block_tables, cu_q, kv_lens, max_q)
    check_tree_mask(q, tree_mask)
    t, h, d = q.shape
    bs = k_cache.shape[1]
    out = torch.zeros((t, h, d), dtype=q.dtype, device=q.device)
    cu, lens = cu_q.tolist(), kv_lens.tolist()
    for s, L in enumerate(lens):
        a, b = cu[s], cu[s + 1]
        n = b - a
        if n == 0:
            continue
        if not (0 <= a <= b <= t and n <= L <= block_tables.shape[1] * bs) or (max_q is not None and n > max_q):
            raise ValueError(f"sequence {s}: rows {a}:{b} of {t}, kv_len {L} (max_q {max_q}, capacity "
                             f"{block_tables.shape[1] * bs}) are inconsistent")
        k, v = _gathered(k_cache, v_cache, block_tables[s], L)
        keep = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        if tree_mask is not None:
            keep[:, L - n:] &= ancestor_bits(tree_mask[a:b], n)
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).float(), k, v, attn_mask=keep, scale=scale,
                                           enable_gqa=True)
        out[a:b] = o.transpose(0, 1).to(q.dtype)
    return out


def attention_rows(q, k_cache, v_cache, block_tables, cu_q, kv_lens, scale: float, tree_mask=None) -> torch.Tensor:
    """The paged attention's batch-invariant PyTorch path (where the kernel cannot run): each query row alone over
    exactly its keys [0, pos], so a call's shape depends on the row's own position only, never on its sequence's
    other rows, their number, or the batch (the reference's per-sequence SDPA follows the chunk length); a tree row
    (``tree_mask``) masks the new tokens that are not its ancestors within those keys."""
    t, h, d = q.shape
    out = torch.zeros((t, h, d), dtype=q.dtype, device=q.device)
    cu, lens = cu_q.tolist(), kv_lens.tolist()
    for s, length in enumerate(lens):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        k, v = _gathered(k_cache, v_cache, block_tables[s], length)
        for j in range(a, b):
            pos = length - (b - a) + (j - a)
            keep = None
            if tree_mask is not None:
                keep = torch.ones(pos + 1, dtype=torch.bool, device=q.device)
                keep[length - (b - a):] = ancestor_bits(tree_mask[j:j + 1], j - a + 1)[0]
            o = F.scaled_dot_product_attention(q[j][:, None].float(), k[:, :pos + 1], v[:, :pos + 1], scale=scale,
                                               attn_mask=keep, enable_gqa=True)
            out[j] = o[:, 0].to(q.dtype)
    return out


def _gathered(k_cache, v_cache, table, length: int) -> tuple:
    """One sequence's first ``length`` keys and values from its blocks (``table``), contiguous fp32 [H_kv, L, D]."""
    blocks = table[:-(-length // k_cache.shape[1])].long()
    return tuple(c[blocks].flatten(0, 1)[:length].transpose(0, 1).float() for c in (k_cache, v_cache))
