"""One batch row of a runner's slot caches, for continuous batching (engine/batching.py): prefill a new request into
a free row of the fixed-size caches in place, while the other rows keep their K/V.

A runner's caches are [B, H, C, D] per layer. ``row_forward`` runs the model over one request's tokens [1, q] with
caches that are views ``buf[b:b+1]`` of the batch buffers, so the K/V land directly in row b at slots
[write_slot, write_slot + q): no copy, no new buffer (captured step graphs keep their addresses), and the other rows
are neither read nor written. Works for :class:`~tilespec.engine.runner.ModelRunner` (transformers modules, eager)
and :class:`~tilespec.engine.native.NativeRunner` (the native decoder, eager layer). Decoder-only models.
``first_rows`` narrows the runners' buffers to their first rows the same way, so a step runs over the smallest row
count that holds every live request (a lightly loaded server does not pay for its empty rows).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from tilespec.models.cache_keyword import cache_kwarg

from .cache import SlotCache, SlotLayer
from .native import NativeRunner


def ensure_caches(runner, batch: int) -> None:
    """Allocate the runner's K/V buffers for ``batch`` rows (they are otherwise made by the first forward): one
    forward of a pad token per row at slot 0 under an all-false mask (its outputs and K/V are garbage, never valid)."""
    cap = runner.capacity
    tokens = torch.zeros((batch, 1), dtype=torch.int64, device=runner.device)
    mask = torch.zeros((batch, 1, 1, cap), dtype=torch.bool, device=runner.device)
    runner.forward(tokens, tokens, mask, 0, keep=1, compiled=False)


def _row_slot_cache(runner, row: int) -> SlotCache:
    """A SlotCache whose layers are views of row ``row`` of ``runner``'s transformers slot cache."""
    cache = SlotCache(runner.capacity, runner.device)
    for big in runner.cache.layers:
        layer = SlotLayer(runner.capacity, cache.write_pos)
        layer.keys, layer.values = big.keys[row:row + 1], big.values[row:row + 1]
        layer.dtype, layer.device, layer.is_initialized = big.dtype, big.device, True
        cache.layers.append(layer)
    return cache


@torch.inference_mode()
def row_forward(runner, row: int, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                write_slot: int, capture: tuple = ()):
    """Run ``tokens`` [1, q] at ``positions`` [1, q] with bool ``mask`` [1, 1, q, C] through row ``row`` of the
    runner's caches, writing their K/V at slots [write_slot, write_slot + q) of that row only -> float logits of the
    last token [1, V]; with ``capture`` (hidden-state indices, as ``runner.forward`` takes them, for a draft head):
    (logits [1, V], features [1, q, n d])."""
    q = tokens.shape[1]
    if write_slot < 0 or write_slot + q > runner.capacity:
        raise RuntimeError(f"cache overflow: writing {q} slots at {write_slot} into a capacity of {runner.capacity}")
    capture = tuple(capture)
    if isinstance(runner, NativeRunner):
        caches = [tuple(buf[row:row + 1] if j < 2 else buf for j, buf in enumerate(entry)) for entry in runner.caches]
        pos = torch.full((), write_slot, dtype=torch.int64, device=runner.device)
        out = runner.native.forward(tokens, positions, mask, pos, caches, keep=1,
                                    **({"capture": capture} if capture else {}))
        return (out[0].float()[:, -1], out[1]) if capture else out.float()[:, -1]
    if runner.encdec:
        raise TypeError("continuous batching serves decoder-only models")
    cache = _row_slot_cache(runner, row)
    cache.seek(write_slot)
    additive = torch.zeros(mask.shape, dtype=runner.dtype, device=mask.device)
    additive.masked_fill_(~mask, torch.finfo(runner.dtype).min)
    out = runner.model(input_ids=tokens, position_ids=positions, attention_mask=additive, use_cache=True,
                       logits_to_keep=1, output_hidden_states=bool(capture), **{cache_kwarg(runner.model): cache})
    logits = out.logits[:, -1].float()
    if not capture:
        return logits
    return logits, torch.cat([out.hidden_states[i] for i in capture], dim=-1)


def region_mask(capacity: int, start: int, done: int, q: int, device) -> torch.Tensor:
    """Bool mask [1, 1, q, C] for queries at slots [start + done, start + done + q) of a prompt laid out contiguously
    from slot ``start``: query i sees slots start .. start + done + i (causal over the prompt)."""
    slots = torch.arange(capacity, device=device)
    ends = start + done + torch.arange(q, device=device)
    return ((slots[None, :] >= start) & (slots[None, :] <= ends[:, None]))[None, None]


@contextmanager
def first_rows(runners, rows: int):
    """Within the block, every runner's K/V buffers are the views ``buf[:rows]`` of its batch buffers (no copy):
    a step over the first ``rows`` rows only, with its own captured graphs per row count (the views start at the
    same address, so a graph captured for a row count stays valid). Runners: model runners, or objects naming their
    per-row buffers in ``row_buffers`` (a draft runner's own cache, e.g. a head's K/V: attribute names)."""
    saved = []
    for runner in runners:
        if runner is None:
            continue
        names = getattr(runner, "row_buffers", ())
        if names:
            for name in names:
                saved.append((runner, name, getattr(runner, name)))
                setattr(runner, name, getattr(runner, name)[:rows])
        elif isinstance(runner, NativeRunner):
            saved.append((runner, "caches", runner.caches))
            # the views per row count are made once per set of K/V buffers (56 slicings per step otherwise)
            owner = (runner.cache_version, id(runner.caches))
            held = runner.__dict__.get("_row_views")
            if held is None or held[0] != owner:          # new buffers: drop the views of the old ones
                held = runner.__dict__["_row_views"] = (owner, {})
            views = held[1]
            if rows not in views:
                views[rows] = [tuple(buf[:rows] for buf in entry) for entry in runner.caches]
            runner.caches = views[rows]
        else:
            for layer in runner.cache.layers:
                saved += [(layer, "keys", layer.keys), (layer, "values", layer.values)]
                layer.keys, layer.values = layer.keys[:rows], layer.values[:rows]
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
