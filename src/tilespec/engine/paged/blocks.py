"""Paged K/V memory: fixed-size blocks of ``block_size`` token slots, per-request block tables, and prefix caching.

Invariants:
  * Block 0 is the scratch block: never handed out, it takes the writes of padding tokens (graph buckets, padded
    drafts of absent rows), so a real block is written only by the one request that owns it past its computed length.
  * A block is *full* once every one of its ``block_size`` positions holds K/V of a final token (positions below the
    owner's computed length). Only full blocks are hashed; a block's key is a 128-bit digest of the digest of the
    block before it and its own tokens, so a key names the whole token prefix up to the block's end.
  * A cached block may be shared by several requests (``ref`` > 1); nobody writes it again (writes happen only at
    positions >= a request's computed length, which lies past every full block it reads).
  * Free blocks wait in LRU order (the first freed is reused first) and keep their key until reused, so a prefix
    stays findable after its request ended: that is the prefix cache. Reusing a block drops its key.
  * ``free + sum over used blocks == num_blocks - 1`` at all times (tests/test_paged_blocks.py checks it over random
    arrival / cancel / preemption sequences).

The K/V tensors themselves are allocated by :func:`kv_zeros` (the target's and a draft model's caches, a head's):
a device that cannot hold them raises :class:`KVCacheTooLarge`, and the engine names what was asked, what is
free and the setting to lower (:func:`kv_too_large`) instead of the allocator's raw message.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import numpy as np
import torch

SCRATCH = 0
CPU_KV_BYTES = 2 << 30


def default_blocks(block_bytes: int, full: int, fraction: float, device) -> int:
    """How many K/V blocks of ``block_bytes`` to allocate: ``full`` (every request at full length) at most, within
    ``fraction`` of the free GPU memory, or CPU_KV_BYTES of host memory."""
    if device.type != "cuda":
        return max(2, min(full, CPU_KV_BYTES // block_bytes))
    free, _ = torch.cuda.mem_get_info(device)
    return max(2, min(full, int(free * fraction) // block_bytes))


class KVCacheTooLarge(torch.OutOfMemoryError):
    """The K/V blocks asked for do not fit the device's memory. Still an OutOfMemoryError (and so a RuntimeError)
    for callers that catch those; the engine's message says what was asked, what is free and what to lower."""


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation: torch's OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or "can't allocate memory" in str(err)


def kv_zeros(shape: tuple, dtype, device, count: int) -> list:
    """``count`` zero tensors of ``shape`` (K/V caches), or KVCacheTooLarge with none of them kept."""
    tensors: list = []
    try:
        for _ in range(count):
            tensors.append(torch.zeros(shape, dtype=dtype, device=device))
    except RuntimeError as err:
        if not out_of_memory(err):
            raise
        tensors.clear()         # freed before anyone measures what the device has left
        raise KVCacheTooLarge(str(err)) from None
    return tensors


def free_memory(device) -> Optional[int]:
    """Bytes ``device`` can still give: a GPU's free memory (torch's cached blocks returned first), the host's
    available memory for a CPU (None where /proc/meminfo is not there to say)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(n: int) -> str:
    if n >= 2**40:
        return f"{n / 2**40:,.1f} TiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def kv_too_large(num_blocks: int, block_size: int, block_bytes: int, device, free: Optional[int],
                 kv_fraction: float, chosen: bool) -> KVCacheTooLarge:
    """The error for ``num_blocks`` K/V blocks that did not fit ``device`` (``free``: bytes it has without them;
    ``chosen``: the caller passed num_blocks, else they were sized from ``kv_fraction`` or the CPU default)."""
    room = "" if free is None else \
        f"; {device} has {_size(free)} free without them, room for at most {free // block_bytes:,} blocks"
    if chosen:
        fix = "pass a smaller num_blocks, or none to size the cache by kv_fraction of the free memory"
    elif device.type == "cuda":
        fix = (f"lower --kv-fraction (kv_fraction in Python; {kv_fraction} now: the share of the free GPU memory "
               f"the blocks take, the rest is for activations and CUDA graphs) or pass a smaller num_blocks")
    else:
        fix = (f"lower --max-batch / --max-len, or pass a smaller num_blocks (a CPU cache takes at most "
               f"{_size(CPU_KV_BYTES)} by default; --kv-fraction sizes GPU caches)")
    return KVCacheTooLarge(f"the K/V cache does not fit: {num_blocks:,} blocks of {block_size} tokens take "
                           f"{_size(num_blocks * block_bytes)}{room}; {fix}")


def warm_up_out_of_memory(num_blocks: int, block_bytes: int, kv_fraction: float, chosen: bool,
                          max_batch: int) -> KVCacheTooLarge:
    """The error for a warm-up that ran out of device memory once the K/V cache had its share: what the cache holds
    and what to lower (the allocator's message names a size only, not the setting that left too little)."""
    fix = ("pass a smaller num_blocks" if chosen else
           f"lower --kv-fraction (kv_fraction in Python; {kv_fraction} now: the rest of the free GPU memory is for "
           f"activations and CUDA graphs)")
    return KVCacheTooLarge(f"the warm-up ran out of device memory: the K/V cache holds {num_blocks:,} blocks "
                           f"({_size(num_blocks * block_bytes)}) and too little was left to capture the step shapes "
                           f"of {max_batch} rows; {fix}, or lower --max-batch")


def block_key(parent: bytes, tokens) -> bytes:
    """The prefix key of a full block: blake2b-128 over the parent block's key and the block's token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class BlockManager:
    """Owns ``num_blocks`` blocks (block 0 reserved, see the module docstring); requests hold lists of block ids.

    ``prefix_caching``: look full prompt blocks up by key at admission and keep freed blocks findable.
    Counters: ``hits`` / ``queries`` count looked-up prompt blocks that were / could have been reused."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref = [0] * num_blocks
        self.key: list = [None] * num_blocks          # block -> its prefix key (full blocks only)
        self.by_key: dict = {}                        # prefix key -> block
        self.free: OrderedDict = OrderedDict((b, None) for b in range(1, num_blocks))   # LRU order
        self.hits = self.queries = 0

    # ------------------------------------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        if self.key[b] is not None:            # reused: its old prefix is gone
            if self.by_key.get(self.key[b]) == b:
                del self.by_key[self.key[b]]
            self.key[b] = None
        self.ref[b] = 1
        return b

    def _hold(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    # ------------------------------------------------------------------------------------------------ requests
    def match_prefix(self, tokens: list, table: list, keys: list) -> int:
        """Admission of a request with no blocks yet (``table`` and ``keys`` empty lists, filled here): reuse the
        cached full blocks of its longest cached prefix, leaving at least one token to compute (its logits give the
        next token). Returns the number of tokens whose K/V are now in place (a multiple of block_size)."""
        assert not table and not keys
        if not self.prefix_caching:
            return 0
        bs, parent = self.block_size, b""
        full = (len(tokens) - 1) // bs
        self.queries += full
        for i in range(full):
            k = block_key(parent, tokens[i * bs:(i + 1) * bs])
            b = self.by_key.get(k)
            if b is None:
                break
            self._hold(b)
            table.append(b)
            keys.append(k)
            parent = k
            self.hits += 1
        return len(table) * bs

    def grow(self, table: list, tokens: int) -> bool:
        """Give ``table`` blocks for positions [0, tokens); False (nothing taken) when too few blocks are free."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def seal(self, tokens: list, table: list, keys: list, computed: int) -> None:
        """Key every block of ``table`` that ``computed`` final tokens fill (``keys`` holds the keys of the blocks
        already sealed, in order) so later requests with the same prefix find it."""
        bs = self.block_size
        while len(keys) < computed // bs:
            i = len(keys)
            k = block_key(keys[-1] if keys else b"", tokens[i * bs:(i + 1) * bs])
            keys.append(k)
            b = table[i]
            if self.prefix_caching and self.key[b] is None:
                self.key[b] = k
                self.by_key.setdefault(k, b)

    def release(self, table: list, keys: list) -> None:
        """Drop a request's hold on its blocks (it ended or was preempted). Blocks are freed last-first, so the tail
        of a prefix is evicted before its head. Unsealed blocks are freed without a key."""
        for b in reversed(table):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, "block released twice"
            if self.ref[b] == 0:
                self.free[b] = None
        table.clear()
        keys.clear()

    def check(self) -> None:
        """Raise AssertionError if the accounting is broken (tests)."""
        used = sum(1 for b in range(1, self.num_blocks) if self.ref[b] > 0)
        assert used + len(self.free) == self.num_blocks - 1, (used, len(self.free))
        assert all(self.ref[b] == 0 for b in self.free)
        assert self.ref[SCRATCH] == 0 and SCRATCH not in self.free
        assert all(self.key[b] == k for k, b in self.by_key.items())
