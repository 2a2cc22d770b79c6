"""Preallocated slot KV caches with a shared write pointer and masked holes (rollback without copying).

Layout (gpt-fast style, generalised to ragged batches): every layer holds keys/values of shape
[B, H, C, D] (C = capacity in *slots*). All requests of a batch write a forward's q new tokens at the same slots
[W, W+q), W being the shared write pointer (a 0-d int64 tensor, so a compiled step reads it without recompiling).
Which slots really belong to a request's sequence is kept by the engine in a bool mask ``valid`` [B, C]; a rejected
speculative token simply stays behind as a masked hole, or is overwritten when the pointer does not advance past it.
Rolling back is therefore free: nothing is cropped or copied. Positions (RoPE / learned embeddings) are passed
explicitly per request, so holes do not shift them.

Copies happen only in :func:`gather_slots` (defragmenting when the pointer reaches the capacity, or dropping
finished requests from the batch), which is rare.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin



class SlotLayer(CacheLayerMixin):
    """One attention layer's static K/V buffers; ``update`` writes q new states at slots [W, W+q)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, capacity: int, write_pos: torch.Tensor):
        super().__init__()
        self.capacity = capacity
        self.write_pos = write_pos

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h = key_states.shape[:2]
        self.keys = torch.zeros((b, h, self.capacity, key_states.shape[-1]), dtype=self.dtype, device=self.device)
        self.values = torch.zeros((b, h, self.capacity, value_states.shape[-1]), dtype=self.dtype,
                                  device=self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states: [B, H, q, D] -> the whole buffers [B, H, C, D] (the mask hides unused slots)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.write_pos + torch.arange(key_states.shape[-2], device=self.keys.device)
        self.keys.index_copy_(2, slots, key_states.to(self.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def get_seq_length(self) -> int:
        return 0  # positions are always passed explicitly; never derive them from the cache

    def get_max_length(self) -> int:
        return self.capacity


class SlotCache(Cache):
    """A transformers ``Cache`` whose layers are :class:`SlotLayer` sharing one write pointer.

    capacity: slots per request; ``write_pos``: 0-d int64 tensor on the model's device (set with :meth:`seek`).
    Layers are created on first use (one per attention layer of the model that fills it).
    """

    def __init__(self, capacity: int, device: torch.device | str):
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.write_pos = torch.zeros((), dtype=torch.int64, device=device)
        super().__init__(layer_class_to_replicate=lambda: SlotLayer(capacity, self.write_pos))

    def seek(self, slot: int) -> None:
        """Point the next forward's writes at slots [slot, slot + q)."""
        self.write_pos.fill_(slot)

    def tensors(self) -> list[torch.Tensor]:
        """Every K and V buffer [B, H, C, D] (for gathering and memory accounting)."""
        out = []
        for layer in self.layers:
            if getattr(layer, "is_initialized", False):
                out += [layer.keys, layer.values]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def gather_buffer(buf: torch.Tensor, rows: torch.Tensor, slot_index: torch.Tensor) -> torch.Tensor:
    """``buf[rows[i], :, slot_index[i, j]]`` for a K/V buffer [B, H, C, D]: a new tensor [B', H, C', D]."""
    src = buf.index_select(0, rows)
    idx = slot_index[:, None, :, None].expand(src.shape[0], src.shape[1], slot_index.shape[1], src.shape[3])
    return torch.gather(src, 2, idx)


def gather_attr(obj, name: str, rows: torch.Tensor, slot_index: torch.Tensor) -> bool:
    """Set ``obj.<name>`` (a K/V buffer [B, H, C, D]) to its :func:`gather_buffer`: copied back in place when the
    shape is unchanged (static addresses survive for captured steps), else replaced. True when it was replaced."""
    buf = getattr(obj, name)
    new = gather_buffer(buf, rows, slot_index)
    if new.shape == buf.shape:
        buf.copy_(new)
        return False
    setattr(obj, name, new)
    return True


def gather_slots(caches: list[SlotCache], rows: torch.Tensor, slot_index: torch.Tensor) -> None:
    """Rebuild every buffer as ``buf[rows[i], :, slot_index[i, j]]`` (batch selection + per-request slot gather).

    rows: [B'] int64 requests to keep; slot_index: [B', C] int64 source slot for each destination slot.
    When B' equals the current batch the result is copied back in place (static addresses survive for compiled
    steps); otherwise new buffers replace the old ones (the batch shrank).
    """
    for cache in caches:
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            for name in ("keys", "values"):
                gather_attr(layer, name, rows, slot_index)
